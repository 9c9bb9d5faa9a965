"""What every command-line tool shares: logging setup and turning bad input into one clear line."""

import argparse
import ctypes
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TextIO

from lm.errors import LMError


def setup_logging(stream: TextIO | None = None) -> None:
    """INFO to `stream` (stdout by default); `init_distributed` lowers other ranks to warnings, so a run prints
    one log."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        stream=stream or sys.stdout,
    )


class Stopped(Exception):
    """A signal stopped the run a tool had started (`run_logged`): the tool stops too."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


def run(main: Callable[[list[str]], int | None], argv: list[str] | None = None, logs: TextIO | None = None) -> int:
    """Run a tool's `main(argv)`, its log lines on `logs` (stdout by default; stderr for a tool whose stdout is
    what it makes, as lm.sample's text); an error of bad input (`LMError`, or a file that is not there) exits 2
    with one line on stderr; a Ctrl-C or a signal passed on to a tool's run (`Stopped`) ends it with one line
    too, exiting 128 + the signal's number as a shell does."""
    setup_logging(logs)
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except (LMError, FileNotFoundError) as err:
        return _one_line(f"error: {err}", 2)
    except Stopped as err:
        return _one_line(f"stopped: {err}", 128 + err.signum)
    except KeyboardInterrupt:
        return _one_line("stopped: SIGINT (Ctrl-C)", 128 + signal.SIGINT)


def _one_line(text: str, code: int) -> int:
    # one write of the whole line: ranks of one launch share stderr, and print's separate write of the
    # newline let two ranks' lines run together
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    return code


def exit_without_teardown(code: int) -> NoReturn:
    """End the process with `code`, skipping the interpreter's teardown, once what it printed is flushed.

    For tools that ran a process group, after they closed it. Gloo's worker threads outlive
    `destroy_process_group`, and one may still be dropping the last collective's tensors when the
    interpreter finalizes: a thread that needs the GIL then aborts the whole process ("terminate called
    without an active exception", SIGABRT after a finished run; seen under ZeRO-3 on a busy CPU, where the
    worker is scheduled late). The run has closed its files, its TensorBoard writer and the group by then,
    so the teardown has nothing left to do that a finished run needs.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def positive_int(text: str) -> int:
    """argparse type of a count: 0 or less is refused (it would not mean "the default")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def a_path(text: str) -> Path:
    """argparse type of a path flag: an empty one is refused, where Path("") would be the working directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return Path(text)


def finite_float(text: str) -> float:
    """argparse type of a float setting: nan and inf are refused (they pass every range check)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def in_range(kind: type[int] | type[float], low: float, high: float) -> Callable[[str], Any]:
    """argparse type of a number of `kind` (int or float) in [low, high]: text that is not one, nan, inf and a
    value outside are refused with the range, so a flag's bounds are written once, where it is declared, and a
    huge value never reaches a library that would overflow on it."""
    bounds = ", ".join(str(b) if isinstance(b, int) else f"{b:g}" for b in (low, high))
    expected = f"expected {'an integer' if kind is int else 'a number'} in [{bounds}]"

    def parse(text: str) -> int | float:
        shown = repr(text) if len(text) <= 24 else f"{text[:6]!r}... ({len(text)} characters)"
        try:
            value = kind(text)
        except ValueError:  # not a number, or an int of more digits than Python converts
            raise argparse.ArgumentTypeError(f"{expected}, got {shown}") from None
        if isinstance(value, float) and not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{expected}, got {shown}")
        return value

    return parse


PREPARE_READS = ("data", "model.vocab_size")
"""What lm.prepare reads of a config; it refuses an override of anything else. The data,
and model.vocab_size, which the config checks against a tiktoken data.tokenizer (--data.tokenizer=cl100k_base
needs --model.vocab_size=100277)."""


def prepare_command(config: list[str], overrides: list[str]) -> list[str]:
    """`lm.prepare` of the data a job trains on: the job's `--config FILE` (`config`, or none) and, of its
    `overrides`, those lm.prepare reads."""
    keys = [o.removeprefix("--").split("=", 1)[0] for o in overrides]  # as `command_line.unread_override` reads them
    read = [o for o, key in zip(overrides, keys) if key in PREPARE_READS or key.split(".", 1)[0] in PREPARE_READS]
    return [sys.executable, "-m", "lm.prepare", *config, *read]


def train_command(nproc: int, args: list[str]) -> list[str]:
    """`lm.train` with `args`: one process, or a torchrun job of `nproc` on this machine."""
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "lm.train", *args]
    return [sys.executable, "-m", "lm.train", *args]


PR_SET_PDEATHSIG = 1
"""prctl(2)'s option for the signal a process gets when the thread that started it exits."""


def _term_when_parent_dies(parent: int) -> Callable[[], None] | None:
    """What a child runs before it execs so that it gets a SIGTERM when `parent` dies (Linux's prctl; None where
    there is none). libc is looked up here, in the parent: the child between fork and exec calls only prctl."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed: start no run
            os._exit(128 + signal.SIGTERM)

    return arm


def run_logged(command: list[str], log_path: Path) -> str:
    """Run `command` with its output appended to `log_path` (its directory made); "finished", or why not:
    the exit status and the run's last `error:` line. A SIGINT (Ctrl-C) or SIGTERM that reaches this process
    meanwhile is passed on to the run once, and `Stopped` is raised once the run has exited.

    The run has a session (and process group) of its own, so that a Ctrl-C in the terminal reaches it once, through this
    process: lm.train then trains to its next log step, saves and exits, where a second SIGINT would stop it at
    once, and subprocess.run would have killed it 0.25 s after the first. Being in a session of its own, it would
    outlive this process killed (`kill -9`, the kernel's out-of-memory killer) and hold its run directory, training
    for nobody; on Linux it gets a SIGTERM then instead, so it saves and exits as on a preemption."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    received: list[int] = []
    with open(log_path, "a") as out:
        start = out.tell()  # the log holds every launch of the run: this one's lines start here
        out.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
        out.flush()
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 preexec_fn=_term_when_parent_dies(os.getpid()))

        def pass_on(signum: int, frame: object) -> None:
            received.append(signum)
            child.send_signal(signum)

        previous = {signum: signal.signal(signum, pass_on) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = child.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    if received:
        name = signal.Signals(received[0]).name
        raise Stopped(received[0], f"{name} passed on to the run, which exited {code} (log: {log_path})")
    if code == 0:
        return "finished"
    with open(log_path, "rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error:")]
    why = f"killed by {signal_name(-code)}" if code < 0 else f"exit {code}"
    return f"failed ({why}{': ' + errors[-1] if errors else ''}; see {log_path})"


def signal_name(signum: int) -> str:
    """SIGKILL, say, for 9; "signal N" for a number that names none."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
