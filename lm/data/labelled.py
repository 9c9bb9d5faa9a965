"""Labelled examples for fine-tuning an encoder: read from a csv/json/jsonl/parquet file, split, encoded,
and batched.

An example is one text with one label: a class in [0, num_classes) for a classifier (kind "classify") or
a number for a regression head (kind "regress"). Each text becomes [CLS] followed by its token ids. The
training loader follows `TokenLoader`: its whole state is the number of examples consumed, each epoch
visits the examples in a permutation drawn from (seed, epoch), and each step's global batch is cut the
same way at every world size, so a run resumes on any number of ranks. Batches are padded to their
longest example with pad_id, under a key-padding mask `keep` (True at real tokens).
"""

import csv
import math
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from lm.data.loader import rank_slice
from lm.data.local_datasets import JSON_OPTIONS, check_json_rows, local_datasets, parquet_rows, read_failure
from lm.data.mixture import sample_order
from lm.data.prepare import is_val_document, smallest_val_fraction
from lm.errors import DataError

__all__ = ["KINDS", "ExampleLoader", "encode_examples", "example_batches", "pad_examples", "read_labelled",
           "read_texts", "split_examples"]

KINDS = ("classify", "regress")
_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def read_labelled(
    path: str | Path, text_column: str, label_column: str, kind: str, num_classes: int = 0,
    every_class: bool = True, labels_optional: bool = False,
) -> tuple[list[str], np.ndarray | None]:
    """The texts and labels of a labelled file: (texts, labels (N,)), labels int64 for kind "classify"
    and float64 for "regress"; labels None when `labels_optional` and the file has no `label_column`.

    Raises DataError naming the file and the column, row (counted from 0, a csv's header excluded) or
    value for: an unknown suffix, a missing or empty file, a missing column, a text that is not a
    string; classify: a label that is not an integer in [0, num_classes) (a string of one, as a csv
    column mixing numbers and words holds, counts), or, with `every_class`, a class in [0, num_classes)
    that never occurs (num_classes does not match the training data; a small file only scored need not
    hold every class); regress: a label that is not a finite number.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "classify" and num_classes < 2:
        raise ValueError(f"a classifier needs num_classes >= 2, got {num_classes}")
    path = Path(path)
    others, optional = ((), (label_column,)) if labels_optional else ((label_column,), ())
    columns = _read_columns(path, text_column, others, optional)
    texts = _texts(path, text_column, columns[text_column])
    if label_column not in columns:
        return texts, None
    values = columns[label_column]
    if kind == "regress":
        return texts, _numbers(path, label_column, values)
    return texts, _classes(path, label_column, values, num_classes, every_class)


def read_texts(path: str | Path, text_column: str) -> list[str]:
    """The texts of a file without labels (csv/json/jsonl/parquet), refused as `read_labelled` refuses them."""
    path = Path(path)
    return _texts(path, text_column, _read_columns(path, text_column)[text_column])


def _texts(path: Path, column: str, values: list) -> list[str]:
    for row, text in enumerate(values):
        if not isinstance(text, str):
            raise DataError(f"{path}: row {row}: column {column!r} holds {text!r}, expected a string")
    return values


def _read_columns(path: Path, text: str, others: Sequence[str] = (), optional: Sequence[str] = ()
                  ) -> dict[str, list]:
    """The columns `text` and `others` of a csv/json/jsonl/parquet file, read whole by Hugging Face datasets, and
    those of `optional` that it has; a csv's `text` column is read as written, numbers and all."""
    names = (text, *others)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: unsupported extension {path.suffix!r}; expected one of {', '.join(_FORMATS)}")
    if path.is_dir():
        raise DataError(f"{path}: is a directory; expected a {', '.join(_FORMATS)} file")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file; expected a header and labelled rows")
    # datasets writes an Arrow copy before loading it; a temporary cache keeps it out of the user's home,
    # and keep_in_memory loads it whole, so the copy can go at once
    # a csv cell is read as written: pandas would otherwise turn "", "NA", "null", "None" ... into a missing value
    # and a text column of numbers alone ("007", "1e5") stays text
    options = {"keep_default_na": False, "converters": {text: str}} if fmt == "csv" \
        else JSON_OPTIONS if fmt == "json" else {}
    if fmt == "json":
        check_json_rows(path)
    if fmt == "parquet" and parquet_rows(path) == 0:
        raise DataError(f"{path}: no rows; expected labelled examples")
    with local_datasets() as datasets:
        try:
            with tempfile.TemporaryDirectory(prefix="lm-datasets-") as cache:
                table = datasets.load_dataset(
                    fmt, data_files=[str(path)], split="train", cache_dir=cache, keep_in_memory=True, **options
                )
        # pyarrow's parse errors (ArrowInvalid) are ValueErrors, which datasets wraps when it meets them in a file
        except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as err:
            if "corresponds to no data" in str(err):
                raise DataError(f"{path}: no rows; expected labelled examples") from err
            raise DataError(f"{path}: {read_failure(path, fmt, err.__cause__ or err)}") from err
    if fmt == "csv":
        _check_csv(path)
    for name in names:
        if name not in table.column_names:
            raise DataError(f"{path}: no column {name!r}; the columns are {sorted(table.column_names)}")
    if table.num_rows == 0:
        raise DataError(f"{path}: no rows; expected labelled examples")
    try:  # pyarrow's JSON reader keeps bytes that are not UTF-8 in a string column; they fail only here
        return {name: list(table[name]) for name in (*names, *optional) if name in table.column_names}
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: holds text that is not UTF-8 ({err.reason}); convert the file to UTF-8") from None


