"""What every command-line tool shares: logging setup and turning known errors into one clear line."""

import logging
import sys
from collections.abc import Callable

from lm.models.config import ConfigError


def setup_logging() -> None:
    """INFO to stdout; `init_distributed` lowers other ranks to warnings, so a run prints one log."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
    )


def user_errors() -> tuple[type[Exception], ...]:
    """Exceptions caused by the user's input: reported as `error: ...` without a traceback."""
    from lm.checkpoint import CheckpointError
    from lm.data.shards import DataError
    from lm.tokenizer import TokenizerError
    from lm.train.faults import TrainingError

    return (ConfigError, CheckpointError, DataError, TokenizerError, TrainingError, FileNotFoundError)


def run(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Run a tool's `main(argv)`; a user error exits 2 with one line on stderr."""
    setup_logging()
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
