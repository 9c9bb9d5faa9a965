"""Key/value cache for incremental decoding.

Each layer owns preallocated key and value tensors of shape (B, nkv, max_len, hs) (nkv: key/value heads)
and a fill length.
Appending writes into the preallocated storage in place, so decoding allocates nothing per token.
"""

import torch


class LayerKVCache:
    """Keys and values of one attention layer for the positions seen so far."""

    def __init__(
        self,
        batch_size: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        shape = (batch_size, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.size(2)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the keys and values of T new positions and return those of all positions so far.

        k, v: (B, nh, T, hs). Returns views (B, nh, length + T, hs) into the cache storage.
        """
        start, end = self.length, self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions exceed its max_len={self.max_len}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """One `LayerKVCache` per transformer block; `length` is the number of positions already cached."""

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.layers = [
            LayerKVCache(batch_size, n_head, max_len, head_dim, device, dtype) for _ in range(n_layer)
        ]

    def __getitem__(self, layer: int) -> LayerKVCache:
        return self.layers[layer]

    @property
    def length(self) -> int:
        # Every layer appends the same positions in one forward pass, so the first layer speaks for all.
        return self.layers[0].length

    @property
    def max_len(self) -> int:
        return self.layers[0].max_len
