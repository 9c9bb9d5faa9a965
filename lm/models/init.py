"""Weight initialisation shared by the transformer families: every parameter drawn from the global torch RNG in
module order, so the same seed gives the same weights whether a model is built on a device or on the meta
device and materialised later (as the sharding engines do)."""

import math

import torch.nn as nn


def init_weights_(model: nn.Module, residual_projections: set[nn.Module], skip: set[nn.Module],
                  n_layer: int, embed_std: float = 0.02) -> None:
    """Draw every parameter of `model` from the global torch RNG, in module order.

    Linears ~ N(0, 0.02), except the projections that write into the residual stream: GPT-2 scales those
    by 1/sqrt(2 * n_layer) so the stream's variance stays O(1) after 2 additions per layer; a mixture of
    experts' stacked weights alike (its output matrices scaled). Embeddings ~ N(0, embed_std); norms to ones
    (and zero bias). Modules in `skip` (a tied head) are left alone.
    """
    residual_std = 0.02 / math.sqrt(2 * n_layer)
    for module in model.modules():
        if module in skip:
            continue
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=residual_std if module in residual_projections else 0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=embed_std)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            module.reset_parameters()
        elif hasattr(module, "draw_"):  # parameters of its own shape: a mixture's stacked expert weights
            module.draw_(0.02, residual_std)


def residual_projections(blocks: nn.ModuleList) -> set[nn.Module]:
    """The linears of `blocks` whose outputs are added to the residual stream."""
    found = set()
    for block in blocks:
        found |= {block.attn.proj, *block.mlp.residual_outputs()}
        if hasattr(block, "cross"):
            found.add(block.cross.proj)
    return found
