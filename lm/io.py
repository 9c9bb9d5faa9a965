"""File rules every layer shares: streamed sha256, writes that appear whole or not at all, UTF-8 text.

A file is written beside its destination under a temporary name and renamed over it once complete
(`atomic_path`), so a crash never leaves half a file where a good one was. A directory is built under
a temporary name and renamed into place (`publish_dir`); one it replaces waits under `<name>.replaced`
until the new one is in place, so at every moment one complete copy exists.
"""

import codecs
import contextlib
import hashlib
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from lm.errors import DataError

REPLACED_SUFFIX = ".replaced"
"""What `publish_dir` appends to the name of the directory it is replacing, until the new one is in place."""

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks so memory stays flat for multi-GB files.

    It runs at ~1,300 MiB/s on one core of the development machine (AMD EPYC with SHA-NI, file in page
    cache; slower when it must come from disk), ~0.8 s per GiB.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def physical_memory() -> int:
    """Bytes of this machine's memory (RAM), which a CPU process's tensors must fit in."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def file_above(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` if it is a file, so that nothing can be made below it; else None."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def output_dir_problem(path: Path, sibling: bool = False) -> str | None:
    """Why a tool may not make or fill the directory `path`, or None when it may: a name too long, a file there or
    above it, or a directory it may not write in (`sibling`: the tool builds it beside itself under a temporary
    name first, as lm.export and lm.prepare do, so the directory above must be writable even when it exists)."""
    if problem := _name_problem(path, sibling):
        return problem
    if path.exists() and not path.is_dir():
        return f"{path}: is a file; name a directory"
    if (above := file_above(path)) is not None:
        return f"{path}: {above} is a file, not a directory"
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        return f"{path}: cannot write in it (permission denied)"
    return _access_problem(path) if sibling or not path.is_dir() else None


def output_file_problem(path: Path, inputs: Sequence[Path] = ()) -> str | None:
    """Why a tool may not write the file `path`, or None when it may: asked before any work, so a bad output
    path costs nothing. Refused: a name too long, a directory, a path below a file (missing parent directories
    are made, as `atomic_path` makes them), one of the `inputs` or a path inside one that is a directory, and a
    path in a directory this process may not write in."""
    if problem := _name_problem(path, sibling=True):
        return problem
    if path.is_dir():
        return f"{path}: is a directory; name the file to write"
    if (above := file_above(path)) is not None:
        return f"{path}: {above} is a file, not a directory"
    for source in inputs:
        if source.is_dir() and source.resolve() in path.resolve().parents:
            return f"{path}: is inside the input {source}; write the output elsewhere"
        if path.exists() and source.exists() and path.resolve() == source.resolve():
            return f"{path}: is the input {source}; write the output to another file"
    return _access_problem(path)


def _made_below(path: Path) -> tuple[Path, tuple[str, ...]]:
    """The nearest existing directory above `path` and the names below it that writing `path` makes (the
    directories, then the name written); a name too long to look up counts as missing."""
    absolute = Path(os.path.abspath(path))  # "x/.." is x's directory: its own name is the one written
    for parent in absolute.parents:
        with contextlib.suppress(OSError):  # ENAMETOOLONG: stat refuses to look
            if parent.exists():
                return parent, absolute.relative_to(parent).parts
    return Path(absolute.anchor), absolute.relative_to(absolute.anchor).parts


def _name_problem(path: Path, sibling: bool) -> str | None:
    """A name that writing `path` would make but its filesystem refuses as too long; with `sibling`, the last one
    with room for `temp_sibling`'s suffix, as lm writes a file (and builds some directories) under a temporary name
    first. Asked first (stat itself fails on such a name), and before any work: at the end it fails as an OSError
    naming the temporary file."""
    if not os.path.basename(os.path.abspath(path)):
        return f"{path}: is the root directory; name a file or directory below it"
    ancestor, names = _made_below(path)
    try:
        limit = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for i, name in enumerate(names):
        extra = _SIBLING_EXTRA if sibling and i == len(names) - 1 else 0
        if (size := len(os.fsencode(name))) + extra > limit:
            shown = name if len(name) <= 24 else name[:24] + "..."
            first = f", and lm writes it first under a name {extra} bytes longer" if extra else ""
            return f"{path}: the name {shown!r} is {size} bytes; its filesystem takes names of at most {limit}{first}"
    return None


def _access_problem(path: Path) -> str | None:
    """The directory above `path` where writing it creates something, if this process may not write in it."""
    ancestor, _ = _made_below(path)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{path}: cannot write in {ancestor} (permission denied)"
    return None


@contextlib.contextmanager
def held_output() -> Iterator[None]:
    """Hold everything the process writes to stdout and stderr during the block, at the file-descriptor level
    (prints, logging handlers, C code and compilers run as subprocesses alike), and write it out once the block
    ends without an exception; drop it when the block raises, so the caller's one error line stays the last.

    For libraries that talk at import and setup (DeepSpeed's accelerator notice and op-build lines): what they
    say still shows when they succeed, only later.
    """
    streams = [(sys.stdout, 1), (sys.stderr, 2)]
    saved = []
    for stream, fd in streams:
        stream.flush()
        hold = tempfile.TemporaryFile()
        saved.append((fd, os.dup(fd), hold))
        os.dup2(hold.fileno(), fd)
    ok = False
    try:
        yield
        ok = True
    finally:
        for stream, _ in streams:
            stream.flush()
        for fd, original, hold in saved:
            os.dup2(original, fd)
            os.close(original)
            if ok:
                hold.seek(0)
                with os.fdopen(os.dup(fd), "wb") as out:
                    shutil.copyfileobj(hold, out)
            hold.close()


def temp_sibling(path: str | Path) -> Path:
    """A fresh hidden name beside `path` (same filesystem, so a rename onto `path` is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


_SIBLING_EXTRA = len(temp_sibling("x").name) - 1
"""Bytes `temp_sibling` adds to a name: the longest suffix lm puts on an output while it writes it."""


def commit(tmp: Path, path: str | Path) -> None:
    """Give the finished file `tmp` ordinary permissions and rename it over `path`.

    Some writers (safetensors, mkstemp) create private 0600 files; what we publish reads like any other
    file the user makes (0666 less the umask).
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write `path`'s content to; it replaces `path` when the block ends
    without an exception, and is deleted otherwise. Parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        yield tmp
        commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` (UTF-8) whole or not at all."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def publish_dir(staging: Path, final: Path) -> None:
    """Rename the complete directory `staging` to `final`. An existing `final` is moved aside to
    `<final>.replaced` first and deleted only once the new one is in place."""
    if not final.exists():
        staging.rename(final)
        return
    aside = final.with_name(final.name + REPLACED_SUFFIX)
    shutil.rmtree(aside, ignore_errors=True)  # left by a publish killed before its last step
    final.rename(aside)
    staging.rename(final)
    shutil.rmtree(aside)


def restore_replaced_dir(final: Path) -> bool:
    """Put back `<final>.replaced` where a kill between `publish_dir`'s two renames left no `final`; True if it did."""
    aside = final.with_name(final.name + REPLACED_SUFFIX)
    if final.exists() or not aside.is_dir():
        return False
    aside.rename(final)
    return True


def merge_dir(staging: Path, final: Path) -> None:
    """Move every file of `staging` into `final`, each replacing its namesake atomically, then remove
    `staging`; files of `final` that `staging` does not hold stay. A missing `final` appears whole."""
    if not final.exists():
        staging.rename(final)
        return
    for path in sorted(staging.iterdir()):
        os.replace(path, final / path.name)
    staging.rmdir()


UTF8_BOM = codecs.BOM_UTF8  # a byte-order mark some editors write first; no part of the text


def decode_utf8(data: bytes, origin: str | Path) -> str:
    """`data` decoded as UTF-8, without a leading byte-order mark; DataError naming `origin` and the first
    bad byte otherwise."""
    start = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(origin, err, start) from None


def read_utf8(path: str | Path) -> str:
    """The text of a UTF-8 file; DataError naming the file when it cannot be read or decoded."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror or err}") from None
    return decode_utf8(data, path)


def read_utf8_chunks(path: str | Path, chunk_bytes: int) -> Iterator[str]:
    """The text of a UTF-8 file as consecutive non-empty strings decoded from about `chunk_bytes` bytes
    each, so a file larger than memory can be read, without a leading byte-order mark; DataError as
    `read_utf8` gives, with the bad byte's offset in the file."""
    try:
        f = open(path, "rb")
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror or err}") from None
    with f:
        offset = 0  # of data[0] in the file
        pending = b""  # the start of a character the last chunk cut in two
        while True:
            try:
                chunk = f.read(chunk_bytes)
            except OSError as err:
                raise DataError(f"{path}: cannot read: {err.strerror or err}") from None
            data = pending + chunk
            if offset == 0 and data.startswith(UTF8_BOM):
                data, offset = data[len(UTF8_BOM):], len(UTF8_BOM)
            try:
                text, used = codecs.utf_8_decode(data, "strict", not chunk)
            except UnicodeDecodeError as err:
                raise _not_utf8(path, err, offset) from None
            if text:
                yield text
            if not chunk:
                return
            pending, offset = data[used:], offset + used


def _not_utf8(origin: str | Path, err: UnicodeDecodeError, offset: int) -> DataError:
    """The one message for undecodable bytes; `offset` is where `err.object` starts in `origin`."""
    return DataError(
        f"{origin}: not UTF-8: byte 0x{err.object[err.start]:02x} at offset {offset + err.start} cannot be "
        f"decoded ({err.reason}); convert the file to UTF-8"
    )
