"""What every command-line tool shares: logging setup and turning bad input into one clear line."""

import logging
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
