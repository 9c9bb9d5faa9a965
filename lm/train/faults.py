"""Fault injection for the fault-tolerance tests, read once from the environment; unset in real runs.

LM_FAULT_NAN_STEPS=3,4   rank 0's loss at these steps (numbered from 1, as logged) is made NaN
LM_FAULT_KILL=R:S        rank R SIGKILLs itself right after step S, on torchrun's first attempt only
                         (TORCHELASTIC_RESTART_COUNT 0), so a restarted group runs through
"""

import os
import signal
from dataclasses import dataclass, field


class TrainingError(RuntimeError):
    """Training cannot go on (too many non-finite steps, weights no longer finite); the message names
    the checkpoint to go back to."""


@dataclass
class Faults:
    """The faults the environment asks for (see the module docstring)."""

    nan_steps: set[int] = field(default_factory=set)
    kill_rank: int | None = None
    kill_step: int | None = None

    @classmethod
    def from_env(cls) -> "Faults":
        faults = cls()
        if steps := os.environ.get("LM_FAULT_NAN_STEPS"):
            faults.nan_steps = {int(s) for s in steps.split(",")}
        if kill := os.environ.get("LM_FAULT_KILL"):
            rank, step = kill.split(":")
            faults.kill_rank, faults.kill_step = int(rank), int(step)
        return faults

    def nan_at(self, step: int, rank: int) -> bool:
        return rank == 0 and step in self.nan_steps

    def maybe_kill(self, step: int, rank: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and rank == self.kill_rank and step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