def _check_csv(path: Path) -> None:
    """Refuse a csv that pandas reads without a word, but wrongly: a header that names a column twice (pandas
    renames the second, `label.1`, and the first is read), and a row with more or fewer fields than the header
    (with one more in every row pandas takes the first field for an index, and each text is read cut at its first
    comma). A blank line is no row, as for pandas."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = csv.reader(f)
        header = next(rows, [])
        twice = sorted({name for name in header if header.count(name) > 1})
        if twice:
            raise DataError(f"{path}: the header names column {twice[0]!r} {header.count(twice[0])} times; rename "
                            "all but one")
        for row in rows:
            if row and len(row) != len(header):
                fix = "quote a text that holds a comma" if len(row) > len(header) else "give every column a value"
                fields = f"{len(row)} field{'s' * (len(row) != 1)}"
                raise DataError(f"{path}: line {rows.line_num} has {fields} and the header {len(header)} "
                                f"({', '.join(header)}); {fix}")


def _number(value: object) -> float | None:
    """`value` as a float, or None where it is no number: None, a bool, or a string that does not parse."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


MAX_REGRESSION_LABEL = float(np.finfo(np.float32).max) ** 0.5
"""The largest regression label: the head trains in float32, where a larger one's squared error is inf."""


def _numbers(path: Path, column: str, values: list) -> np.ndarray:
    labels = np.empty(len(values), dtype=np.float64)  # (N,)
    for row, value in enumerate(values):
        number = _number(value)
        if number is None or not math.isfinite(number):
            raise DataError(f"{path}: row {row}: column {column!r} holds {value!r}; a regression label must be "
                            "a finite number")
        if abs(number) >= MAX_REGRESSION_LABEL:
            raise DataError(f"{path}: row {row}: column {column!r} holds {value!r}; a regression label must be "
                            f"below {MAX_REGRESSION_LABEL:.3g} in magnitude, where its squared error fits float32")
        labels[row] = number
    return labels


