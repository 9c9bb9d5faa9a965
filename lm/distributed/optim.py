"""The optimizer every engine steps: AdamW, with weight decay on weight matrices only."""

import torch
import torch.nn as nn

from lm.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on weight matrices only: biases, norms and embeddings are not decayed."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue  # the tied output head shares the embedding's Parameter
            seen.add(id(param))
            skip = isinstance(module, (nn.Embedding, nn.LayerNorm, nn.RMSNorm)) or name == "bias"
            (no_decay if skip else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        # one kernel over all parameters instead of a dozen passes: 3.4x faster on CPU (5.8 vs 19.6 ms per
        # step for demo's 7M parameters, python -m lm.bench's machine), the standard choice on CUDA; and
        # only the fused step can skip on the device (found_inf), which optimizer_step relies on
        fused=True,
    )
