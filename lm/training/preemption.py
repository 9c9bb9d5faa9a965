"""Graceful stop on SIGTERM or SIGINT (what Slurm and most schedulers send before preempting a job).

The first signal only sets a flag: the trainer trains on to its next log step, writes a checkpoint and
exits 0. A second SIGINT (Ctrl-C again) restores the default handler and re-delivers itself, so the
process ends at once. SIGTERM is one request however often it comes: a scheduler signals every process of
a job, and a launcher that also forwards the signal it got must not turn the stop into a kill.
"""

import logging
import os
import signal
import threading
from types import FrameType

log = logging.getLogger("lm.train")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager that turns SIGTERM/SIGINT into `requested` (the signal's name) while it is active."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGTERM:
            return  # the same request again
        if self.requested is not None:  # a second Ctrl-C: stop now, the way the signal normally would
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.requested = name
        # said once, by rank 0 (torchrun's RANK: the signal may come before the group forms); the others keep it quiet
        level = logging.WARNING if os.environ.get("RANK", "0") == "0" else logging.INFO
        log.log(level, "%s received: training to the next log step, saving a checkpoint (unless checkpoint.every=0), "
                "then exiting (Ctrl-C or SIGINT to exit at once)", name)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python only lets the main thread handle signals
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