def _classes(path: Path, column: str, values: list, num_classes: int, every_class: bool) -> np.ndarray:
    labels = np.empty(len(values), dtype=np.int64)  # (N,)
    for row, value in enumerate(values):
        number = _number(value)
        if number is None or not number.is_integer() or not 0 <= number < num_classes:
            raise DataError(f"{path}: row {row}: column {column!r} holds {value!r}; a class label must be an "
                            f"integer in [0, {num_classes})")
        labels[row] = int(number)
    present = set(labels.tolist())
    if every_class and len(present) < num_classes:
        # the first few: they lie below len(present) + 5 (no array of num_classes counts, which may be huge)
        missing = [c for c in range(min(num_classes, len(present) + 5)) if c not in present][:5]
        unshown = num_classes - len(present) - len(missing)
        more = f" (and {unshown:,} more)" if unshown else ""
        shown = sorted(present)[:10]
        raise DataError(
            f"{path}: column {column!r} never holds class {', '.join(map(str, missing))}{more} of "
            f"num_classes={num_classes}; the labels hold classes {shown}{' ...' if len(present) > 10 else ''}, so "
            "num_classes does not match the data"
        )
    return labels


def split_examples(n: int, val_fraction: float, key: str = "val_fraction") -> tuple[np.ndarray, np.ndarray]:
    """(train indices, val indices), each int64 and ascending: exactly floor(n * val_fraction) evenly
    spaced examples go to val, by the rule that splits documents when preparing (`is_val_document`), so
    at least one is left for training when val_fraction < 1. DataError naming the setting `key` when
    val_fraction > 0 puts no example in val."""
    is_val = np.array([is_val_document(i, val_fraction) for i in range(n)], dtype=bool)  # (n,)
    train, val = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    if val_fraction > 0 and not val.size:
        raise DataError(f"{key}={val_fraction} puts none of the {n} examples in the val split; raise it to at "
                        f"least {smallest_val_fraction(n):g} or add examples")
    return train, val


def encode_examples(
    texts: Sequence[str], encode: Callable[[str], list[int]], cls_id: int, max_len: int,
) -> list[np.ndarray]:
    """Each text as [cls_id] + encode(text), cut to its first max_len ids: one (L_i,) int64 array each,
    1 <= L_i <= max_len."""
    if max_len < 1:
        raise ValueError(f"max_len must be positive, got {max_len}")
    return [np.array([cls_id, *encode(text)[:max_len - 1]], dtype=np.int64) for text in texts]


