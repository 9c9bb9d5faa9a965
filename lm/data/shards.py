"""The on-disk format of prepared data: token shard files plus one manifest.json per data directory.

A shard `<split>_<index:05d>.bin` is a 32-byte little-endian header followed by a flat token array:

    offset  size  field
    0       8     magic b"LMTOKENS"
    8       4     format version (uint32, = 1)
    12      4     bytes per token (uint32: 2 -> uint16, 4 -> uint32)
    16      8     token count (uint64)
    24      8     reserved, zero

Files are written under a temporary name and renamed (`lm.io`), so a reader never sees half a shard. The manifest lists
each shard's token count (checked against the file size whenever data is opened) and the sha256 of the
whole file (checked on request: `data.verify_hashes`, `python -m lm.prepare --verify`).
"""

import hashlib
import json
import os
import re
import struct
from pathlib import Path

import numpy as np

from lm.errors import DataError
from lm.io import atomic_path, atomic_write_text, commit, sha256_file, temp_sibling
from lm.tokenizer import TOKENIZERS, canonical_identity, check_vocab_size, is_tokenizer_file, tokenizer_identity

__all__ = [
    "FORMAT_VERSION", "HEADER_BYTES", "MANIFEST_NAME", "ShardWriter", "check_manifest", "check_token_ids",
    "document_eot", "dtype_for_vocab", "is_prepared_file", "manifest_tokenizer", "new_manifest", "open_shard",
    "read_header", "read_manifest", "shard_name", "verify_hashes", "write_manifest", "write_shard",
]

