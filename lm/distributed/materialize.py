"""Giving a model built on the meta device its weights, for the engines that hold it whole (ddp, deepspeed)."""

from collections.abc import Callable

import torch
import torch.nn as nn

WeightLoader = Callable[[nn.Module], None]
"""Fills a materialised model's weights (whole or FSDP-sharded) in place: how a run starts from a file."""


def materialize(model: nn.Module, device: torch.device, load_weights: WeightLoader | None) -> nn.Module:
    """A whole model built on the meta device, allocated on the CPU and drawn from the global RNG exactly
    as building it there would, its weights then replaced by `load_weights` if given, moved to `device`."""
    model.to_empty(device="cpu")
    model.init_weights()
    if load_weights is not None:
        load_weights(model)
    return model.to(device)
