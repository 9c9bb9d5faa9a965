"""Multi-head self-attention on top of torch's fused `scaled_dot_product_attention` (SDPA).

`attend` is the one place SDPA is called, so every attention variant shares the same kernel choice;
`CausalSelfAttention` is the decoder layer, with an optional KV cache for incremental decoding.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.models.config import ModelConfig
from lm.models.kv_cache import LayerKVCache


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of T queries over S keys, heads merged back into the channel dimension.

    q: (B, nh, T, hs); k, v: (B, nh, S, hs); mask: boolean, broadcastable to (B, nh, T, S), True where a
    query may attend to a key. `is_causal` aligns the causal triangle to the top-left, so it is only
    right when T == S. Returns (B, T, nh * hs).
    """
    B, nh, T, hs = q.shape
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    return y.transpose(1, 2).reshape(B, T, nh * hs)


def causal_mask(num_queries: int, start: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean mask (T, start + T) letting query i, at absolute position start + i, see keys 0..start + i."""
    query_pos = torch.arange(start, start + num_queries, device=device)
    key_pos = torch.arange(start + num_queries, device=device)
    return key_pos[None, :] <= query_pos[:, None]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused projection for queries, keys and values."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        # One matmul for q, k and v instead of three keeps the GPU busy with fewer, larger kernels.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C). With a cache, x holds the T positions after those already cached."""
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, nh, T, hs)

        start = 0
        if cache is not None:
            start = cache.length
            k, v = cache.append(k, v)  # (B, nh, start + T, hs)

        dropout_p = self.dropout if self.training else 0.0
        if start == 0:
            y = attend(q, k, v, is_causal=True, dropout_p=dropout_p)
        elif T == 1:
            # A single new token comes after every cached one, so it may see all keys: no mask needed.
            y = attend(q, k, v, dropout_p=dropout_p)
        else:
            # T new queries after a non-empty cache: the causal triangle sits bottom-right, which
            # is_causal (top-left aligned) would get wrong.
            y = attend(q, k, v, mask=causal_mask(T, start, x.device), dropout_p=dropout_p)
        return self.resid_drop(self.proj(y))