MAGIC = b"LMTOKENS"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQ8x")
HEADER_BYTES = _HEADER.size  # 32
MANIFEST_NAME = "manifest.json"
_DTYPES = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}
_PREPARE_HINT = "run `python -m lm.prepare` first"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest token dtype that holds every id: uint16 up to 65,536 ids, else uint32."""
    return _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]


def shard_name(split: str, index: int) -> str:
    """File name of shard `index` of `split`, e.g. train_00003.bin."""
    return f"{split}_{index:05d}.bin"


def is_prepared_file(name: str) -> bool:
    """Whether `name` is a file lm.prepare writes into a data directory: manifest.json or a shard."""
    return name == MANIFEST_NAME or re.fullmatch(r"(train|val)_\d{5,}\.bin", name) is not None  # past 99,999 too


def _header(count: int, dtype: np.dtype) -> bytes:
    if dtype not in _DTYPES.values():
        raise ValueError(f"shard tokens must be uint16 or uint32, got {dtype}")
    return _HEADER.pack(MAGIC, FORMAT_VERSION, dtype.itemsize, count)


def write_shard(path: str | Path, tokens: np.ndarray) -> None:
    """Write `tokens` (n,) uint16|uint32, n >= 1, as one shard file, atomically."""
    path = Path(path)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"{path}: a shard holds a non-empty 1-D token array, got shape {tokens.shape}")
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(_header(tokens.size, tokens.dtype))
        f.write(np.ascontiguousarray(tokens).astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes())


class ShardWriter:
    """Streams token arrays of any length into shards of exactly `shard_tokens` tokens (the last one
    shorter), so memory stays bounded by the caller's chunks whatever the shard size. `state` and `restore`
    let a killed writer go on where its state was taken."""

    def __init__(self, data_dir: str | Path, split: str, shard_tokens: int, dtype: np.dtype) -> None:
        if shard_tokens <= 0:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        self.data_dir = Path(data_dir)
        self.split = split
        self.shard_tokens = shard_tokens
        self.dtype = np.dtype(dtype)
        self.shards: list[dict] = []  # [{"file": name, "tokens": n, "sha256": hex}] of finished shards
        self._file = None
        self._tmp = Path()  # the open shard's temporary file, renamed when it is full
        self._count = 0  # tokens in the open shard

    def add(self, tokens: np.ndarray) -> None:
        """Append `tokens` (n,) of the writer's dtype, cutting shards where they fill up."""
        if tokens.dtype != self.dtype:
            # a silent cast could wrap ids around, so the caller must produce the right dtype
            raise ValueError(f"expected {self.dtype} tokens, got {tokens.dtype}")
        start = 0
        while start < tokens.size:
            if self._file is None:
                self._tmp = temp_sibling(self.data_dir / shard_name(self.split, len(self.shards)))
                self._file = open(self._tmp, "wb")
                self._file.write(bytes(HEADER_BYTES))  # placeholder until the count is known
            take = min(tokens.size - start, self.shard_tokens - self._count)
            self._file.write(tokens[start:start + take].astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
            self._count += take
            start += take
            if self._count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        name = shard_name(self.split, len(self.shards))
        self._file.seek(0)
        self._file.write(_header(self._count, self.dtype))
        self._file.close()
        # read back from the page cache (~0.8 s per GiB), far cheaper than the tokenizing that made it
        digest = sha256_file(self._tmp)
        commit(self._tmp, self.data_dir / name)
        self.shards.append({"file": name, "tokens": self._count, "sha256": digest})
        self._file, self._count = None, 0

    def close(self) -> list[dict]:
        """Finish the last, partial shard; returns [{"file", "tokens", "sha256"}] for every shard written."""
        if self._file is not None:
            self._finish()
        return self.shards

    def state(self) -> dict:
        """What `restore` needs to go on from here, as JSON: the finished shards, and the open shard's
        temporary file, token count and the sha256 of its tokens so far (flushed to the OS first, so they
        outlive the process however it ends)."""
        open_shard = None
        if self._file is not None:
            self._file.flush()
            open_shard = {"file": self._tmp.name, "tokens": self._count, "sha256": _sha256_tokens(self._tmp)}
        return {"shards": [dict(s) for s in self.shards], "open": open_shard}

    @classmethod
    def restore(cls, data_dir: str | Path, split: str, shard_tokens: int, dtype: np.dtype,
                state: dict) -> "ShardWriter":
        """A writer that goes on from `state` (`ShardWriter.state`), taken by a writer on `data_dir` that may
        have been killed since: the finished shards are checked against their sha256, and the open shard is
        cut back to the tokens it held then and checked too (found under its shard name if it was finished
        after the state was taken). Raises DataError naming the first file that does not match."""
        writer = cls(data_dir, split, shard_tokens, dtype)
        for entry in state["shards"]:
            path = writer.data_dir / entry["file"]
            if not path.is_file() or read_header(path) != (writer.dtype, entry["tokens"]):
                raise DataError(f"{path}: missing, or not the {entry['tokens']} {writer.dtype} tokens recorded")
            if sha256_file(path) != entry["sha256"]:
                raise DataError(f"{path}: sha256 differs from the one recorded when it was finished")
            writer.shards.append(dict(entry))
        if state["open"] is not None:
            path, tokens = writer.data_dir / state["open"]["file"], state["open"]["tokens"]
            finished = writer.data_dir / shard_name(split, len(writer.shards))
            if not path.is_file() and finished.is_file():
                os.replace(finished, path)
            size = HEADER_BYTES + tokens * writer.dtype.itemsize
            if not path.is_file() or path.stat().st_size < size:
                raise DataError(f"{path}: missing, or shorter than the {tokens} tokens recorded")
            os.truncate(path, size)  # what was written after the state was taken is written again
            if _sha256_tokens(path) != state["open"]["sha256"]:
                raise DataError(f"{path}: sha256 of its first {tokens} tokens differs from the one recorded")
            writer._tmp, writer._count = path, tokens
            writer._file = open(path, "r+b")
            writer._file.write(bytes(HEADER_BYTES))  # a shard finished after the state was taken has its header
            writer._file.seek(size)
        return writer


def _sha256_tokens(path: Path) -> str:
    """Hex sha256 of a shard file's bytes after its header."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_header(path: str | Path) -> tuple[np.dtype, int]:
    """Validate a shard's header against its file length; returns (dtype, token count)."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte shard header")
    with open(path, "rb") as f:
        magic, version, itemsize, count = _HEADER.unpack(f.read(HEADER_BYTES))
    if magic != MAGIC:
        raise DataError(f"{path}: not a token shard: magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise DataError(f"{path}: shard format version {version}, expected {FORMAT_VERSION}")
    if itemsize not in _DTYPES:
        raise DataError(f"{path}: {itemsize} bytes per token, expected 2 (uint16) or 4 (uint32)")
    if count == 0:
        raise DataError(f"{path}: header says 0 tokens; shards are never empty")
    expected = HEADER_BYTES + count * itemsize
    if size != expected:
        raise DataError(
            f"{path}: file is {size} bytes, but its header ({count} tokens x {itemsize} bytes) "
            f"implies {expected}; the file is truncated or was overwritten"
        )
    return _DTYPES[itemsize], count


def open_shard(path: str | Path) -> np.memmap:
    """Map a validated shard read-only; returns its tokens (count,) as uint16|uint32."""
    dtype, count = read_header(path)
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", offset=HEADER_BYTES, shape=(count,))


def new_manifest(
    tokenizer: str, vocab_size: int, eot_id: int, source: str, content_hash: str, splits: dict[str, dict],
    tokenizer_hash: str | None = None, bos_id: int | None = None,
) -> dict:
    """The manifest.json contents; `splits` maps train/val to {"documents", "tokens", "shards"}.
    `document_boundaries: "eot"` records that every document is followed by the end-of-text token and that
    the token occurs nowhere else (text is encoded as ordinary text), so a window's document boundaries are
    where it holds that token (data.document_mask). `tokenizer_hash` (`lm.tokenizer.tokenizer_hash`), given
    for a tokenizer.json (a tiktoken name fixes its ids), tells which tokenizer made the shards wherever its
    file lives; `bos_id`, given when the tokenizer has one, starts every document."""
    manifest = {
        "format_version": FORMAT_VERSION, "tokenizer": tokenizer, "vocab_size": vocab_size,
        "dtype": dtype_for_vocab(vocab_size).name, "eot_id": eot_id, "document_boundaries": "eot",
        "source": source, "content_hash": content_hash, "splits": splits,
    }
    if tokenizer_hash is not None:
        manifest["tokenizer_hash"] = tokenizer_hash
    if bos_id is not None:
        manifest["bos_id"] = bos_id
    return manifest


def write_manifest(data_dir: str | Path, manifest: dict) -> None:
    """Write manifest.json atomically."""
    atomic_write_text(Path(data_dir) / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")


def check_token_ids(tokens: np.ndarray, vocab_size: int, origin: str | Path, start: int = 0) -> None:
    """DataError naming `origin` and the position of the first id in `tokens` (read from `origin` at
    token offset `start`) that is not below `vocab_size`: such an id would index past the embedding, so a
    shard damaged after it was prepared stops with its name instead of an index error inside the model."""
    bad = np.flatnonzero(np.asarray(tokens) >= vocab_size)
    if bad.size:
        at = int(bad[0])
        raise DataError(
            f"{origin}: token {int(tokens[at])} at position {start + at:,} is not below the vocabulary size "
            f"{vocab_size} (the file changed since it was prepared); check it with `python -m lm.prepare "
            "--verify` and prepare it again with --force"
        )


def read_manifest(data_dir: str | Path, key: str = "data.dir") -> dict:
    """Load manifest.json and check that every shard it lists exists with the token count it lists; a missing
    directory is named by the config `key` that gave it."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{key}: no directory {str(data_dir)!r}; {_PREPARE_HINT}")
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{path}: no manifest, so {data_dir} holds no prepared data; {_PREPARE_HINT}")
    try:
        manifest = json.loads(path.read_text())
        version = manifest["format_version"]
        listed = [(e["file"], e["tokens"]) for split in ("train", "val") for e in manifest["splits"][split]["shards"]]
        dtype = np.dtype(manifest["dtype"])
        if not all(isinstance(name, str) and type(tokens) is int for name, tokens in listed):
            raise TypeError("each shard's file must be a string and its tokens an integer")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise DataError(f"{path}: unreadable manifest ({type(err).__name__}: {err}); {_PREPARE_HINT}") from None
    if version != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {version}, expected {FORMAT_VERSION}; {_PREPARE_HINT}")
    for split in ("train", "val"):  # a hand edit that lists another split's shard, one twice, or a file elsewhere
        for i, entry in enumerate(manifest["splits"][split]["shards"]):
            if entry["file"] != shard_name(split, i):
                raise DataError(f"{path}: splits.{split}.shards[{i}] is {entry['file']!r}, where lm.prepare lists "
                                f"{shard_name(split, i)!r}; {_PREPARE_HINT} with --force")
    for name, tokens in listed:
        shard = data_dir / name
        if not shard.is_file():
            raise DataError(f"{shard}: listed in {path} but missing; {_PREPARE_HINT} with --force")
        shard_dtype, count = read_header(shard)
        if count != tokens or shard_dtype != dtype:
            raise DataError(
                f"{shard}: holds {count} {shard_dtype} tokens, but {path} lists {tokens} {dtype}; "
                f"{_PREPARE_HINT} with --force"
            )
    for split in ("train", "val"):  # a shard's entry deleted by hand leaves the split's total behind
        entry = manifest["splits"][split]
        total, in_shards = entry.get("tokens"), sum(shard["tokens"] for shard in entry["shards"])
        if total is not None and total != in_shards:
            raise DataError(f"{path}: splits.{split}.tokens is {total!r}, but its shards list {in_shards} tokens "
                            f"(a shard's entry removed or edited); {_PREPARE_HINT} with --force")
    return manifest


def verify_hashes(data_dir: str | Path, manifest: dict) -> None:
    """Check every shard listed in `manifest` against its sha256 (after `read_manifest` checked sizes):
    catches flipped bytes that leave the size alone. Raises DataError naming the first bad shard."""
    data_dir = Path(data_dir)
    for split in ("train", "val"):
        for entry in manifest["splits"][split]["shards"]:
            shard = data_dir / entry["file"]
            if "sha256" not in entry:
                raise DataError(f"{data_dir / MANIFEST_NAME}: no sha256 for {entry['file']} (prepared before shards "
                                f"had checksums); {_PREPARE_HINT} with --force to add them")
            if sha256_file(shard) != entry["sha256"]:
                raise DataError(f"{shard}: sha256 differs from {MANIFEST_NAME} (the file changed or is corrupt "
                                f"since it was prepared); {_PREPARE_HINT} with --force")


def document_eot(manifest: dict, data_dir: str | Path) -> int:
    """The token that separates documents in `data_dir`'s shards; DataError if its manifest does not say
    (prepared by an lm from before boundaries were recorded)."""
    if manifest.get("document_boundaries") != "eot":
        raise DataError(
            f"{Path(data_dir) / MANIFEST_NAME}: records no document boundaries (prepared by an older lm), which "
            "data.document_mask needs; run the same `python -m lm.prepare` command again to rebuild it"
        )
    eot = manifest.get("eot_id")
    if type(eot) is not int:
        raise DataError(f"{Path(data_dir) / MANIFEST_NAME}: eot_id is {eot!r}, not a token id (an integer); "
                        f"{_PREPARE_HINT} with --force")
    return eot


def manifest_tokenizer(manifest: dict) -> str | None:
    """What identifies the tokenizer that made a directory's shards: a tiktoken encoding's name (which fixes its
    ids; manifests from before hashes were recorded hold only such names), or a tokenizer.json's recorded
    `tokenizer_hash` (None if it is missing): `lm.tokenizer.tokenizer_identity` of the tokenizer that made them."""
    name = manifest["tokenizer"]
    if not is_tokenizer_file(name):
        return name
    recorded = manifest.get("tokenizer_hash")
    return None if recorded is None else canonical_identity(recorded)


def _described(name: str, identity: str | None) -> str:
    if not is_tokenizer_file(name):
        return repr(name)
    return f"{name!r} (lm's export of {identity})" if identity in TOKENIZERS else \
        f"{name!r} (tokenizer hash {str(identity)[:12]})"


def check_manifest(manifest: dict, tokenizer: str, vocab_size: int, data_dir: str | Path) -> None:
    """Fail if prepared data was tokenized differently from what the job config expects: by another tokenizer
    (`manifest_tokenizer`; a tokenizer.json named by `tokenizer` is read to hash it), or with ids the model
    cannot hold (a tiktoken encoding's size must equal model.vocab_size; a tokenizer.json's fit within it)."""
    found = manifest_tokenizer(manifest)
    expected = tokenizer_identity(tokenizer)
    if found != expected:
        name = manifest["tokenizer"]
        raise DataError(
            f"{data_dir}: prepared with tokenizer {_described(name, found)}, but "
            f"data.tokenizer={_described(tokenizer, expected)}, which makes other ids; prepare again with "
            f"`python -m lm.prepare` and this data.tokenizer (into another data.dir to keep these shards), or set "
            f"data.tokenizer to the one the shards were prepared with"
        )
    if is_tokenizer_file(tokenizer):
        check_vocab_size(tokenizer, manifest["vocab_size"], vocab_size)
    elif manifest["vocab_size"] != vocab_size:
        raise DataError(
            f"{data_dir}: prepared with vocab_size {manifest['vocab_size']}, but model.vocab_size={vocab_size}"
        )
