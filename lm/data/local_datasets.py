"""Hugging Face `datasets` as lm uses it: on local files only unless a Hub dataset is named, and quiet.

Both readers of row files (`lm.data.corpora` for pretraining text, `lm.data.labelled` for fine-tuning rows) go
through `local_datasets`, so neither touches the Hub for a local file nor lets datasets' own log lines (a
"Failed to load JSON from file ..." before our error line) or progress bars reach the user: a file we refuse is
named in one line.

It also keeps `datasets` from importing torch where nothing else has: every streamed dataset builds a torch
tensor for its epoch counter when torch is installed, which cost `lm.prepare` (torch-free otherwise) 2 s and
200 MB. And it has Arrow allocate with the C library's malloc: its default pool (mimalloc) kept a few MB
more after every file read, 44 MB more after the Debian mix's 16 files read twice, where malloc stays flat
at the same speed.
"""

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from types import ModuleType

__all__ = ["local_datasets"]


@contextlib.contextmanager
def local_datasets(offline: bool = True) -> Iterator[ModuleType]:
    """The `datasets` module, offline unless `offline` is False (a Hub dataset the user named), with its
    logger and progress bars silenced for the block."""
    if offline:
        # datasets reads these when it is first imported; local files never need the Hub
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets  # slow to import, so only when a row file is read
    import pyarrow

    bars, logger = not datasets.are_progress_bars_disabled(), logging.getLogger("datasets")
    level, torch_available, pool = logger.level, datasets.config.TORCH_AVAILABLE, pyarrow.default_memory_pool()
    pyarrow.set_memory_pool(pyarrow.system_memory_pool())
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    if "torch" not in sys.modules:
        datasets.config.TORCH_AVAILABLE = False
    try:
        yield datasets
    finally:
        datasets.config.TORCH_AVAILABLE = torch_available
        pyarrow.set_memory_pool(pool)
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()
