"""Rows of text read through Hugging Face `datasets`, streamed a batch at a time: a column of local json, jsonl,
parquet and arrow files (`lm.data.local_datasets` keeps `datasets` offline), or of a split of a dataset on the
Hugging Face Hub at a pinned commit (which `lm.data.corpora.find_corpus` resolves)."""

import functools
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lm.data.local_datasets import JSON_OPTIONS, check_json_rows, local_datasets, parquet_rows, read_failure
from lm.errors import DataError

__all__ = ["HUB_PREFIX", "HubDataset", "hub_texts", "row_texts"]

HUB_PREFIX = "hf:"
"""Starts a data.source naming a dataset on the Hugging Face Hub: hf:NAME[:CONFIG[:SPLIT]]."""
_JSON_CHUNK = 1 << 20
_ROW_BATCH = 256
"""Rows read from `datasets` at a time: a batch of strings costs far less Python per row than row dicts
(the 115 MB Debian mix: 1.2 s in batches, 20 s row by row), and a few hundred rows keep memory small."""


@dataclass(frozen=True)
class HubDataset:
    """A split of a dataset on the Hugging Face Hub, pinned to the commit it was resolved to."""

    name: str
    config: str | None
    split: str
    revision: str
    """The dataset repository's commit, so the content hash changes when the dataset does."""


def row_texts(path: Path, fmt: str, text_column: str) -> Iterator[str]:
    """Stream `text_column` of each row of a json/jsonl/parquet/arrow file through Hugging Face datasets."""
    # datasets parses the first `chunksize` bytes of a JSON file once more to learn its columns: its default
    # 10 MB is the whole of most files, 1 MB reads the Debian mix in half the time and holds less
    options = {"chunksize": _JSON_CHUNK, **JSON_OPTIONS} if fmt == "json" else {}

    def open_rows(datasets, cache: str):
        return datasets.load_dataset(fmt, data_files=[str(path)], split="train", streaming=True, cache_dir=cache,
                                     **options)

    if fmt == "json":
        check_json_rows(path)
    if fmt == "parquet" and parquet_rows(path) == 0:
        raise DataError(_no_rows(str(path), text_column))
    with local_datasets() as datasets:
        import pyarrow  # loaded with datasets

        # pyarrow's parse errors (ArrowInvalid) are ValueErrors; its ArrowTypeError (a value pandas could not
        # convert, where datasets reads JSON through pandas) is not, and datasets does not wrap it when streaming
        yield from _column_texts(datasets, open_rows, str(path), functools.partial(read_failure, path, fmt),
                                 (ValueError, OSError, pyarrow.ArrowException), text_column)


def hub_texts(hub: HubDataset, text_column: str) -> Iterator[str]:
    """Stream `text_column` of each row of a Hub dataset's split, at the resolved commit."""
    def open_rows(datasets, cache: str):
        return datasets.load_dataset(hub.name, hub.config, split=hub.split, revision=hub.revision, streaming=True,
                                     cache_dir=cache)

    origin = f"{HUB_PREFIX}{hub.name}" + (f":{hub.config}" if hub.config else "") + f":{hub.split}"
    with local_datasets(offline=False) as datasets:
        # the network's and the Hub's errors come from several libraries, none of them an LMError
        yield from _column_texts(datasets, open_rows, origin,
                                 lambda err: f"cannot read from the Hugging Face Hub: {err}", Exception, text_column)


def _column_texts(
    datasets, open_rows: Callable, origin: str, failure: Callable[[BaseException], str], errors: type | tuple,
    text_column: str,
) -> Iterator[str]:
    """The strings in `text_column` of the rows that `open_rows(datasets, cache_dir)` streams, read a batch at
    a time; DataError naming `origin` for a missing column, a value that is not a string, no rows at all, or
    any of `errors` raised while reading (what `failure(err)` says of it)."""
    # Streaming writes nothing but a lock file; keep even that out of the user's home.
    with tempfile.TemporaryDirectory(prefix="lm-datasets-") as cache:
        batches, columns, rows = None, None, 0
        while True:
            try:
                if batches is None:
                    stream = open_rows(datasets, cache)
                    # known up front for the formats read here (empty for a file without rows), else None
                    columns = stream.column_names
                    if columns and text_column in columns:
                        stream = stream.select_columns([text_column])
                    batches = iter(stream.iter(batch_size=_ROW_BATCH))
                batch = None if columns and text_column not in columns else next(batches)
            except StopIteration:
                break
            except errors as err:
                raise DataError(f"{origin}: {failure(err)}") from err
            if batch is None or text_column not in batch:
                found = columns if batch is None else list(batch)
                raise DataError(f"{origin}: no column {text_column!r} (data.text_column); the columns are "
                                f"{sorted(found)}")
            for text in batch[text_column]:
                if text is None:  # a null, or a row without the key: datasets reads both as None
                    raise DataError(f"{origin}: row {rows}: column {text_column!r} is missing or null, expected a "
                                    f"string")
                if not isinstance(text, str):
                    raise DataError(f"{origin}: row {rows}: column {text_column!r} holds {text!r}, expected a string")
                rows += 1
                yield text
        if rows == 0:
            raise DataError(_no_rows(origin, text_column))


def _no_rows(origin: str, text_column: str) -> str:
    return f"{origin}: no rows with a column {text_column!r} (data.text_column); expected at least one document"
