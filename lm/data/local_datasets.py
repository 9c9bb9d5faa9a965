"""Hugging Face `datasets` as lm uses it: on local files only, and quiet.

Both readers of row files (`lm.data.corpora` for pretraining text, `lm.data.labelled` for fine-tuning rows) go
through `local_datasets`, so neither touches the Hub nor lets datasets' own log lines (a "Failed to load JSON
from file ..." before our error line) or progress bars reach the user: a file we refuse is named in one line.
"""

import contextlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType

__all__ = ["local_datasets"]


@contextlib.contextmanager
def local_datasets() -> Iterator[ModuleType]:
    """The `datasets` module, offline, with its logger and progress bars silenced for the block."""
    # datasets reads these when it is first imported; local files never need the Hub
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets  # slow to import, so only when a row file is read

    bars, logger = not datasets.are_progress_bars_disabled(), logging.getLogger("datasets")
    level = logger.level
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield datasets
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()