def pad_examples(examples: Sequence[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Examples of lengths L_i as one batch padded to the longest: (ids (B, L) int64, keep (B, L) bool),
    keep True at the real tokens and ids pad_id elsewhere."""
    longest = max(len(e) for e in examples)
    ids = np.full((len(examples), longest), pad_id, dtype=np.int64)  # (B, L)
    keep = np.zeros((len(examples), longest), dtype=bool)  # (B, L)
    for i, example in enumerate(examples):
        ids[i, :len(example)] = example
        keep[i, :len(example)] = True
    return ids, keep


def _label_batch(labels: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Labels of a batch as the heads take them: (B,) int64 classes or float32 targets."""
    dtype = np.int64 if np.issubdtype(labels.dtype, np.integer) else np.float32
    return labels[index].astype(dtype)


class ExampleLoader:
    """Shuffled fine-tuning batches for one rank; `state_dict()` is the global position only.

    Global position p reads example sample_order(seed, p // N, N)[p % N] (a fresh permutation each epoch).
    Each `next_batch()` is one optimizer step: its batch_size positions are cut into `world` contiguous
    equal chunks (`rank_slice`), this rank's chunk into micro-batches, so the union over ranks is the same
    examples in the same order at any world size.
    """

    def __init__(
        self, examples: Sequence[np.ndarray], labels: np.ndarray, seed: int, rank: int, world: int,
        batch_size: int, micro_batch_size: int, pad_id: int,
    ) -> None:
        if batch_size % (world * micro_batch_size):
            raise ValueError(
                f"train.batch_size: {batch_size} is not a multiple of train.micro_batch_size "
                f"({micro_batch_size}) x world size ({world})"
            )
        if not examples or len(examples) != len(labels):
            raise ValueError(f"need one label per example and at least one example, got {len(examples)} examples "
                             f"and {len(labels)} labels")
        self.examples, self.labels = list(examples), np.asarray(labels)
        self.seed, self.rank, self.world = seed, rank, world
        self.batch_size, self.micro_batch_size, self.pad_id = batch_size, micro_batch_size, pad_id
        self.position = 0
        self._orders: dict[int, np.ndarray] = {}  # the epochs' permutations in use, at most two
        self.step_tokens = 0
        """Token positions the last step read over every rank, padding included (throughput, `tokens` in the
        metrics): each micro-batch is as long as its longest example, not data.seq_len"""

    @property
    def num_examples(self) -> int:
        return len(self.examples)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def example_ids(self, positions: range) -> np.ndarray:
        """The examples read at consecutive global positions, (n,) int64."""
        n = self.num_examples
        ids = np.empty(len(positions), dtype=np.int64)
        for i, p in enumerate(positions):
            epoch = p // n
            if epoch not in self._orders:
                self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
                self._orders[epoch] = sample_order(self.seed, epoch, n)
            ids[i] = self._orders[epoch][p % n]
        return ids

    def next_batch(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """This rank's micro-batches of one optimizer step, each (ids (B, L) int64, labels (B,) int64 or
        float32, keep (B, L) bool), L the longest example of the micro-batch."""
        per_rank = [self.example_ids(rank_slice(self.position, self.batch_size, r, self.world))
                    for r in range(self.world)]
        ids = per_rank[self.rank]
        self.step_tokens = sum(self._padded_tokens(one) for one in per_rank)  # every rank has every example's length
        self.position += self.batch_size
        batches = []
        for start in range(0, len(ids), self.micro_batch_size):
            chunk = ids[start:start + self.micro_batch_size]
            tokens, keep = pad_examples([self.examples[i] for i in chunk.tolist()], self.pad_id)
            batches.append((tokens, _label_batch(self.labels, chunk), keep))
        return batches

    def _padded_tokens(self, ids: np.ndarray) -> int:
        """Token positions of one rank's micro-batches of the examples `ids`, each padded to its longest."""
        chunks = [ids[start:start + self.micro_batch_size] for start in range(0, len(ids), self.micro_batch_size)]
        return sum(len(chunk) * max(len(self.examples[i]) for i in chunk.tolist()) for chunk in chunks)


def example_batches(
    examples: Sequence[np.ndarray], labels: np.ndarray, micro_batch_size: int, rank: int, world: int, pad_id: int,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Every example once, in order, over the ranks: (ids (B, L) int64, labels (B,) int64 or float32,
    keep (B, L) bool, weight (B,) float32), B = micro_batch_size.

    Batch b holds examples [b * B, (b + 1) * B); rank r takes batches r, r + world, ... Every rank yields
    ceil(ceil(N / B) / world) batches, so ranks that sum their metrics with a collective stay in step:
    the rows past the last example repeat example 0 with weight 0 (a real example, so that mean pooling
    never divides by zero), the others weigh 1. Sums weighted by `weight` count each example once.
    """
    n = len(examples)
    if n == 0 or len(labels) != n:
        raise DataError(f"no examples to evaluate (got {n} examples and {len(labels)} labels)")
    labels = np.asarray(labels)
    num_batches = -(-n // micro_batch_size)
    per_rank = -(-num_batches // world)
    starts = [(rank + i * world) * micro_batch_size for i in range(per_rank)]

    def batch(start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        index = np.arange(start, start + micro_batch_size)  # (B,)
        real = index < n
        index = np.where(real, index, 0)
        tokens, keep = pad_examples([examples[i] for i in index.tolist()], pad_id)
        return tokens, _label_batch(labels, index), keep, real.astype(np.float32)

    return (batch(start) for start in starts)
