"""One transformer layer: self-attention, optional cross-attention, feed-forward, each a residual sublayer."""

from collections.abc import Callable

import torch
import torch.nn as nn

from lm.models.attention import CrossAttention, SelfAttention
from lm.models.config import TransformerConfig
from lm.models.kv_cache import LayerKVCache, StaticLayerKVCache
from lm.models.layers import MLP, make_norm


class Block(nn.Module):
    """A decoder block (causal), an encoder block (not causal) or an encoder-decoder's decoder block (cross).

    Pre-norm (GPT-2): x + f(norm(x)). Post-norm (the original transformer): norm(x + f(x)). Output norm
    (OLMo 2): x + norm(f(x)).
    """

    def __init__(self, cfg: TransformerConfig, causal: bool = True, cross: bool = False,
                 mlp: nn.Module | None = None) -> None:
        """`mlp`: the feed-forward sublayer, when not the dense `MLP` (a mixture of experts)."""
        super().__init__()
        self.norm_position = cfg.norm_position
        self.ln_1 = make_norm(cfg)
        self.attn = SelfAttention(cfg, causal)
        if cross:
            self.ln_cross = make_norm(cfg)
            self.cross = CrossAttention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg) if mlp is None else mlp

    def _residual(self, x: torch.Tensor, norm: nn.Module,
                  sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.norm_position == "post":
            return norm(x + sublayer(x))
        if self.norm_position == "output":
            return x + norm(sublayer(x))
        return x + sublayer(norm(x))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerKVCache | StaticLayerKVCache | None = None,
        mask: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C). mask pads the block's own keys (encoder), or is a decoder's whole
        self-attention mask, causal triangle included (packed documents, no cache). A cross-attention block
        attends to the encoder output `memory` (B, S, C), or to its keys and values `memory_kv`
        (B, nkv, S, hs) when the caller projected them once for many decoding steps; memory_mask is
        the memory's padding."""
        if memory is not None:
            # projected here, inside the block's forward, so that sharding wrappers (FSDP2) have
            # gathered this block's weights
            memory_kv = self.cross.memory_kv(memory)
        x = self._residual(x, self.ln_1, lambda h: self.attn(h, rope=rope, cache=cache, mask=mask))
        if memory_kv is not None:
            x = self._residual(x, self.ln_cross, lambda h: self.cross(h, memory_kv, memory_mask))
        return self._residual(x, self.ln_2, self.mlp)
