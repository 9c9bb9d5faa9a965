"""What the ddp and fsdp engines share: torch's own clipping and fused AdamW, and DCP checkpoints, which
either engine writes and reads at any world size, at once or from a copy in host memory in the background."""

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from lm.config import OptimConfig, TrainConfig
from lm.distributed.env import DistEnv, background_group
from lm.distributed.host_copy import HostCopy
from lm.distributed.optim import build_optimizer, set_lr, settings_kept
from lm.distributed.tensor_parallel import parallel_loss, whole
from lm.models.family import Family, Run
from lm.models.loss import compiled_loss

T = TypeVar("T")


class TorchEngine:
    """The parts of an engine that plain torch provides; `DDPEngine` and `FSDPEngine` add the wrapping."""

    name: str
    autocast: contextlib.AbstractContextManager = contextlib.nullcontext()
    skips_nonfinite = True
    schedule = None
    backward = staticmethod(torch.autograd.backward)
    _host: HostCopy | None = None
    """The host copy of the state that `stage` fills, made at its first call and reused by the next"""

    def __init__(self, model: nn.Module, train_model: Run, family: Family, train: TrainConfig, optim: OptimConfig,
                 env: DistEnv, eval_run: Run | None = None) -> None:
        """`train_model`: the forward training calls (DDP's wrapper, say); `eval_run`: the one evaluation calls
        (the model itself by default: no gradient is reduced)."""
        self.model, self.run, self.optim, self.env = model, train_model, optim, env
        self.eval_run = model if eval_run is None else eval_run
        # train.compile: the float32 loss compiled too, except over vocabulary slices (DTensors)
        self.compile_loss = train.compile and env.tp == 1
        self.optimizer = build_optimizer(model, optim, family.output_layers(model), env.world_size, env.rank)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr, self.optim)

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients only in the backward of the `last` micro-batch."""
        raise NotImplementedError

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        """Forward and backward of one micro-batch run inside: gradients reduced on the `last` one, under the
        engine's precision. Under tensor parallelism the logits are split over the vocabulary: the loss and its
        backward run on those slices (`parallel_loss`)."""
        with self._sync(last), self.autocast, parallel_loss(self.env.tp), compiled_loss(self.compile_loss):
            yield

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to `max_norm`; the norm before clipping, a 0-dim tensor on the device."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = self.grad_norm([p.grad for p in params])
        for group in by_mesh(params).values():  # one scaling per mesh: DTensor ops take one mesh
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def optimizer_step(self, norm: torch.Tensor) -> torch.Tensor:
        """Step, unless the gradient norm is NaN or inf: then the step is skipped. Clears gradients; returns
        whether the step was applied, a 0-dim tensor on the device (no host sync).

        A NaN anywhere in any rank's loss or gradients reaches every rank's norm through the gradient
        reduction, so all ranks skip together.
        """
        applied = torch.isfinite(norm)
        # The skip is decided on the device: the fused AdamW leaves weights, moments and step counts
        # alone where found_inf is 1, so the host never waits for the norm before queuing the next step.
        self.optimizer.found_inf = (~applied).float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return applied

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of all the model's gradients, whole (a 0-dim tensor on the device)."""
        meshes = by_mesh(grads)
        if len(meshes) > 1:  # expert-parallel experts live on a mesh of their own, which no DTensor op crosses
            return torch.linalg.vector_norm(torch.stack([self.grad_norm(group) for group in meshes.values()]))
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # sharded gradients: reduce the norm

    def parameters_finite(self) -> bool:
        """Whether this rank's (shard of the) weights holds only finite values: one host sync for all of them, not
        one per parameter (before every save, which an asynchronous save otherwise waits on)."""
        finite = [torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all() for p in self.model.parameters()]
        return bool(torch.stack(finite).all()) if finite else True

    def evaluate(self, fn: Callable[[nn.Module, Run], T]) -> T:
        with self.autocast, parallel_loss(self.env.tp):
            return whole(fn(self.model, self.eval_run))

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    def full_weights(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _state(self) -> dict:
        """What a checkpoint holds: {"model": ..., "optim": ...}, each rank its shards."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, directory: Path) -> None:
        """Collectively write model and optimizer as DCP shards into `directory`."""
        dcp.save(self._state(), checkpoint_id=directory)

    def allocate_stage(self) -> int:
        """Allocate the host copy `stage` fills, ahead of the first save; the bytes it holds. Complete only once the
        optimizer has state, after a step."""
        return self._host_copy().allocate(self._state())

    def _host_copy(self) -> HostCopy:
        if self._host is None:
            self._host = HostCopy(pin_memory=self.env.device.type == "cuda")
            self._write_group = background_group(self.env)  # here: every rank stages at the same step
        return self._host

    def stage(self) -> dict:
        """Model and optimizer state copied to host memory (pinned, by non-blocking copies, on CUDA), for
        `write_staged`: the copy training waits for. The copy's memory is reused by the next call, which must
        come after the write of this one has ended."""
        return self._host_copy().copy(self._state())

    def write_staged(self, staged: dict, directory: Path) -> None:
        """Collectively write what `stage` copied as DCP shards into `directory`, the same files as `save`. Meant
        for a background thread: its collectives run over a gloo group of their own."""
        dcp.save(staged, checkpoint_id=directory, process_group=self._write_group)

    def load(self, directory: Path) -> None:
        """Load model and optimizer, resharded to this world size and engine (DCP is the same for both)."""
        state = self._state()
        dcp.load(state, checkpoint_id=directory)  # in place
        with settings_kept(self.optimizer):
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])


def by_mesh(tensors: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """`tensors` grouped by their DTensor mesh (None: plain tensors), in their order: the same on every rank."""
    groups: dict[object, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device_mesh if isinstance(tensor, DTensor) else None, []).append(tensor)
    return groups
