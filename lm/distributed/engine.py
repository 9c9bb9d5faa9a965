"""The engines: one interface over DDP, FSDP2 and DeepSpeed ZeRO for the trainer and the checkpoints.

An engine wraps a model it is given, built on the meta device: it allocates the weights (sharded or
whole), draws them from the global RNG, lets a loader fill them in (`load_weights`: a consolidated file
that starts a run), wraps the model for its kind of parallelism and owns the optimizer and how a
micro-batch's gradients are accumulated, reduced, clipped and applied. What it needs of the model it asks
the model's family (`lm.models.family`): its blocks, its output layers, its loss. The model code is the same
under every engine; engines never build a model or read a checkpoint file themselves.
"""

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, TypeVar

import torch
import torch.nn as nn

from lm.config import JobConfig
from lm.distributed.ddp import DDPEngine
from lm.distributed.env import DistEnv, ensure_process_group
from lm.distributed.fsdp import FSDPEngine
from lm.distributed.materialize import WeightLoader
from lm.distributed.pipeline import PipelineEngine
from lm.distributed.zero import DeepSpeedEngine
from lm.models.family import Family, LossFn, Run

T = TypeVar("T")


class Engine(Protocol):
    name: str
    model: nn.Module
    """The model as built (sharded in place under fsdp; DDP's and DeepSpeed's wrappers are kept apart)."""
    optimizer: torch.optim.Optimizer
    loss: LossFn
    skips_nonfinite: bool
    """Whether a step with a non-finite gradient norm is skipped on the device (ddp, fsdp), or already applied
    when its norm is known (DeepSpeed): then the run must stop at the first one."""

    def set_lr(self, lr: float) -> None: ...

    def forward_backward(self, batch: list[torch.Tensor], last: bool, num_micro: int) -> torch.Tensor:
        """One micro-batch: forward, backward of `loss` / num_micro, gradients reduced on the `last` one.
        Returns the detached (2,) loss and z-loss term."""

    def accumulate(self, batches: list[list[torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of one step's micro-batches (on the device); the summed detached (2,) loss and
        z-loss terms, on every rank. A pipeline runs them through its schedule, the others one by one."""

    def optimizer_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and step; returns the gradient norm before clipping and whether the step was applied,
        as 0-dim tensors on the device."""

    def parameters_finite(self) -> bool: ...

    def evaluate(self, fn: Callable[[nn.Module, Run], T]) -> T:
        """fn(model, forward) under the engine's precision, through the same wrappers as training (no gradients
        are kept by the caller's no_grad). Every rank must call it the same number of times: sharded weights
        are gathered."""

    def train(self, mode: bool) -> None: ...

    def full_weights(self) -> AbstractContextManager:
        """Every parameter whole on every rank inside the block (a sharded model gathers them)."""

    def save(self, directory: Path) -> None:
        """Collectively write model and optimizer state into `directory`."""

    def load(self, directory: Path) -> None:
        """Collectively read what `save` wrote, resharded to this world size."""


def build_engine(model: nn.Module, family: Family, cfg: JobConfig, env: DistEnv,
                 load_weights: WeightLoader | None = None, load_universal: bool = False) -> Engine:
    """The engine parallel.engine names, around `model` (built on the meta device) of `family`. The global RNG
    must be seeded first: it draws the weights, the same for every engine and world size.

    load_weights: fills the weights after they are drawn (a consolidated file that starts a new run).
    load_universal: a DeepSpeed engine loads its checkpoints' universal form (another world size or stage).
    """
    loss = functools.partial(family.loss, z_loss=cfg.optim.z_loss)
    if cfg.parallel.engine == "ddp":
        return DDPEngine(model, family, loss, cfg, env, load_weights)
    ensure_process_group(env)  # FSDP2 and DeepSpeed shard over a group even when it has one rank
    if cfg.parallel.engine == "fsdp":
        if env.pp > 1:
            return PipelineEngine(model, family, loss, cfg, env)
        return FSDPEngine(model, family, loss, cfg, env, load_weights)
    return DeepSpeedEngine(model, family, loss, cfg, env, load_weights, load_universal)
