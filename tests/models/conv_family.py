"""A model family from outside lm, in one file: a decoder whose blocks mix tokens with a causal depthwise
convolution instead of attention. Importing this module registers it as model.arch=conv; the command-line
tools find it through LM_FAMILIES=tests.models.conv_family. Nothing in lm/ names it.

What a family brings: its config (its own keys), its model (built on the meta device and drawn by
`init_weights`; a forward from ids to hidden states, `logits`, and `new_cache` for sampling), and its spec, a
`Family` instance: the next-token objective, loss, scores and sampling come from `lm.models.next_token`; this one
adds how to build the model, its blocks (what FSDP shards and activation checkpointing recomputes) and what a
micro-batch's activations cost in memory. Parameter counts and FLOPs come from `lm.plan.counts`, which counts
the model built on the meta device.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.errors import ConfigError
from lm.models import next_token
from lm.models.config import ModelConfig
from lm.models.family import Estimates, Family
from lm.models.registry import register
from lm.models.sizes import checkpointed_blocks, logits_bytes, stack_bytes


@dataclass
class ConvConfig(ModelConfig):
    arch: str = "conv"
    title: ClassVar[str] = "a convolutional decoder"
    z_loss: ClassVar[bool] = True
    kernel_size: int = 4
    """How many tokens (itself and those before it) each position mixes in every block."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel_size < 1:
            raise ConfigError(f"model.kernel_size: must be positive, got {self.kernel_size}")


class ConvState:
    """Each block's last kernel_size - 1 normalised inputs, for decoding a token at a time."""

    def __init__(self, cfg: ConvConfig, batch_size: int, max_len: int, device=None, dtype=None) -> None:
        shape = (batch_size, cfg.d_model, cfg.kernel_size - 1)
        self.layers = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.length, self.max_len = 0, max_len


class ConvBlock(nn.Module):
    """x + conv(norm(x)), then x + mlp(norm(x)); the convolution sees only the current and earlier tokens."""

    def __init__(self, cfg: ConvConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.conv = nn.Conv1d(cfg.d_model, cfg.d_model, cfg.kernel_size, groups=cfg.d_model, bias=cfg.bias)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor, past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C), past (B, C, k - 1) the inputs before it (zeros at a sequence's start) -> (x, new past)."""
        h = self.ln_1(x).transpose(1, 2)  # (B, C, T)
        k = self.conv.kernel_size[0]
        h = torch.cat([past if past is not None else h.new_zeros(*h.shape[:2], k - 1), h], dim=2)  # (B, C, k-1+T)
        x = x + self.conv(h).transpose(1, 2)
        x = x + self.proj(F.gelu(self.fc(self.ln_2(x))))
        return x, h[..., h.size(2) - (k - 1):]


class ConvLM(nn.Module):
    def __init__(self, cfg: ConvConfig) -> None:
        super().__init__()
        self.cfg = cfg
        device = torch.get_default_device()
        with torch.device("meta"):  # drawn by init_weights, so a meta build and a direct one agree
            self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
            self.blocks = nn.ModuleList(ConvBlock(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
            self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        self.to_empty(device=device)
        self.init_weights()

    def init_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:  # norm gains
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02)

    def new_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> ConvState:
        return ConvState(self.cfg, batch_size, max_len, device, dtype)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                cache: ConvState | None = None) -> torch.Tensor:
        if positions is not None:
            raise ValueError("ConvLM: a convolution runs across documents; positions must be None")
        start = 0 if cache is None else cache.length
        if start + idx.size(1) > self.cfg.block_size:
            raise ValueError(f"sequence of {start + idx.size(1)} tokens exceeds model.block_size={self.cfg.block_size}")
        x = self.wte(idx)
        for i, block in enumerate(self.blocks):
            x, past = block(x, None if cache is None else cache.layers[i])
            if cache is not None:
                cache.layers[i] = past
        if cache is not None:
            cache.length += idx.size(1)
        return self.ln_f(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


def activation_bytes(cfg: ConvConfig, data, micro_batch: int, act_bytes: int, residual_bytes: int, every: int,
                     fused_attention: bool) -> tuple[int, int]:
    """Per block: the two norms' inputs (r each), the padded convolution input, the MLP's input and its hidden
    layer before and after GELU; outside: the final norm's and the head's inputs, and the logits."""
    b, s, h, c, r = micro_batch, data.seq_len, cfg.d_model, act_bytes, residual_bytes
    t = b * s
    full = 2 * r * t * h + c * (t + b * (cfg.kernel_size - 1)) * h + c * t * h + 2 * c * t * 4 * h
    k = checkpointed_blocks(cfg.n_layer, every)
    blocks = stack_bytes(cfg.n_layer, k, full, r * t * h) + (full if k else 0)
    logits = logits_bytes(t, cfg.padded_vocab_size)
    return blocks + (r + c) * t * h + logits, logits


FAMILY = Family(
    name="conv",
    config_class=ConvConfig,
    build=ConvLM,
    blocks=lambda model: list(model.blocks),
    training=next_token.TRAINING,
    sampler=next_token.SAMPLER,
    estimates=Estimates(activation_bytes),
)

register(FAMILY)
