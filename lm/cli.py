"""What every command-line tool shares: logging setup and turning bad input into one clear line."""

import argparse
import logging
import math
import sys
from collections.abc import Callable

from lm.errors import LMError


def setup_logging() -> None:
    """INFO to stdout; `init_distributed` lowers other ranks to warnings, so a run prints one log."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
    )


def run(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Run a tool's `main(argv)`; an error of bad input (`LMError`, or a file that is not there) exits 2
    with one line on stderr."""
    setup_logging()
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except (LMError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def positive_int(text: str) -> int:
    """argparse type of a count: 0 or less is refused (it would not mean "the default")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def finite_float(text: str) -> float:
    """argparse type of a float setting: nan and inf are refused (they pass every range check)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value
