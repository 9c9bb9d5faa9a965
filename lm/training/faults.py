"""Fault injection for the fault-tolerance tests, read once from the environment; unset in real runs.

LM_FAULT_NAN_STEPS=3,4   rank 0's loss at these steps (numbered from 1, as logged) is made NaN
LM_FAULT_KILL=R:S        rank R SIGKILLs itself right after step S, on torchrun's first attempt only
                         (TORCHELASTIC_RESTART_COUNT 0), so a restarted group runs through
LM_FAULT_KILL_SAVE=R:S   rank R SIGKILLs itself inside the save of step S, right after writing its own
                         checkpoint files, while the other ranks wait for it (first attempt only)
"""

import os
import signal
from dataclasses import dataclass, field


@dataclass
class Faults:
    """The faults the environment asks for (see the module docstring)."""

    nan_steps: set[int] = field(default_factory=set)
    kill_after: tuple[int, int] | None = None  # (rank, step)
    kill_save: tuple[int, int] | None = None  # (rank, step)

    @classmethod
    def from_env(cls) -> "Faults":
        faults = cls()
        if steps := os.environ.get("LM_FAULT_NAN_STEPS"):
            faults.nan_steps = {int(s) for s in steps.split(",")}
        faults.kill_after = _rank_step("LM_FAULT_KILL")
        faults.kill_save = _rank_step("LM_FAULT_KILL_SAVE")
        return faults

    def nan_at(self, step: int, rank: int) -> bool:
        return rank == 0 and step in self.nan_steps

    def maybe_kill(self, step: int, rank: int) -> None:
        if _first_attempt() and self.kill_after == (rank, step):
            os.kill(os.getpid(), signal.SIGKILL)

    def arm_save(self, engine, step: int, rank: int) -> None:
        """Before the save of `step`: make `engine.save` kill this rank once its files are written."""
        if not (_first_attempt() and self.kill_save == (rank, step)):
            return
        save = engine.save

        def save_then_die(*args, **kwargs):
            save(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        engine.save = save_then_die


def _rank_step(name: str) -> tuple[int, int] | None:
    """The environment variable `name` read as R:S, or None when unset."""
    if not (value := os.environ.get(name)):
        return None
    rank, step = value.split(":")
    return int(rank), int(step)


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
