"""Tokenize a corpus into train/val shards plus manifest.json, reusing the output when nothing changed.

Documents stream through in pieces: corpus -> batches of pieces -> tokenizer threads -> ShardWriter, so
memory stays bounded however large the corpus, a file or a document. Threads, not processes: tiktoken
releases the GIL while it encodes, so threads tokenize in parallel without copying text and tokens
between processes (a process pool, tried on the Debian mix, spent as much CPU pickling as threads and was no
faster). The output is built in a sibling directory (`lm.data.staging`) and swapped in only when
complete, so a crash or a bad input never harms shards that were already good, and a killed prepare goes on
from its finished shards when run again.

Each document is written as its tokens followed by the end-of-text (end-of-sequence) token, led by the
tokenizer's BOS when it has one (a tokenizer.json may; tiktoken's encodings do not). Pieces tokenize like the
whole document only under the GPT-2 and cl100k pre-tokenizers (`lm.data.pieces`), so for a tokenizer.json,
whose pre-tokenizer may be anything (SentencePiece's Metaspace marks only a text's first word), a document's
pieces are joined and the document encoded whole: memory then grows with the longest document, not the corpus.
"""

import collections
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from lm.data.config import DataConfig
from lm.data.corpora import Corpus, find_corpus
from lm.data.pieces import Piece
from lm.data.shards import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    dtype_for_vocab,
    is_prepared_file,
    new_manifest,
    read_manifest,
    verify_hashes,
    write_manifest,
)
from lm.data.staging import PARTIAL_SUFFIX, Staging
from lm.errors import DataError
from lm.io import REPLACED_SUFFIX, output_dir_problem, restore_replaced_dir
from lm.tokenizer import (
    HFTokenizer,
    Tokenizer,
    document_prefix,
    is_tokenizer_file,
    load_tokenizer,
    tokenizer_hash,
    tokenizer_identity,
)

__all__ = ["is_val_document", "num_threads", "output_hash", "prepare"]

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
_BATCH_PIECES = 256  # pieces per task: few enough to balance the threads and bound memory
_BATCH_CHARS = 1 << 17  # ~30k tokens, ~15 ms of one core: the last task barely delays the end


class _Batch(NamedTuple):
    """A tokenizer thread's task: pieces in input order, from document `first_document` on."""

    first_document: int
    pieces: list[Piece]
    end: tuple[int, int]
    """The input position after the last piece (see `lm.data.staging.Progress`)."""


def num_threads(num_workers: int) -> int:
    """Tokenizer threads for `data.num_workers`: itself, or 0 for one per core this process may run on."""
    if num_workers:
        return num_workers
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def smallest_val_fraction(n: int) -> float:
    """The least val_fraction of 3 significant digits that puts one of `n` documents in val: 1/n rounded up, as
    1/n rounded to nearest (0.333 of 3) would put none there."""
    exact = 1 / n
    scale = 10 ** (2 - math.floor(math.log10(exact)))
    return math.ceil(round(exact * scale, 6)) / scale


def is_val_document(index: int, val_fraction: float) -> bool:
    """Whether document `index` goes to val: evenly spaced, exactly floor(N * f) of the first N documents."""
    return math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)


