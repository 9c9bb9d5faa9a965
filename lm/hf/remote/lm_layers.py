"""The layers of the transformers that `lm` exports as code: norms, feed-forward networks, positions, self- and
cross-attention and the residual block, computed as lm computes them, so a model built from them gives lm's
outputs for lm's weights. Plain torch; the modeling files beside this one assemble them into models.

Every option is read from the model's config (`configuration_lm.py`): `pos` (learned, sinusoidal or rope),
`norm` (layernorm or rmsnorm), `norm_position` (pre or post), `mlp` (gelu, relu, relu2 or swiglu), `bias`,
`qkv_bias`, `qk_norm` and grouped-query heads (`n_kv_head` below `n_head`).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def make_norm(config) -> nn.Module:
    """LayerNorm (with a bias only when config.bias) or RMSNorm over d_model channels."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


def final_norm(config) -> nn.Module:
    """The norm at the end of a stack: a post-norm block already ends in one, the other placements need one."""
    return make_norm(config) if config.norm_position != "post" else nn.Identity()


def head_width(config) -> int:
    """Channels of one attention head: config.d_head (the decoder's, when set), else d_model / n_head."""
    return getattr(config, "d_head", 0) or config.d_model // config.n_head


class MLP(nn.Module):
    """d_model -> d_ff -> d_model with GELU (tanh approximation), ReLU, ReLU squared or SwiGLU; SwiGLU computes
    proj(silu(gate(x)) * fc(x))."""

    def __init__(self, config) -> None:
        super().__init__()
        self.kind = config.mlp
        if self.kind == "swiglu":
            self.gate = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C)."""
        h = self.fc(x)  # (B, T, d_ff)
        if self.kind == "swiglu":
            h = F.silu(self.gate(x)) * h
        elif self.kind == "relu":
            h = F.relu(h)
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate="tanh")
        return self.drop(self.proj(h))


def sinusoidal_positions(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """The fixed encodings of "Attention Is All You Need" at int `positions` of any shape: (..., d_model) float32,
    sin(p / 10000^(2i/d)) in channel 2i and the cosine in channel 2i + 1."""
    inv_freq = torch.exp(torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)
                         * (-math.log(10000.0) / d_model))  # (ceil(d/2),)
    angles = positions.float()[..., None] * inv_freq  # (..., ceil(d/2))
    table = torch.empty(*positions.shape, d_model, device=positions.device)
    table[..., 0::2] = angles.sin()
    table[..., 1::2] = angles.cos()[..., : d_model // 2]
    return table


def rope_frequencies(config, device: torch.device) -> torch.Tensor:
    """The angle per position of each rotary channel pair j, theta^(-2j/head_dim) (head_dim / 2,), stretched as the
    decoder's rope_scaling_type says: linear divides each by rope_factor; llama3 divides those of wavelengths above
    rope_original_context / rope_low_freq_factor, keeps those below rope_original_context / rope_high_freq_factor,
    and blends between the two."""
    hs = head_width(config)
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hs, 2, device=device, dtype=torch.float32) / hs)
    scaling = getattr(config, "rope_scaling_type", "none")
    if scaling == "linear":
        return inv_freq / config.rope_factor
    if scaling == "llama3":
        context, low, high = config.rope_original_context, config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        keep = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: divided, 1: kept
        slowed = inv_freq / config.rope_factor
        blended = torch.where(wavelength > context / low, slowed, (1 - keep) * slowed + keep * inv_freq)
        return torch.where(wavelength < context / high, inv_freq, blended)
    return inv_freq


def rope_angles(positions: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles at int `positions` (T,) or (B, T): each (*positions.shape, head_dim) float32.
    Channels j and j + head_dim/2 rotate together by position * rope_frequencies[j] (the half-split layout)."""
    freqs = positions.float()[..., None] * rope_frequencies(config, positions.device)  # (..., head_dim / 2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (..., head_dim)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Queries or keys x (B, nh, T, hs) rotated by the angles cos, sin: (T, hs) for every row, or (B, T, hs)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hs): the same angles for every head
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # each channel pair (a, b) -> (-b, a)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def embed_positions(x: torch.Tensor, positions: torch.Tensor, config, table: nn.Embedding | None
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Token embeddings x (B, T, C) at int `positions` (T,) or (B, T), given their positions as config.pos says:
    the learned `table`'s rows or the sinusoids added, or x unchanged and the rotary angles for attention."""
    if config.pos == "learned":
        return x + table(positions), None
    if config.pos == "sinusoidal":
        return x + sinusoidal_positions(positions, config.d_model).to(x.dtype), None
    return x, rope_angles(positions, config)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
           dropout: float) -> torch.Tensor:
    """Scaled dot-product attention of queries q (B, nh, T, hs) over keys and values k, v (B, nkv, S, hs), where
    each key/value head serves nh / nkv query heads; mask: bool, broadcastable to (B, nh, T, S), True where a query
    may see a key. Returns (B, T, nh * hs)."""
    B, nh, T, hs = q.shape
    if k.size(1) != nh:
        k = k.repeat_interleave(nh // k.size(1), dim=1)  # (B, nh, S, hs): query head h reads key/value head h // group
        v = v.repeat_interleave(nh // v.size(1), dim=1)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)
    return y.transpose(1, 2).reshape(B, T, nh * hs)


class SelfAttention(nn.Module):
    """Multi-head or grouped-query self-attention, causal in a decoder, with optional RMSNorm on each head's queries
    and keys (before rotary positions)."""

    def __init__(self, config, layer_idx: int, causal: bool) -> None:
        super().__init__()
        self.layer_idx, self.causal, self.dropout = layer_idx, causal, config.dropout
        self.head_dim = head_width(config)
        qkv_bias = config.bias or config.qkv_bias
        q_width, kv_width = config.n_head * self.head_dim, config.n_kv_head * self.head_dim
        self.q = nn.Linear(config.d_model, q_width, bias=qkv_bias)
        self.k = nn.Linear(config.d_model, kv_width, bias=qkv_bias)
        self.v = nn.Linear(config.d_model, kv_width, bias=qkv_bias)
        self.proj = nn.Linear(q_width, config.d_model, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)
        # qk_norm_scope all: one norm over the whole projection before it is cut into heads, not one per head
        self.norm_whole = config.qk_norm and getattr(config, "qk_norm_scope", "head") == "all"
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(q_width if self.norm_whole else self.head_dim, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(kv_width if self.norm_whole else self.head_dim, eps=config.norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). mask: bool (B or 1, 1, T, S), True where a query may see a key, or None: every
        key (encoder), or the causal triangle over x alone or a single new token after the cache (decoder).
        cache: a transformers Cache that keeps this layer's keys and values from one decoding step to the next."""
        B, T, _ = x.shape
        q, k = self.q(x), self.k(x)  # (B, T, nh * hs), (B, T, nkv * hs)
        if self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm") and not self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, nkv, S, hs): the cached positions, then these
        is_causal = self.causal and mask is None and k.size(2) == T
        y = attend(q, k, v, mask, is_causal, self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y))


class CrossAttention(nn.Module):
    """A decoder's queries over the encoder's output (the memory), whose keys and values come from one projection
    `kv` (rows: keys, then values)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.n_kv_head, self.head_dim = config.n_kv_head, config.d_model // config.n_head
        self.q = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.kv = nn.Linear(config.d_model, 2 * config.n_kv_head * self.head_dim, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C), memory (B, S, C) -> (B, T, C). mask: the memory's padding (B, 1, 1, S) bool, or None."""
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        kv = self.kv(memory).view(B, memory.size(1), 2 * self.n_kv_head, self.head_dim).transpose(1, 2)
        k, v = kv.chunk(2, dim=1)  # each (B, nkv, S, hs)
        y = attend(q, k, v, mask, False, self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Self-attention, cross-attention (an encoder-decoder's decoder only) and the MLP, each a residual sublayer:
    x + f(norm(x)) pre-norm, norm(x + f(x)) post-norm, x + norm(f(x)) output norm."""

    def __init__(self, config, layer_idx: int, causal: bool, cross: bool = False) -> None:
        super().__init__()
        self.norm_position = config.norm_position
        self.ln_1 = make_norm(config)
        self.attn = SelfAttention(config, layer_idx, causal)
        if cross:
            self.ln_cross = make_norm(config)
            self.cross = CrossAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def _residual(self, x: torch.Tensor, norm: nn.Module, sublayer) -> torch.Tensor:
        if self.norm_position == "post":
            return norm(x + sublayer(x))
        if self.norm_position == "output":
            return x + norm(sublayer(x))
        return x + sublayer(norm(x))

    def forward(self, x: torch.Tensor, rope=None, mask: torch.Tensor | None = None, cache=None,
                memory: torch.Tensor | None = None, memory_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); `memory` (B, S, C), the encoder's output, for a cross-attention block."""
        x = self._residual(x, self.ln_1, lambda h: self.attn(h, rope, mask, cache))
        if memory is not None:
            x = self._residual(x, self.ln_cross, lambda h: self.cross(h, memory, memory_mask))
        return self._residual(x, self.ln_2, self.mlp)


def key_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' attention_mask (B, S), 1 for a real token and 0 for padding -> (B, 1, 1, S) bool, or None when
    there is no mask or nothing is padded (no mask lets SDPA pick its fastest kernel)."""
    if attention_mask is None or bool(attention_mask.bool().all()):
        return None
    return attention_mask.bool()[:, None, None, :]


def causal_mask(attention_mask: torch.Tensor | None, past: int, T: int, device: torch.device
                ) -> torch.Tensor | None:
    """The self-attention mask of T new queries after `past` cached positions, (B or 1, 1, T, past + T) bool: each
    query sees the earlier and its own position, padding (attention_mask 0) excepted. None where attention needs
    none: no padding and either nothing cached (SDPA's own causal triangle) or one new token (it sees every key).
    A padding query still sees itself, so that no row of the softmax is empty."""
    padding = key_mask(attention_mask)
    if padding is None and (past == 0 or T == 1):
        return None
    query_pos = torch.arange(past, past + T, device=device)[:, None]  # (T, 1)
    key_pos = torch.arange(past + T, device=device)[None, :]  # (1, S)
    mask = (key_pos <= query_pos)[None, None]  # (1, 1, T, S)
    if padding is not None:
        mask = mask & (padding | (key_pos == query_pos))  # (B, 1, T, S)
    return mask


def token_positions(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, past: int, T: int,
                    device: torch.device) -> torch.Tensor:
    """Each new token's position: position_ids when given; else counted over the real tokens of attention_mask
    (B, past + T), so a left-padded row has the positions it would have alone; else past .. past + T - 1.
    (T,) or (B, T)."""
    if position_ids is not None:
        return position_ids
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
    return torch.arange(past, past + T, device=device)


def output_with_cache(output_class, cache, **fields):
    """A transformers output carrying the cache: transformers 5 names the field `cache`, 4.x `past_key_values`."""
    name = "cache" if "cache" in output_class.__dataclass_fields__ else "past_key_values"
    return output_class(**fields, **{name: cache})
