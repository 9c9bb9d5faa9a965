"""DistributedDataParallel, applied from outside the model."""

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from lm.distributed.env import DistEnv


def wrap_ddp(model: nn.Module, env: DistEnv) -> nn.Module:
    """Wrap `model` for data parallelism when there is more than one rank; otherwise return it."""
    if env.world_size == 1:
        return model
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def grad_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Skip DDP's gradient all-reduce on accumulation micro-steps; reduce on the last one."""
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()

