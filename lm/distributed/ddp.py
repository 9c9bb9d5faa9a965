"""DistributedDataParallel, applied from outside the model: every rank holds the whole model."""

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from lm.config import OptimConfig, ParallelConfig, TrainConfig
from lm.distributed.activation import checkpoint_blocks, compile_blocks
from lm.distributed.env import DistEnv
from lm.distributed.materialize import WeightLoader, materialize
from lm.distributed.precision import autocast_for
from lm.distributed.torch_engine import TorchEngine
from lm.models.family import Family


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


class DDPEngine(TorchEngine):
    """A replicated model under DistributedDataParallel, bf16 by autocast (`lm.config.use_bf16`)."""

    name = "ddp"

    def __init__(self, model: nn.Module, family: Family, parallel: ParallelConfig, train: TrainConfig,
                 optim: OptimConfig, env: DistEnv, load_weights: WeightLoader | None) -> None:
        materialize(model, env.device, load_weights)
        blocks = family.blocks(model)
        checkpoint_blocks(blocks, parallel.activation_checkpointing)
        if train.compile:
            compile_blocks(blocks)
        super().__init__(model, wrap_ddp(model, env), family, train, optim, env)
        self.autocast = autocast_for(train.dtype, env.device)

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        return grad_sync(self.run, sync=last)
