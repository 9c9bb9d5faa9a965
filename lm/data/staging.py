"""Where `lm.prepare` builds a data directory: `<data.dir>.partial`, taken by one prepare at a time and kept
when it is killed, so that the next run of the same preparation goes on from its finished shards.

Whenever a batch of documents finishes a shard, the prepare saves its progress (`progress.json`, written
atomically): the content hash of the preparation, the position in the input after that batch, the documents
each split holds, and each split writer's state (its finished shards with their sha256, and its open
shard's length and sha256). A rerun with the same content hash checks those files against the hashes, cuts
each open shard back to its recorded length, and reads on from the position without tokenizing what the
finished shards hold: the shards come out byte for byte as an uninterrupted run writes them. Anything that
does not match (another input or setting, a damaged file) starts the directory over.

The lock is an OS lock (`fcntl.flock`) on `.lock` inside the directory: the kernel drops it however the
holder dies, so a killed prepare never blocks the next one, while two at once on one data.dir stop with an
error instead of writing each other's shards.
"""

import fcntl
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lm.data.shards import ShardWriter
from lm.errors import DataError
from lm.io import atomic_write_text, publish_dir

__all__ = ["PARTIAL_SUFFIX", "Progress", "Staging"]

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
_PROGRESS = "progress.json"
_LOCK = ".lock"
_PROGRESS_VERSION = 1


@dataclass
class Progress:
    """How far a prepare has come: the input position after its last written batch, as (part, pieces of
    that part) (`lm.data.corpora.Corpus.part_pieces`), and the documents each split holds."""

    position: tuple[int, int] = (0, 0)
    documents: dict[str, int] = field(default_factory=dict)


class Staging:
    """`<out>.partial` for the life of a `with` block: locked, and resumable when it holds the progress of
    a preparation with `content_hash`."""

    def __init__(self, out: Path, content_hash: str) -> None:
        self.dir = out.with_name(out.name + PARTIAL_SUFFIX)
        self.content_hash = content_hash
        self._lock = None
        self._made: list[Path] = []  # the missing directories above it that entering made, deepest first

    def __enter__(self) -> "Staging":
        self._made = [parent for parent in self.dir.parents if not parent.exists()]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            handle = open(self.dir / _LOCK, "a")
        except OSError as err:
            raise DataError(f"data.dir: cannot write {self.dir}: {err.strerror or err}") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise DataError(f"data.dir: another lm.prepare is writing {self.dir}; wait for it to end, or prepare "
                            "into another data.dir") from None
        self._lock = handle
        return self

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.close()  # closing drops the flock
            self._lock = None

    def start(self, splits: tuple[str, ...], shard_tokens: int, dtype: np.dtype) -> tuple[Progress,
                                                                                           dict[str, ShardWriter]]:
        """The progress and split writers to go on from: those an unfinished prepare of the same content
        saved, once its files check out; else a fresh start in an emptied directory."""
        saved = self._read_progress()
        if saved is not None:
            try:
                writers = {split: ShardWriter.restore(self.dir, split, shard_tokens, dtype, saved["writers"][split])
                           for split in splits}
                progress = Progress(tuple(saved["position"]), {s: int(saved["documents"][s]) for s in splits})
            except (DataError, KeyError, TypeError, ValueError) as err:
                log.info("starting %s over: its saved progress does not match its files (%s)", self.dir, err)
            else:
                self._clear(keep={_PROGRESS, *(name for state in saved["writers"].values() for name in _files(state))})
                kept = sum(len(w.shards) for w in writers.values())
                tokens = sum(s["tokens"] for w in writers.values() for s in w.shards)
                log.info("resuming %s: %d finished shards (%d tokens) kept, %d documents done", self.dir, kept,
                         tokens, sum(progress.documents.values()))
                return progress, writers
        self._clear()
        return Progress(documents=dict.fromkeys(splits, 0)), {
            split: ShardWriter(self.dir, split, shard_tokens, dtype) for split in splits}

    def save(self, progress: Progress, writers: dict[str, ShardWriter]) -> None:
        """Record `progress` and the writers' states, atomically, for a rerun to go on from."""
        record = {"version": _PROGRESS_VERSION, "content_hash": self.content_hash,
                  "position": list(progress.position), "documents": progress.documents,
                  "writers": {split: writer.state() for split, writer in writers.items()}}
        atomic_write_text(self.dir / _PROGRESS, json.dumps(record) + "\n")

    def publish(self, out: Path) -> None:
        """Put the finished directory in place of `out` (see `lm.io.publish_dir`), without the lock and the
        progress, which belong to an unfinished one."""
        (self.dir / _PROGRESS).unlink(missing_ok=True)
        (self.dir / _LOCK).unlink(missing_ok=True)  # still held through our handle until the block ends
        publish_dir(self.dir, out)

    def discard(self) -> None:
        """Delete the directory, and the directories above it that entering made, if still empty: what it holds
        came from input that turned out bad, and a failed prepare leaves nothing behind."""
        shutil.rmtree(self.dir, ignore_errors=True)
        for parent in self._made:
            try:
                parent.rmdir()
            except OSError:  # something else was put there meanwhile
                return

    def _read_progress(self) -> dict | None:
        path = self.dir / _PROGRESS
        if not path.is_file():
            return None
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            log.info("starting %s over: unreadable %s (%s)", self.dir, _PROGRESS, err)
            return None
        if not isinstance(saved, dict) or (saved.get("version"), saved.get("content_hash")) != (
                _PROGRESS_VERSION, self.content_hash):
            log.info("starting %s over: it holds another input or settings", self.dir)
            return None
        return saved

    def _clear(self, keep: set[str] = frozenset()) -> None:
        """Empty the directory, all but the lock we hold and the files `keep` names (a killed writer may have
        begun files after it last saved its progress)."""
        for path in self.dir.iterdir():
            if path.name == _LOCK or path.name in keep:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def _files(state: dict) -> list[str]:
    """The files a writer's saved state names: its finished shards and its open one."""
    return [entry["file"] for entry in state["shards"]] + ([state["open"]["file"]] if state["open"] else [])
