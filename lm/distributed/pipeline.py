"""Pipeline parallelism (`torch.distributed.pipelining`): the model's blocks cut into stages over the mesh's "pp"
dimension, each stage sharded by FSDP2 (and split by tensor parallelism) within its own ranks.

The blocks are cut into parallel.pp x parallel.pp_stages_per_rank stages of nearly equal size, any extra block
going to the middle stages (the first also embeds, the last also holds the head and the loss). Stage s runs on
pipeline rank s mod pp, so with several stages per rank each rank holds every pp-th stage (what the interleaved
schedule expects). One optimizer step is one run of the schedule over the step's micro-batches: the micro-batches
of train.micro_batch_size that gradient accumulation would take one by one, here in flight at once.

A stage's modules are the model's own under their whole-model names, so checkpoints hold the same keys as under
any other layout and resume across layouts. Weights are drawn as for one process: the global RNG runs through
every parameter in model order and each rank keeps the numbers of its own (`lm.distributed.fsdp.FullTensorInit`).
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lm.config import OptimConfig, ParallelConfig, TrainConfig
from lm.distributed.env import DistEnv
from lm.distributed.fsdp import FullTensorInit, parallelize
from lm.distributed.layout import device_mesh
from lm.distributed.tensor_parallel import parallel_loss, whole
from lm.distributed.torch_engine import TorchEngine
from lm.models.family import Family, LossFn
from lm.models.terms import Term
from lm.plan.layouts import stage_sizes

__all__ = ["PipelineEngine", "stage_layers"]


def stage_layers(n_layer: int, stages: int) -> list[range]:
    """The blocks of each of `stages` stages, as many as the memory plan counts (`stage_sizes`)."""
    sizes = stage_sizes(n_layer, stages)
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def merged(stages: list[nn.Module]) -> nn.Module:
    """One module holding every module of `stages` under its own name (their `blocks` dicts merged): what the
    optimizer, the gradient norm and the checkpoints see of this rank's part of the model."""
    parts = nn.Module()
    for stage in stages:
        for name, child in stage.named_children():
            if isinstance(child, nn.ModuleDict):
                if not hasattr(parts, name):
                    setattr(parts, name, nn.ModuleDict())
                getattr(parts, name).update(child)
            else:
                setattr(parts, name, child)
    return parts


class NotLastStage(Exception):
    """Raised by an evaluation forward on ranks without the last stage, once their part is done."""


class PipelineEngine(TorchEngine):
    """FSDP2 (and tensor parallelism) within each pipeline stage, the stages run by a torch schedule."""

    name = "fsdp"

    def __init__(self, model: nn.Module, family: Family, parallel: ParallelConfig, train: TrainConfig,
                 optim: OptimConfig, env: DistEnv) -> None:
        mesh = device_mesh(env)
        self.num_stages = parallel.pipeline_stages
        layers = stage_layers(len(family.blocks(model)), self.num_stages)
        self.stage_ids = [env.pp_rank + k * env.pp for k in range(parallel.pp_stages_per_rank)]
        self.stages = [family.parallel.stage(model, layers[s], env.tp) for s in self.stage_ids]
        blocks = [family.blocks(model)[i] for s in self.stage_ids for i in layers[s]]
        parallelize(self.stages, blocks, family, model, parallel, train, env, mesh)
        with FullTensorInit():  # the other stages' parameters stay on the meta device: their numbers are skipped
            model.init_weights()
        parts = merged(self.stages)
        super().__init__(parts, parts, family, train, optim, env)
        self.pp_group = mesh["pp"].get_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)  # global rank of each pipeline rank
        self.has_first, self.has_last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        stages = [PipelineStage(stage, s, self.num_stages, env.device, group=self.pp_group)
                  for s, stage in zip(self.stage_ids, self.stages)]
        n_micro = train.batch_size // (train.micro_batch_size * env.dp_size)
        self._step_loss: LossFn | None = None  # the step's loss, while its schedule runs
        self._terms: list[dict[str, Term]] = []
        if parallel.pp_schedule == "interleaved_1f1b":
            self._schedule = ScheduleInterleaved1F1B(stages, n_micro, loss_fn=self._loss)
        else:
            kind = ScheduleGPipe if parallel.pp_schedule == "gpipe" else Schedule1F1B
            self._schedule = kind(stages[0], n_micro, loss_fn=self._loss)

    def _loss(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss on the last stage, from its output `h`: the family's loss, its forward already
        run by the pipeline. Keeps the terms the trainer logs."""
        losses = self._step_loss(self.stages[-1], lambda *inputs: h, [None, target])
        self._terms.append({name: whole(term) for name, term in losses.detached().items()})
        return losses.optimized

    def schedule(self, batches: list[list[torch.Tensor]], loss: LossFn) -> list[dict[str, Term]]:
        """Forward and backward of the step's micro-batches through the pipeline schedule (inputs into the first
        stage, targets to the last); each micro-batch's detached terms on the last stage's ranks, none on the
        others."""
        x = torch.cat([batch[0] for batch in batches])
        y = torch.cat([batch[1] for batch in batches])
        self._step_loss, self._terms = loss, []
        with parallel_loss(self.env.tp):
            if self.has_first:
                self._schedule.step(x, target=y if self.has_last else None)
            elif self.has_last:
                self._schedule.step(target=y)
            else:
                self._schedule.step()
        # the first step also calls the loss once on the stages' shape-inference pass: only the last n_micro count
        return self._terms[-len(batches):] if self.has_last else []

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm over every stage's gradients: this rank's squared norm summed over the pipeline ranks."""
        norm = super().grad_norm(grads) if grads else torch.zeros((), device=self.env.device)
        squared = norm.square()
        dist.all_reduce(squared, group=self.pp_group)
        return squared.sqrt()

    def _stage_forward(self, x: torch.Tensor, *positions: torch.Tensor) -> torch.Tensor:
        """The whole model's forward of one batch, stage after stage (no schedule: evaluation takes batches of
        any size), each stage's output sent to the next one's rank. The last stage's rank returns its output;
        the others raise NotLastStage once their part is done."""
        out = None
        for s in range(self.num_stages):
            if s not in self.stage_ids:
                continue
            if s == 0:
                inp = x
            else:  # the residual stream, cut into tensor-parallel sequence slices
                inp = torch.empty(x.shape[0], x.shape[1] // self.env.tp, self.stages[0].cfg.d_model,
                                  device=self.env.device)
                dist.recv(inp, src=self.pp_ranks[(s - 1) % self.env.pp], group=self.pp_group)
            out = self.stages[self.stage_ids.index(s)](inp)
            if s < self.num_stages - 1:
                dist.send(out.float().contiguous(), dst=self.pp_ranks[(s + 1) % self.env.pp], group=self.pp_group)
        if not self.has_last:
            raise NotLastStage
        return out

    def evaluate(self, fn):
        """fn(last stage, the pipelined forward) on the last stage's rank; its result on every rank."""
        result = None
        with parallel_loss(self.env.tp):
            try:
                result = whole(fn(self.stages[-1], self._stage_forward))
            except NotLastStage:
                pass
        box = [_to(result, "cpu")]
        dist.broadcast_object_list(box, src=self.pp_ranks[-1], group=self.pp_group)
        return _to(box[0], self.env.device)


def _to(value, device):
    """`value` (a tensor, or a dataclass of them, or None) with its tensors on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _to(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value)})
    return value
