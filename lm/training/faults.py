"""Fault injection for the fault-tolerance tests, read from the environment and wrapped around a built trainer
from outside: nothing in the trainer, the engines or the optimizers knows of it. Unset in real runs.

LM_FAULT_NAN_STEPS=3,4   rank 0's loss at these steps (numbered from 1, as logged) is made NaN
LM_FAULT_KILL=R:S        rank R SIGKILLs itself right after step S, on torchrun's first attempt only
                         (TORCHELASTIC_RESTART_COUNT 0), so a restarted group runs through
LM_FAULT_KILL_SAVE=R:S   rank R SIGKILLs itself inside the save of step S, right after writing its own
                         checkpoint files, while the other ranks wait for it (first attempt only)
LM_FAULT_KILL_WRITE=R:S  checkpoint.async: rank R SIGKILLs itself in the background write of step S, right after
                         writing its own files and before the checkpoint is published, while training goes on
                         (first attempt only)
"""

import os
import signal
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from lm.models.family import LossFn
from lm.models.terms import Losses

if TYPE_CHECKING:
    from lm.training.trainer import Trainer


def install_faults(trainer: "Trainer") -> None:
    """Wrap `trainer`'s loss and its engine's save, and add a step hook, as the LM_FAULT_* variables ask."""
    rank, engine = trainer.env.rank, trainer.engine
    nan_steps = {int(s) for s in os.environ.get("LM_FAULT_NAN_STEPS", "").split(",") if s}
    if nan_steps and rank == 0:
        trainer.loss = nan_at(trainer.loss, lambda: trainer.step + 1 in nan_steps)  # the step being taken, as logged
    if not _first_attempt():
        return
    if (kill_after := _rank_step("LM_FAULT_KILL")) and kill_after[0] == rank:
        trainer.after_step.append(lambda step: step == kill_after[1] and _die())
    if (kill_save := _rank_step("LM_FAULT_KILL_SAVE")) and kill_save[0] == rank:
        save = engine.save

        def save_then_die(*args, **kwargs):
            save(*args, **kwargs)
            if trainer.step == kill_save[1]:
                _die()

        engine.save = save_then_die
    kill_write = _rank_step("LM_FAULT_KILL_WRITE")
    if kill_write and kill_write[0] == rank and trainer.background is not None:
        write = engine.write_staged

        def write_then_die(staged, directory):
            write(staged, directory)
            if directory.name == f"step_{kill_write[1]:08d}.tmp":  # the trainer's step has moved on by now
                _die()

        engine.write_staged = write_then_die


def nan_at(loss: LossFn, now: Callable[[], bool]) -> LossFn:
    """`loss` with every term made NaN whenever `now()` says so."""
    def loss_or_nan(*args) -> Losses:
        losses = loss(*args)
        if not now():
            return losses
        return Losses({name: replace(term, value=term.value * float("nan")) for name, term in losses.terms.items()},
                      losses.objective)

    return loss_or_nan


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _rank_step(name: str) -> tuple[int, int] | None:
    """The environment variable `name` read as R:S, or None when unset."""
    if not (value := os.environ.get(name)):
        return None
    rank, step = value.split(":")
    return int(rank), int(step)


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
