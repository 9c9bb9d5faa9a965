"""Command line: tokenize the configured corpus into shards, or check prepared shards, e.g.

    python -m lm.prepare --config configs/demo.yaml --data.val_fraction=0.1 [--force]
    python -m lm.prepare --config configs/demo.yaml --verify
"""

import argparse
import sys
import time

from lm.cli import PREPARE_READS, run
from lm.config import parse_cli
from lm.data.prepare import prepare
from lm.data.shards import read_manifest, verify_hashes


def _add_flags(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--force", action="store_true", help="rebuild even if the prepared data is up to date")
    mode.add_argument("--verify", action="store_true",
                      help="only check data.dir's shards (sizes and sha256) against its manifest.json; change nothing")


def main(argv: list[str]) -> int:
    """Prepare `data.dir` from `data.source` and print a summary of what it holds."""
    start = time.perf_counter()
    cfg, args = parse_cli(argv, "Tokenize a corpus into train/val shards.", extra=_add_flags,
                          prog="python -m lm.prepare", reads=PREPARE_READS)
    if args.verify:
        manifest = read_manifest(cfg.data.dir)
        verify_hashes(cfg.data.dir, manifest)
        shards = sum(len(info["shards"]) for info in manifest["splits"].values())
        print(f"{cfg.data.dir}: all {shards} shards match manifest.json (sizes and sha256)")
        return 0
    manifest = prepare(cfg.data, force=args.force)
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['documents']:,} documents, {info['tokens']:,} tokens, {len(info['shards'])} shards")
    print(f"{manifest['tokenizer']} ({manifest['dtype']}) in {cfg.data.dir}, {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
