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

`check_json_rows` refuses, before `datasets` reads a JSON file, the two shapes of row that take it down instead
of raising an error: a JSON Lines row that is `null` (pyarrow's JSON reader ends the process with a
segmentation fault on a block that starts with one: pyarrow 26) and a JSON array mixing objects with other
values (a TypeError from deep inside pandas).
"""

import codecs
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from lm.errors import DataError

__all__ = ["JSON_OPTIONS", "check_json_rows", "local_datasets", "parquet_rows", "read_failure"]

JSON_OPTIONS = {"on_mixed_types": None, "parse_agent_traces": False}
"""What both readers pass `datasets`' JSON loader: by default it keeps a column of mixed types (texts and a
number, a list) by turning every value of it into its JSON text, so a corpus took the number 5 as the document
"5" and each text as itself in quotes; and it reads files whose columns look like an AI agent's traces
(`type`, `message`) into a schema of its own. Without them, mixed types are an error naming the column."""
_CHUNK = 1 << 20
# what pyarrow's JSON reader says of a column of mixed types, and what its conversion from pandas says (where
# datasets reads a JSON array or object), naming the column or not
_MIXED = re.compile(r"Column\(/(?P<column>[^)]*)\) changed from|Conversion failed for column (?P<converted>.+?) with "
                    r"type|Failed to convert pandas DataFrame to Arrow Table")
_KINDS = {str: "string", bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}
_NULL_ROW = re.compile(rb"\n[ \t\r]*null[ \t\r]*\n")


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


def check_json_rows(path: Path) -> None:
    """DataError naming `path` for a row that `datasets` cannot be given safely (see the module docstring): in a
    JSON array, a value that is not an object among objects; elsewhere (JSON Lines), a line holding only null.
    Reads the file in chunks; an array, which `datasets` reads whole too, is parsed whole."""
    with open(path, "rb") as f:
        chunk = f.read(_CHUNK).removeprefix(codecs.BOM_UTF8)
        if chunk.lstrip().startswith(b"["):
            _check_array(path, chunk + f.read())
            return
        carry, line = b"\n", 1  # the unfinished line before `chunk`, after the newline that began it; its number
        while chunk:
            following = f.read(_CHUNK)
            data = carry + chunk + (b"" if following else b"\n")
            found = _NULL_ROW.search(data)
            if found is not None:
                line += data.count(b"\n", 1, found.start() + 1)
                raise DataError(f"{path}: line {line} is null; each row of JSON Lines must be an object")
            cut = data.rfind(b"\n")
            line += data.count(b"\n", 1, cut + 1)
            carry = data[cut:] if len(data) - cut < 64 else b"\nx"  # a longer line is no null row
            chunk = following


def _check_array(path: Path, data: bytes) -> None:
    try:
        rows = json.loads(data.decode("utf-8-sig"))
    except ValueError:
        return  # datasets names what is wrong with it
    if not isinstance(rows, list) or not any(isinstance(row, dict) for row in rows):
        return  # a list of texts datasets reads as the column "text"; their types are checked there
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is {json.dumps(row)[:80]}, not an object like the other rows")


def read_failure(path: Path, fmt: str, err: BaseException) -> str:
    """What to say after `path` when `datasets` could not read it as `fmt`: the first line of `err`, but for a
    column of mixed types, which pyarrow names with a row counted from the start of a block of the file (or not
    at all), the first row of each kind found again, with its value."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if fmt == "json" and text.startswith("JSON parse error") and (where := _first_bad_json(path)) is not None:
        return f"cannot read as json: {where}"  # pyarrow's row is counted from the start of a block of the file
    mixed = _MIXED.search(text)
    found = _first_two_kinds(path, mixed["column"] or mixed["converted"]) if fmt == "json" and mixed else None
    if found is None:
        return f"cannot read as {fmt}: {text}"
    column, (row, value, kind), (other_row, other_value, other_kind) = found
    return (f"column {column!r} holds both {kind} values (row {row}: {value!r}) and {other_kind} values "
            f"(row {other_row}: {other_value!r}); a column holds values of one type")


def _first_bad_json(path: Path) -> str | None:
    """Where a JSON Lines file (or a JSON array) first fails to parse, as Python's json reads it: "line L: what";
    None when it parses here."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            if f.read(_CHUNK).lstrip().startswith("["):
                f.seek(0)
                try:
                    json.load(f)
                except json.JSONDecodeError as err:
                    return f"line {err.lineno}: {err.msg}"
                return None
            f.seek(0)
            for number, line in enumerate(f, 1):
                try:
                    if line.strip():
                        json.loads(line)
                except json.JSONDecodeError as err:
                    return f"line {number}: {err.msg}"
    except (OSError, ValueError):
        return None
    return None


def _first_two_kinds(path: Path, column: str | None) -> tuple[str, tuple, tuple] | None:
    """(column, (row, value, JSON kind) of its first value, the same of its first value of another kind) for
    `column`, or the first such column when None (null fits any kind), in a JSON Lines file or array; None when
    there is none or the file cannot be parsed here."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            is_array = f.read(_CHUNK).lstrip().startswith("[")
            f.seek(0)
            rows = json.load(f) if is_array else (json.loads(line) for line in f if line.strip())
            first: dict[str, tuple] = {}
            for row, values in enumerate(rows):
                for name, value in values.items() if isinstance(values, dict) else ():
                    if value is None or column not in (None, name):
                        continue
                    kind = _KINDS[type(value)]
                    if name not in first:
                        first[name] = (row, value, kind)
                    elif kind != first[name][2]:
                        return name, first[name], (row, value, kind)
    except (OSError, ValueError):
        return None
    return None


def parquet_rows(path: Path) -> int | None:
    """The rows a parquet file's footer counts, or None when it cannot be read (loading it then says why);
    `datasets` fails on a file of none with pyarrow's "BatchSize must be greater than 0"."""
    import pyarrow.parquet

    try:
        return pyarrow.parquet.ParquetFile(path).metadata.num_rows
    except (OSError, ValueError):
        return None