def output_hash(input_hash: str, cfg: DataConfig) -> str:
    """Fingerprint of everything that changes the prepared bytes (not num_workers: order is preserved). A
    tokenizer.json counts by its `tokenizer_hash`, not its path: the same file elsewhere reuses the data, an
    edited one rebuilds it. A tiktoken encoding counts by its name, as before hashes were recorded, so data
    prepared then stays current."""
    key = {
        "input": input_hash, "tokenizer": tokenizer_identity(cfg.tokenizer), "val_fraction": cfg.val_fraction,
        "shard_tokens": cfg.shard_tokens, "format_version": FORMAT_VERSION,
    }
    if cfg.document_separator:  # absent when unset, so data prepared before the key existed stays current
        key["document_separator"] = cfg.document_separator
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def prepare(cfg: DataConfig, force: bool = False) -> dict:
    """Prepare `cfg.source` into `cfg.dir` (unless an intact, identical preparation is there) and
    return its manifest. Raises DataError for bad input before `cfg.dir` changes."""
    start_time = time.perf_counter()
    out = Path(cfg.dir)
    if out.is_symlink():  # data kept on another disk: the build replaces what the link names, and the link stays
        out = Path(os.path.realpath(out))
        log.info("data.dir %s links to %s: preparing there", cfg.dir, out)
    if out.name in ("", ".."):  # "", ".", "/", "x/..": the build goes into a sibling named after it
        raise DataError(f"data.dir: {cfg.dir!r} does not end in a directory's name; name the directory to prepare "
                        "into, e.g. data/mine")
    # before any work, unless data.dir may be an up-to-date preparation, which is only read
    unwritable = output_dir_problem(out, sibling=True)
    if unwritable is not None and not _has_manifest(out):
        raise DataError(f"data.dir: {unwritable}")
    if restore_replaced_dir(out):
        log.warning("%s: a prepare was killed while replacing it; restored the data it replaced", out)
    corpus = _outside(find_corpus(cfg.source, cfg.document_separator), out)
    if problem := corpus.unread_key(cfg.text_column, cfg.document_separator):
        raise DataError(problem)
    enc = load_tokenizer(cfg.tokenizer)
    content_hash = output_hash(corpus.content_hash(cfg.text_column), cfg)
    if not force:
        manifest = _reusable(out, content_hash, cfg.verify_hashes)
        if manifest is not None:
            log.info("%s is up to date (content hash %s); use --force to rebuild", out, content_hash[:12])
            return manifest
    if unwritable is not None:
        raise DataError(f"data.dir: {unwritable}")
    _check_replaceable(out)
    if corpus.num_documents is not None:  # fail before tokenizing when the split is known to be empty
        _check_splits(math.floor(corpus.num_documents * cfg.val_fraction), corpus.num_documents, cfg)

    with Staging(out, content_hash) as staging:
        try:
            splits, tokenized = _tokenize(corpus, cfg, staging, dtype_for_vocab(enc.n_vocab))
        except DataError:
            staging.discard()  # shards of input that turned out bad; a kill or ^C keeps them to resume
            raise
        # a tiktoken name fixes its ids, so its manifest stays as it was before hashes were recorded
        file_hash = tokenizer_hash(cfg.tokenizer) if is_tokenizer_file(cfg.tokenizer) else None
        manifest = new_manifest(cfg.tokenizer, enc.n_vocab, enc.eot_token, cfg.source, content_hash, splits,
                                file_hash, getattr(enc, "bos_token", None))
        write_manifest(staging.dir, manifest)
        staging.publish(out)  # the old preparation is deleted only once the new one is in place
    seconds = time.perf_counter() - start_time
    tokens = sum(s["tokens"] for s in splits.values())
    log.info("prepared %d tokens into %s in %.1f s (%.0f tokens/s)%s", tokens, out, seconds, tokenized / seconds,
             f", {tokenized} of them tokenized in this run" if tokenized != tokens else "")
    return manifest


def _outside(corpus: Corpus, out: Path) -> Corpus:
    """The corpus less its files inside data.dir or the directories lm.prepare builds beside it: a source glob
    that reaches into them (data/**/*.json) would read lm's own manifest as a document, and a second prepare
    would read other input than the first."""
    homes = [Path(os.path.realpath(out.with_name(out.name + suffix))) for suffix in ("", PARTIAL_SUFFIX,
                                                                                     REPLACED_SUFFIX)]
    kept = tuple(f for f in corpus.files if not any(home == f or home in f.parents for home in homes))
    if len(kept) == len(corpus.files):
        return corpus
    if not kept:
        raise DataError(f"data.source: every file it matches is inside data.dir {str(out)!r}, which lm.prepare "
                        "writes; name the input elsewhere")
    log.info("data.source: leaving out the %d file(s) it matches inside %s, which lm.prepare writes",
             len(corpus.files) - len(kept), out)
    return dataclasses.replace(corpus, files=kept, root=Path(os.path.commonpath([f.parent for f in kept])))


