"""One optimizer step, top to bottom: the learning rate, each micro-batch's forward, loss and backward (gradients
reduced on the last one), clipping and the optimizer step. The engine supplies the pieces that differ by kind of
parallelism (`lm.distributed.engine.Engine`); the family's loss names the terms the trainer logs."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lm.distributed.engine import Engine
from lm.distributed.tensor_parallel import whole
from lm.models.family import LossFn, StepUpdate
from lm.models.terms import Term, combine


@dataclass
class Step:
    """What a step leaves for the log, all on the device (no host sync)."""

    terms: dict[str, Term]
    """The loss's terms reduced over the step's micro-batches (none on a pipeline rank without the last stage)"""
    grad_norm: torch.Tensor
    """0-dim, before clipping"""
    applied: torch.Tensor
    """0-dim bool: False where a non-finite norm made the engine skip the step"""


def train_step(engine: Engine, loss: LossFn, batches: list[list[torch.Tensor]], lr: float, grad_clip: float,
               after: StepUpdate | None = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
               lr_factor: float = 1.0) -> Step:
    """One optimizer step over this rank's micro-batches `batches` (on the device) at learning rate `lr`,
    clipping the gradients' global norm to `grad_clip` (0: no clipping); then the family's update outside the
    gradients (`Training.after_step`), given `reduce`, the collective over the data-parallel ranks, and the step's
    size: `lr_factor`, the learning-rate schedule's factor (lr over the peak), or 0 where the engine skipped it."""
    engine.set_lr(lr)
    if engine.schedule is not None:  # a pipeline's schedule runs forward and backward of every micro-batch
        micro_terms = engine.schedule(batches, loss)
    else:
        micro_terms = []
        for i, batch in enumerate(batches):
            with engine.micro_batch(last=i == len(batches) - 1):
                losses = loss(engine.model, engine.run, batch)
                # each micro-batch's mean counts 1 / len(batches) of the step's objective
                engine.backward(losses.optimized / len(batches))
            micro_terms.append({name: whole(term) for name, term in losses.detached().items()})
    norm = engine.clip_grad_norm(grad_clip or math.inf)
    applied = engine.optimizer_step(norm)
    if after is not None:
        after(engine.model, reduce or (lambda t: t), applied.float() * lr_factor)
    return Step(combine(micro_terms) if micro_terms else {}, norm, applied)
