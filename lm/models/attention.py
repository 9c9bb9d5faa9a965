"""Attention layers on top of torch's fused `scaled_dot_product_attention` (SDPA).

`attend` is the one place SDPA is called, so every attention variant (decoder self-attention, encoder
self-attention, cross-attention; multi-head or grouped-query) shares the same kernel choice.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.models.config import TransformerConfig
from lm.models.kv_cache import LayerKVCache, StaticLayerKVCache
from lm.models.layers import RMSNorm, apply_rope


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

    q: (B, nh, T, hs); k, v: (B, nkv, S, hs) where nkv divides nh (grouped-query attention when
    nkv < nh: each key/value head serves nh / nkv query heads). mask: boolean, broadcastable to
    (B, nh, T, S), True where a query may attend to a key. `is_causal` aligns the causal triangle to the
    top-left, so it is only right when T == S. Returns (B, T, nh * hs).
    """
    B, nh, T, hs = q.shape
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=k.size(1) != nh
    )
    return y.transpose(1, 2).reshape(B, T, nh * hs)


@dataclass(frozen=True)
class SequenceShard:
    """Under context parallelism, the tokens a rank holds of each window: their `positions` (T_local,) in a
    sequence of `length` tokens. Their attention sees every key up to its own position, through the keys and
    values each attention layer's `kv_gather` brings in from the other ranks."""

    positions: torch.Tensor
    length: int


def split_fused_qkv(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Read a state dict saved before q, k and v were separate projections: its fused `qkv` rows [q; k; v]
    become the three (a load_state_dict pre-hook, so consolidated checkpoints of older runs still load)."""
    for p in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{p}", None)
        if fused is not None:
            sizes = [module.q.out_features, module.k.out_features, module.v.out_features]
            for name, part in zip("qkv", fused.split(sizes)):
                state_dict[f"{prefix}{name}.{p}"] = part


def causal_mask(num_queries: int, start: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean mask (T, start + T) letting query i, at absolute position start + i, see keys 0..start + i."""
    query_pos = torch.arange(start, start + num_queries, device=device)
    key_pos = torch.arange(start + num_queries, device=device)
    return key_pos[None, :] <= query_pos[:, None]


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """Boolean mask (B, 1, T, T) for windows packed from several documents: True where query i and key j
    belong to the same document (an encoder's attention inside each document).

    positions: (B, T) int, each token's position inside its own document; a document starts wherever it is 0,
    so the document id of token t is the number of zeros in positions[:, :t + 1]. The mask broadcasts over heads.
    """
    doc = (positions == 0).cumsum(dim=-1)  # (B, T)
    return (doc[:, :, None] == doc[:, None, :])[:, None]  # (B, 1, T, T): [b, 0, query, key]


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """`document_mask` and the causal triangle: True where key j <= query i in the same document (B, 1, T, T)."""
    return document_mask(positions) & causal_mask(positions.size(-1), 0, positions.device)


def key_padding_mask(keep: torch.Tensor | None) -> torch.Tensor | None:
    """(B, S) bool, True for real tokens -> (B, 1, 1, S), broadcast over heads and queries; None stays None."""
    return None if keep is None else keep[:, None, None, :]


class SelfAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention, causal for decoders.

    q, k and v are three projections rather than one fused matmul: each one's rows are whole heads, so a
    tensor-parallel rank keeps its own heads of all three by splitting each along its rows (a fused [q; k; v]
    matrix cut into equal parts would give one rank all the queries and another the keys).
    """

    def __init__(self, cfg: TransformerConfig, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        bias = cfg.bias or cfg.qkv_bias
        q_width, kv_width = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.q = nn.Linear(cfg.d_model, q_width, bias=bias)
        self.k = nn.Linear(cfg.d_model, kv_width, bias=bias)
        self.v = nn.Linear(cfg.d_model, kv_width, bias=bias)
        self.proj = nn.Linear(q_width, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        # qk_norm bounds the attention logits, which lets a high learning rate stay stable: over each head's
        # channels, or (scope all, OLMo 2) over the whole projection before it is cut into heads.
        self.norm_whole = cfg.qk_norm and cfg.qk_norm_scope == "all"
        if cfg.qk_norm:
            self.q_norm = RMSNorm(q_width if self.norm_whole else cfg.head_dim, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(kv_width if self.norm_whole else cfg.head_dim, eps=cfg.norm_eps)
        self.kv_gather: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        """Set from outside under context parallelism: this rank's keys and values (B, nkv, T_local, hs) -> those of
        the whole sequence (B, nkv, T, hs) in position order; the caller's mask then says which each query sees."""
        self._register_load_state_dict_pre_hook(split_fused_qkv, with_module=True)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerKVCache | StaticLayerKVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C).

        rope: (cos, sin) of the T positions, each (T, hs) or (B, T, hs), or None without rotary positions.
        With a cache (causal only), x holds the T positions after those already cached (a static cache: those at
        its `positions`, under its own mask). mask: bool, for a non-causal layer the key padding (B, 1, 1, T); for
        a causal one (no cache) the whole mask, causal triangle included, e.g. `document_causal_mask`
        (B, 1, T, T); None for plain causal or no padding.
        Head counts come from the projections' outputs: under tensor parallelism a rank holds some of the heads.
        """
        B, T, C = x.shape
        hs = self.head_dim
        q, k = self.q(x), self.k(x)  # (B, T, nh * hs), (B, T, nkv * hs)
        if self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v(x).view(B, T, -1, hs).transpose(1, 2)
        if hasattr(self, "q_norm") and not self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)  # over each head's hs channels
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)

        if self.kv_gather is not None:
            k, v = self.kv_gather(k, v)
        start = 0
        if isinstance(cache, StaticLayerKVCache):
            k, v = cache.write(k, v)  # (B, nkv, max_len, hs): the whole storage, the unwritten positions masked
            mask = cache.mask  # (T, max_len)
        elif cache is not None:
            start = cache.length
            k, v = cache.append(k, v)  # (B, nkv, start + T, hs)

        dropout_p = self.dropout if self.training else 0.0
        if not self.causal or mask is not None:
            y = attend(q, k, v, mask=mask, dropout_p=dropout_p)
        elif start == 0:
            y = attend(q, k, v, is_causal=True, dropout_p=dropout_p)
        elif T == 1:
            # A single new token comes after every cached one, so it may see all keys: no mask needed.
            y = attend(q, k, v, dropout_p=dropout_p)
        else:
            # T new queries after a non-empty cache: the causal triangle sits bottom-right, which
            # is_causal (top-left aligned) would get wrong.
            y = attend(q, k, v, mask=causal_mask(T, start, x.device), dropout_p=dropout_p)
        return self.resid_drop(self.proj(y))


class CrossAttention(nn.Module):
    """Decoder queries attend to the encoder's output (the memory); keys/values come from the memory only,
    so during decoding they are projected once (`memory_kv`) and reused for every new token."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.dropout = cfg.dropout
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.kv_heads * cfg.head_dim, bias=cfg.bias)  # rows [k; v]
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the memory (B, S, C): each (B, nkv, S, hs)."""
        B, S, _ = memory.shape
        kv = self.kv(memory).view(B, S, 2 * self.n_kv_head, self.head_dim).transpose(1, 2)
        k, v = kv.chunk(2, dim=1)
        return k, v

    def forward(
        self, x: torch.Tensor, memory_kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C). mask: memory padding, (B, 1, 1, S) bool, or None."""
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k, v = memory_kv
        y = attend(q, k, v, mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y))
