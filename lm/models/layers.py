"""Building blocks shared by every architecture: norms, feed-forward networks and position encodings."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.models.config import TransformerConfig


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter, same state-dict key) whose weight meets its input in the input's dtype.

    The weight is an fp32 master copy, which the optimizer updates. Under bf16 autocast the input is bf16 (a
    linear's output) and torch's RMSNorm only dispatches to its fused kernel when input and weight share a dtype;
    otherwise it warns "Mismatch dtype between input and weight" and runs an unfused composite. So the weight is
    cast to the input's dtype at use: only the gain is rounded to bf16, as autocast rounds every linear's weight,
    while the kernel still accumulates the mean square in fp32 (its accumulation type for bf16). In fp32 the cast
    is a no-op and the result is nn.RMSNorm's, bit for bit.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., normalized_shape) -> the same shape and dtype."""
        weight = None if self.weight is None else self.weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def make_norm(cfg: TransformerConfig) -> nn.Module:
    """LayerNorm (with a bias only when cfg.bias) or RMSNorm, over d_model channels.

    LayerNorm stays torch's: CUDA autocast runs layer_norm in fp32 and the CPU's kernel takes a bf16 input with
    fp32 weight and bias, fused and without a warning either way, so its weights are never rounded to bf16.
    RMSNorm casts its weight to the input's dtype at use (`RMSNorm`).
    """
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def split_fused_gate(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Read a SwiGLU state dict saved before gate and up were separate: its `fc` rows [gate; up] become
    `gate` and `fc` (a load_state_dict pre-hook, so consolidated checkpoints of older runs still load)."""
    if module.kind != "swiglu":
        return
    for p in ("weight", "bias"):
        name = f"{prefix}fc.{p}"
        if f"{prefix}gate.{p}" not in state_dict and name in state_dict:
            state_dict[f"{prefix}gate.{p}"], state_dict[name] = state_dict[name].chunk(2)


class MLP(nn.Module):
    """Position-wise feed-forward network d -> ff_dim -> d, with GELU, ReLU, ReLU squared or SwiGLU.

    SwiGLU computes proj(silu(gate(x)) * fc(x)), `fc` being its up projection. gate and fc are separate
    matrices so that a tensor-parallel rank keeps the same hidden units of both by splitting each along its rows.
    """

    def __init__(self, cfg: TransformerConfig, hidden: int = 0) -> None:
        """`hidden` units (0: model.d_ff's, `ff_dim`)."""
        super().__init__()
        self.kind = cfg.mlp
        hidden = hidden or cfg.ff_dim
        if cfg.mlp == "swiglu":
            self.gate = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.fc = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        self._register_load_state_dict_pre_hook(split_fused_gate, with_module=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        gate = self.gate(x) if self.kind == "swiglu" else None
        return self.drop(self.proj(activate(self.kind, self.fc(x), gate)))  # hidden: (B, T, hidden)

    def residual_outputs(self) -> set[nn.Module]:
        """What writes into the residual stream (drawn with GPT-2's smaller scale, `lm.models.init`)."""
        return {self.proj}


def activate(kind: str, h: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The hidden units of a feed-forward network of model.mlp `kind`: its up projection h, and for swiglu its
    gate projection, both (..., hidden)."""
    if kind == "swiglu":
        return F.silu(gate) * h
    if kind == "relu":
        return F.relu(h)
    if kind == "relu2":  # the modded-nanogpt MLP: sparse like ReLU, smooth at 0 like GELU
        return F.relu(h).square()
    # GPT-2 was trained with the tanh approximation of GELU; keep it so its weights load unchanged.
    return F.gelu(h, approximate="tanh")


def sinusoidal_positions(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """Fixed position encodings of Vaswani et al.: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...).

    positions: int, any shape, e.g. (T,) or (B, T); returns (*positions.shape, d_model) float32.
    """
    inv_freq = torch.exp(torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)
                         * (-math.log(10000.0) / d_model))  # (ceil(d/2),)
    angles = positions.float()[..., None] * inv_freq  # (..., ceil(d/2))
    pe = torch.empty(*positions.shape, d_model, device=positions.device)
    pe[..., 0::2] = angles.sin()
    pe[..., 1::2] = angles.cos()[..., : d_model // 2]
    return pe


class PositionTable(nn.Embedding):
    """A learned table of positions (pos: learned), block_size rows: an embedding looked up by position, not by
    token, which parameter counts "without embeddings" leave out (`lm.plan.counts`)."""


def add_positions(x: torch.Tensor, positions: torch.Tensor, cfg: TransformerConfig, table: nn.Embedding | None
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Token embeddings x (B, T, C) at `positions` ((T,), or (B, T) for packed documents), given their
    positions as model.pos says: the learned `table`'s rows or the sinusoids added, or x as it is and the
    rotary angles the attention applies (`rope_angles`). Returns (x, rope angles or None)."""
    if cfg.pos == "learned":
        return x + table(positions), None
    if cfg.pos == "sinusoidal":
        return x + sinusoidal_positions(positions, cfg.d_model).to(x.dtype), None
    return x, rope_angles(positions, cfg)  # each (T, hs) or (B, T, hs)


def rope_frequencies(cfg: TransformerConfig, device: torch.device | None = None) -> torch.Tensor:
    """The rotary angle per position of each channel pair, (head_dim / 2,) float32: theta^(-2j/head_dim), then
    stretched as model.rope_scaling says (the functions transformers applies for `linear` and `llama3`)."""
    hs = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hs, 2, device=device, dtype=torch.float32) / hs)
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        # Wavelengths (in positions) longer than the original context's low band are slowed by the factor, those
        # shorter than its high band kept; between the two, a linear blend in context / wavelength.
        context, low, high = cfg.rope_original_context, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: slowed, 1: kept
        slowed = inv_freq / cfg.rope_factor
        scaled = (1 - blend) * slowed + blend * inv_freq
        scaled = torch.where(wavelength > context / low, slowed, scaled)
        return torch.where(wavelength < context / high, inv_freq, scaled)
    return inv_freq


def rope_angles(positions: torch.Tensor, cfg: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (*positions.shape, head_dim) float32, for int `positions` of
    any shape: (T,) for one shared sequence, (B, T) for per-row positions (packed documents).

    Channel pairs (j, j + head_dim/2) rotate together by position * rope_frequencies(cfg)[j]: the
    "half split" layout of GPT-NeoX and Hugging Face's Llama, so their weights need no permutation.
    """
    freqs = positions.float()[..., None] * rope_frequencies(cfg, positions.device)  # (..., head_dim / 2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (..., head_dim)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys x (B, nh, T, hs) by the angles of their positions.

    cos, sin: (T, hs), shared by every row, or (B, T, hs), one set of positions per row.
    """
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hs): the same angles for every head
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # (B, nh, T, hs): each pair (a, b) -> (-b, a)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
