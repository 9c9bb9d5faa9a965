"""The engines: one interface over DDP, FSDP2 and DeepSpeed ZeRO for the trainer and the checkpoints.

An engine wraps a model it is given, built on the meta device: it allocates the weights (sharded or whole), draws
them from the global RNG, lets a loader fill them in (`load_weights`: a consolidated file that starts a run), wraps
the model for its kind of parallelism and owns the optimizer. It supplies the pieces of a step that differ by
engine (precision and gradient sync around a micro-batch, backward, clipping, the optimizer step, a pipeline's
schedule), which `lm.training.step` puts together. What it needs of the model it asks the model's family
(`lm.models.family`): its blocks and its output layers. It reads the job's parallel, train and optim sections
only. The model code is the same under every engine; engines never build a model or read a checkpoint file.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, TypeVar

import torch
import torch.nn as nn

from lm.config import OptimConfig, ParallelConfig, TrainConfig
from lm.distributed.ddp import DDPEngine
from lm.distributed.env import DistEnv, ensure_process_group
from lm.distributed.float8 import apply_float8
from lm.distributed.fsdp import FSDPEngine
from lm.distributed.materialize import WeightLoader
from lm.distributed.zero import DeepSpeedEngine
from lm.models.family import Family, LossFn, Run
from lm.models.terms import Term

T = TypeVar("T")


class Engine(Protocol):
    """The pieces of an optimizer step that differ by engine (`lm.training.step.train_step` puts them together),
    and what evaluation, sampling and checkpoints ask of the model it holds."""

    name: str
    model: nn.Module
    """The model as built (sharded in place under fsdp; DDP's and DeepSpeed's wrappers are kept apart)."""
    run: Run
    """The model's forward as training calls it: through DDP's or DeepSpeed's wrapper and their hooks"""
    optimizer: torch.optim.Optimizer
    skips_nonfinite: bool
    """Whether a step with a non-finite gradient norm is skipped on the device (ddp, fsdp), or already applied
    when its norm is known (DeepSpeed): then the run must stop at the first one."""
    schedule: Callable[[list[list[torch.Tensor]], LossFn], list[dict[str, Term]]] | None
    """A pipeline's: forward and backward of a step's micro-batches through its schedule, and their detached
    terms (on the last stage's ranks); None where the step runs the micro-batches one by one itself."""

    def set_lr(self, lr: float) -> None: ...

    def micro_batch(self, last: bool) -> AbstractContextManager:
        """Around one micro-batch's forward and backward: the engine's precision, and gradients reduced only on
        the `last` one."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's share of the step's objective."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients; their global norm before clipping, a 0-dim tensor on the device."""

    def optimizer_step(self, norm: torch.Tensor) -> torch.Tensor:
        """Step (unless the norm is not finite, where the engine can skip); whether the step was applied, a 0-dim
        tensor on the device."""

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

    def allocate_stage(self) -> int:
        """Allocate the host memory `stage` copies into, ahead of the first save; the bytes it holds (ddp and
        fsdp, as `stage`)."""

    def stage(self) -> dict:
        """Model and optimizer state copied to host memory, for `write_staged` (ddp and fsdp; DeepSpeed writes only
        its own checkpoints, and refuses checkpoint.async)."""

    def write_staged(self, staged: dict, directory: Path) -> None:
        """Collectively write what `stage` copied into `directory`, as `save` would; from a background thread."""

    def load(self, directory: Path) -> None:
        """Collectively read what `save` wrote, resharded to this world size."""


def build_engine(model: nn.Module, family: Family, parallel: ParallelConfig, train: TrainConfig,
                 optim: OptimConfig, env: DistEnv, load_weights: WeightLoader | None = None,
                 load_universal: bool = False) -> Engine:
    """The engine parallel.engine names, around `model` (built on the meta device) of `family`, with the
    optimizer `optim` describes. The global RNG must be seeded first: it draws the weights, the same for every
    engine and world size.

    load_weights: fills the weights after they are drawn (a consolidated file that starts a new run).
    load_universal: a DeepSpeed engine loads its checkpoints' universal form (another world size or stage).
    """
    # train.float8's layers swapped in before any engine compiles, shards or allocates the model
    apply_float8(model, family, train, parallel.engine == "fsdp", env.device, env.is_main)
    if parallel.engine == "ddp":
        return DDPEngine(model, family, parallel, train, optim, env, load_weights)
    ensure_process_group(env, parallel.cpu_offload)  # FSDP2 and DeepSpeed shard over a group even of one rank
    if parallel.engine == "fsdp":
        if env.pp > 1:
            # imported here: torch's pipelining schedules import dynamo, ~0.7 s of every process's start
            from lm.distributed.pipeline import PipelineEngine

            return PipelineEngine(model, family, parallel, train, optim, env)
        return FSDPEngine(model, family, parallel, train, optim, env, load_weights)
    return DeepSpeedEngine(model, family, parallel, train, optim, env, load_weights, load_universal)
