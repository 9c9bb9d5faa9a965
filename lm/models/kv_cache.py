"""Key/value cache for incremental decoding.

Each layer owns preallocated key and value tensors of shape (B, nkv, max_len, hs) (nkv: key/value heads)
and a fill length.
Appending writes into the preallocated storage in place, so decoding allocates nothing per token.

`KVCache` hands attention the keys of the positions filled so far, a view that grows by one position a token;
`StaticKVCache` hands it the whole storage under a mask, the same shapes at every position, which compiled
decoding needs.
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


class StaticLayerKVCache:
    """Keys and values of one attention layer in storage of a fixed length, written at given positions.

    Attention reads the whole storage, its unwritten positions hidden by `mask`, so that every decode step
    has the same shapes and one compiled (or CUDA-graph captured) step serves every position. `positions`
    and `mask` are set by the `StaticKVCache` they belong to, before each forward.
    """

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
        self.positions = torch.zeros(0, dtype=torch.long, device=device)
        """(T,) where the next forward's T tokens go"""
        self.mask = torch.zeros(0, max_len, dtype=torch.bool, device=device)
        """(T, max_len) bool: True where each of those tokens may see a key (causal, written positions only)"""

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nkv, T, hs) at `positions`; return the whole storage (B, nkv, max_len, hs), which
        attention reads under `mask`."""
        self.k.index_copy_(2, self.positions, k)
        self.v.index_copy_(2, self.positions, v)
        return self.k, self.v


class StaticKVCache:
    """One `StaticLayerKVCache` per transformer block, for compiled decoding.

    The sampler calls `advance(T)` before each forward of T tokens: it points every layer at the next T positions,
    as tensors. The model reads the positions from `positions`, never the int `length`, so the compiled step is
    not specialised to one position and compiled again for the next.
    """

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
            StaticLayerKVCache(batch_size, n_head, max_len, head_dim, device, dtype) for _ in range(n_layer)
        ]
        self.key_positions = torch.arange(max_len, device=device)  # (max_len,)
        self.positions = self.layers[0].positions
        """(T,) the positions of the next forward's tokens"""
        self.length = 0
        """Positions written, those of the next forward included once `advance` has been called"""

    def __getitem__(self, layer: int) -> StaticLayerKVCache:
        return self.layers[layer]

    @property
    def max_len(self) -> int:
        return self.key_positions.numel()

    def reset(self) -> None:
        """Forget every position, for a new sequence; the storage stays, masked until written again."""
        self.length = 0

    def advance(self, num_tokens: int) -> None:
        """Point the next forward's `num_tokens` tokens at the positions after those written so far."""
        start, end = self.length, self.length + num_tokens
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions exceed its max_len={self.max_len}")
        positions = torch.arange(start, end, device=self.key_positions.device)  # (T,)
        mask = self.key_positions[None, :] <= positions[:, None]  # (T, max_len): each token sees keys up to its own
        for layer in self.layers:
            layer.positions, layer.mask = positions, mask
        self.positions = positions
        self.length = end
