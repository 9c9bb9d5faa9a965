"""Data preparation speed, run by `lm.bench` in a process of its own: `python -m lm.bench.prepare_speed`.

A fresh process that has not imported torch, as `python -m lm.prepare` has not, so the numbers are the
ones a user gets. `prepare` on every core (reading, tokenizing, writing shards and their checksums) is
timed against a one-process loop that reads each file and calls `encode_ordinary`, over the same text
files (the built-in corpus's documents written `--repeat` times), the two alternating rep by rep so that
drift in the machine's speed touches both alike. Prints one JSON object.
"""

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lm.data.config import DataConfig
from lm.data.corpora import find_corpus
from lm.data.prepare import prepare
from lm.tokenizer import load_tokenizer


def measure(tokenizer: str, reps: int, repeat: int) -> dict:
    enc = load_tokenizer(tokenizer)
    workers = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for r in range(repeat):
            for i, text in enumerate(find_corpus("shakespeare").documents("text")):
                files.append(Path(tmp, f"doc_{r}_{i:03d}.txt"))
                files[-1].write_text(text)
        data = DataConfig(source=f"{tmp}/*.txt", tokenizer=tokenizer, dir=f"{tmp}/data", num_workers=workers,
                          shard_tokens=10_000_000)
        manifest = prepare(data, force=True)  # also the warm-up
        tokens = sum(split["tokens"] for split in manifest["splits"].values())
        ours, loop = [], []
        for _ in range(reps):
            start = time.perf_counter()
            prepare(data, force=True)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            for path in files:
                enc.encode_ordinary(path.read_text())
            loop.append(time.perf_counter() - start)
    ours_s, loop_s = statistics.median(ours), statistics.median(loop)
    return {"documents": len(files), "tokens": tokens, "workers": workers, "prepare tokens/s": tokens / ours_s,
            "loop tokens/s": tokens / loop_s, "speedup": loop_s / ours_s}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m lm.bench.prepare_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=4, help="copies of the corpus (4: about 6M gpt2 tokens)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(measure(args.tokenizer, args.reps, args.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
