"""Data throughput: `prepare` on every core against a one-process `encode_ordinary` loop, and the training
loader's batches from memory-mapped shards."""

import json
import subprocess
import sys
import tempfile
import time

import numpy as np

from lm.config import JobConfig
from lm.data.loader import TokenLoader
from lm.data.shards import ShardWriter, dtype_for_vocab, new_manifest, write_manifest
from lm.models.registry import family_of


def bench_prepare(cfg: JobConfig, reps: int, repeat: int = 4) -> dict:
    """`prepare` on every core against a one-process `encode_ordinary` loop, timed in a fresh process
    (see lm/bench/prepare_speed.py)."""
    done = subprocess.run([sys.executable, "-m", "lm.bench.prepare_speed", "--tokenizer", cfg.data.tokenizer,
                           "--reps", str(reps), "--repeat", str(repeat)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def bench_loader(cfg: JobConfig, micro_batch: int, steps: int) -> dict:
    """The training loader over synthetic shards (one rank, the preset's objective): micro-batches/s, the
    GB/s of token windows it delivers, and the seconds one step of `micro_batch` sequences waits on it."""
    rng = np.random.default_rng(0)
    dtype = dtype_for_vocab(cfg.model.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        splits = {}
        for split, count in (("train", 8_000_000), ("val", 100_000)):
            writer = ShardWriter(tmp, split, 4_000_000, dtype)
            writer.add(rng.integers(0, cfg.model.vocab_size, count).astype(dtype))
            shards = writer.close()
            splits[split] = {"documents": 1, "tokens": count, "shards": shards}
        write_manifest(tmp, new_manifest(cfg.data.tokenizer, cfg.model.vocab_size, 0, "synthetic", "", splits))
        # its cost is part of the loader's
        objective = family_of(cfg.model).training.objective(cfg.model, cfg.data, cfg.data.seq_len, 0)
        loader = TokenLoader(tmp, "train", cfg.data.seq_len, 0, 0, 1, micro_batch, micro_batch, objective)
        loader.next_batch()  # the first touch builds the permutation and faults the pages in
        start = time.perf_counter()
        delivered = 0
        for _ in range(steps):
            delivered += sum(a.nbytes for batch in loader.next_batch() for a in batch)
        seconds = (time.perf_counter() - start) / steps
    return {"batches/s": 1 / seconds, "GB/s": delivered / steps / seconds / 1e9, "seconds/step": seconds}