def _reusable(out: Path, content_hash: str, check_hashes: bool) -> dict | None:
    """The existing manifest if it describes this exact preparation and all its shards are intact (sizes
    always, sha256 with `check_hashes`); a manifest from before shards had checksums is rebuilt."""
    if not (out / MANIFEST_NAME).is_file():
        return None
    try:
        manifest = read_manifest(out)
        if manifest.get("content_hash") != content_hash:
            return None
        if "document_boundaries" not in manifest:  # an older lm's: the same shards, but no boundaries recorded
            log.info("rebuilding %s to record its document boundaries", out)
            return None
        if check_hashes or any("sha256" not in e for split in SPLITS for e in manifest["splits"][split]["shards"]):
            verify_hashes(out, manifest)
    except DataError as err:
        log.info("rebuilding: %s", err)
        return None
    return manifest


def _has_manifest(out: Path) -> bool:
    try:
        return (out / MANIFEST_NAME).is_file()
    except OSError:  # a name too long to look up
        return False


def _check_replaceable(out: Path) -> None:
    """Refuse to replace a directory that holds anything lm.prepare did not write: preparing replaces the
    directory whole, so a run directory (checkpoints) or any other file inside it would be deleted."""
    if out.exists() and not out.is_dir():
        raise DataError(f"data.dir: {str(out)!r} exists and is not a directory")
    if not out.is_dir():
        return
    if any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise DataError(
            f"data.dir: {str(out)!r} holds files but no {MANIFEST_NAME}, so lm.prepare did not make it; "
            "choose an empty or new directory"
        )
    others = sorted(p.name for p in out.iterdir() if not (p.is_file() and is_prepared_file(p.name)))
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise DataError(
            f"data.dir: {str(out)!r} holds {shown}, which lm.prepare did not write; preparing replaces the "
            "whole directory and would delete them, so move them out (a run's train.out_dir belongs elsewhere)"
        )


def _check_splits(val_docs: int, documents: int, cfg: DataConfig) -> None:
    if documents == 0:  # every document empty or blank (those are skipped), so nothing to split
        raise DataError(f"data.source={cfg.source!r} holds no documents (empty and blank ones are skipped)")
    val_fraction = cfg.val_fraction
    if val_fraction > 0 and documents < 2:
        raise DataError(f"data.val_fraction={val_fraction} needs at least 2 documents (one for val, one for training), "
                        f"but data.source holds {documents}; add documents or set it to 0 for no validation")
    if val_fraction > 0 and val_docs == 0:
        raise DataError(
            f"data.val_fraction={val_fraction} puts none of the {documents} documents in the val split; raise it "
            f"to at least {smallest_val_fraction(documents):g}, add documents, or set it to 0 for no validation"
        )
    if val_docs == documents:
        raise DataError(f"data.val_fraction={val_fraction} leaves no training documents out of {documents}")


