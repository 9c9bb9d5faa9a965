"""One optimizer step (`lm.training.step.train_step`) under the ddp engine on one process: the micro-batches'
gradients averaged, and the whole gradient clipped before the optimizer sees it."""

import dataclasses
import functools

import pytest
import torch

from lm.config import load_config
from lm.distributed.env import DistEnv
from lm.models.registry import family_of
from lm.training.setup import build_run_engine
from lm.training.step import train_step

TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=16", "--data.seq_len=16",
        "--train.device=cpu", "--train.batch_size=4", "--train.micro_batch_size=4"]


def engine_and_loss():
    cfg = load_config(None, TINY)
    family = family_of(cfg.model)
    torch.manual_seed(0)
    engine = build_run_engine(cfg, family, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    return engine, functools.partial(family.training.loss, optim=cfg.optim)


def batch(rows: slice) -> list[torch.Tensor]:
    x = torch.randint(0, 50257, (4, 17), generator=torch.Generator().manual_seed(1))[rows]
    return [x[:, :-1], x[:, 1:]]


def test_micro_batches_average_to_the_whole_batchs_gradient():
    whole_engine, loss = engine_and_loss()
    whole = train_step(whole_engine, loss, [batch(slice(0, 4))], 1e-3, 0.0)
    split_engine, loss = engine_and_loss()
    split = train_step(split_engine, loss, [batch(slice(0, 2)), batch(slice(2, 4))], 1e-3, 0.0)
    assert split.terms["loss"].value.item() == pytest.approx(whole.terms["loss"].value.item(), rel=1e-6)
    assert split.grad_norm.item() == pytest.approx(whole.grad_norm.item(), rel=1e-5)
    for a, b in zip(whole_engine.model.parameters(), split_engine.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_optimizer_sees_the_gradient_clipped_to_grad_clip():
    engine, loss = engine_and_loss()
    seen = []
    step_as_given = engine.optimizer_step

    def optimizer_step(norm: torch.Tensor) -> torch.Tensor:
        grads = [p.grad for p in engine.model.parameters() if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        return step_as_given(norm)

    engine.optimizer_step = optimizer_step
    step = train_step(engine, loss, [batch(slice(0, 2)), batch(slice(2, 4))], 1e-3, 0.01)
    assert step.grad_norm.item() > 0.1 and seen == [pytest.approx(0.01, rel=1e-4)]  # the norm logged is before


def test_the_familys_update_after_a_step_is_sized_by_the_schedule_and_nothing_after_a_skipped_step():
    """`Training.after_step` (a mixture's router-bias update) moves by the schedule's factor after an applied step,
    and not at all after a step the engine skipped for a non-finite gradient."""
    engine, loss = engine_and_loss()
    sizes = []

    def after(model, reduce, size: torch.Tensor) -> None:
        sizes.append(size.item())

    train_step(engine, loss, [batch(slice(0, 4))], 1e-3, 1.0, after=after, lr_factor=0.5)

    def nan_loss(model, run, micro):
        losses = loss(model, run, micro)
        poisoned = dataclasses.replace(losses.terms["loss"], value=losses.terms["loss"].value * float("nan"))
        return dataclasses.replace(losses, terms={**losses.terms, "loss": poisoned})

    skipped = train_step(engine, nan_loss, [batch(slice(0, 4))], 1e-3, 1.0, after=after, lr_factor=0.5)
    assert not skipped.applied and sizes == [0.5, 0.0]