def _tokenize(corpus: Corpus, cfg: DataConfig, staging: Staging, dtype: np.dtype) -> tuple[dict, int]:
    """Stream the corpus through the tokenizer into train/val shards in the staging directory, going on from
    its saved progress if it has some; returns the manifest's splits and the tokens tokenized in this run."""
    progress, writers = staging.start(SPLITS, cfg.shard_tokens, dtype)
    docs = progress.documents
    encode = functools.partial(_encode_batch, tokenizer=cfg.tokenizer, val_fraction=cfg.val_fraction, dtype=dtype)
    pieces = _pieces_from(corpus, cfg.text_column, progress.position)
    batches = _batches(_whole_documents(pieces) if is_tokenizer_file(cfg.tokenizer) else pieces, sum(docs.values()))
    tokenized = 0
    with tqdm(total=corpus.num_documents, initial=sum(docs.values()), unit="doc", desc="tokenizing",
              disable=None) as bar:
        for batch, ((train, val), (num_train, num_val)) in _ordered_map(encode, batches, num_threads(cfg.num_workers)):
            finished = sum(len(w.shards) for w in writers.values())
            writers["train"].add(train)
            writers["val"].add(val)
            docs["train"] += num_train
            docs["val"] += num_val
            tokenized += train.size + val.size
            bar.update(num_train + num_val)
            if sum(len(w.shards) for w in writers.values()) > finished:
                progress.position = batch.end
                staging.save(progress, writers)
    _check_splits(docs["val"], docs["train"] + docs["val"], cfg)
    splits = {}
    for split, writer in writers.items():
        shards = writer.close()
        splits[split] = {"documents": docs[split], "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    return splits, tokenized


def _pieces_from(corpus: Corpus, text_column: str, start: tuple[int, int]) -> Iterator[tuple[tuple[int, int], Piece]]:
    """The corpus's pieces from input position `start` on, each with the position after it. The parts before
    are not read at all; the first pieces of the part it falls in are read and dropped, not tokenized."""
    first_part, skip = start
    for part in range(first_part, corpus.num_parts):
        pieces = corpus.part_pieces(part, text_column)
        first = skip if part == first_part else 0
        for index, piece in enumerate(itertools.islice(pieces, first, None), start=first + 1):
            yield (part, index), piece


def _batches(pieces: Iterable[tuple[tuple[int, int], Piece]], first_document: int = 0) -> Iterator[_Batch]:
    """Group positioned pieces into tasks of bounded size."""
    batch: list[Piece] = []
    chars = 0
    start = first_document
    for position, piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if len(batch) == _BATCH_PIECES or chars >= _BATCH_CHARS:
            yield _Batch(start, batch, position)
            start += sum(p.ends_document for p in batch)
            batch, chars = [], 0
    if batch:
        yield _Batch(start, batch, position)


def _whole_documents(pieces: Iterable[tuple[tuple[int, int], Piece]]) -> Iterator[tuple[tuple[int, int], Piece]]:
    """Each document's pieces joined into one piece (see the module docstring), at its last piece's position."""
    texts: list[str] = []
    for position, (text, ends_document) in pieces:
        texts.append(text)
        if ends_document:
            yield position, Piece("".join(texts), True)
            texts = []


def _encode_batch(
    task: _Batch, tokenizer: str, val_fraction: float, dtype: np.dtype
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[int, int]]:
    """Tokenize one batch; returns ((train tokens, val tokens), (train docs, val docs)), each document's
    last piece followed by the end-of-text token and counted as its document."""
    document, pieces = task.first_document, task.pieces
    enc = load_tokenizer(tokenizer)  # cached
    eot = np.array([enc.eot_token], dtype=np.uint32)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    for (_, ends_document), tokens in zip(pieces, _encode_texts(enc, [piece.text for piece in pieces])):
        is_val = is_val_document(document, val_fraction)
        parts[is_val].append(tokens)
        if ends_document:
            parts[is_val].append(eot)
            counts[is_val] += 1
            document += 1
    tokens = tuple(np.concatenate(parts[v]).astype(dtype) if parts[v] else np.empty(0, dtype) for v in (False, True))
    return tokens, (counts[False], counts[True])


def _encode_texts(enc: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """The tokens of each text, as ordinary text: a corpus may contain the characters "<|endoftext|>" or
    "</s>", which are text, not the end of a document. A tokenizer.json's texts are whole documents, each led by
    the tokenizer's BOS if it has one, encoded in one call (`tokenizers` releases the GIL only for a batch).
    tiktoken's encode_to_numpy is encode_ordinary without a list of ints."""
    if isinstance(enc, HFTokenizer):
        prefix = document_prefix(enc)
        return [np.array(prefix + ids, dtype=np.uint32) for ids in enc.encode_ordinary_batch(texts)]
    return [enc.encode_to_numpy(text, disallowed_special=()) for text in texts]


def _ordered_map(fn: Callable, tasks: Iterator, num_workers: int) -> Iterator[tuple]:
    """(task, fn(task)) for each task in order, on `num_workers` threads, with at most 2 tasks per worker in
    flight.

    Executor.map would read the whole task iterator ahead (the corpus) into memory; submitting a bounded
    window keeps memory flat. One worker runs in the calling thread.
    """
    if num_workers == 1:
        yield from ((task, fn(task)) for task in tasks)
        return
    with ThreadPoolExecutor(num_workers, thread_name_prefix="tokenize") as pool:
        pending: collections.deque = collections.deque()
        for task in tasks:
            pending.append((task, pool.submit(fn, task)))
            if len(pending) >= 2 * num_workers:
                task, future = pending.popleft()
                yield task, future.result()
        while pending:
            task, future = pending.popleft()
            yield task, future.result()
