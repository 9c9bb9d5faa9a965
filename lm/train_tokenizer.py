"""Command line: train a byte-level BPE tokenizer.json on the configured corpus and compare it with GPT-2's, e.g.

    python -m lm.train_tokenizer --config configs/demo.yaml --vocab-size 16000 \
        --out data/tokenizers/shakespeare-16k.json

The corpus is `data.source` read as lm.prepare reads it; the documents prepare puts in the val split
(`data.val_fraction`) are held out of training and measure the tokenizer's compression against GPT-2's.
"""

import argparse
import logging
import sys
import time
from pathlib import Path

import tokenizers

from lm.checkpoint.store import enclosing_checkpoint
from lm.cli import a_path, positive_int, run
from lm.config import parse_cli
from lm.data.corpora import find_corpus
from lm.data.tokenizer_training import (
    MAX_VOCAB_SIZE,
    Tally,
    check_vocab_size,
    compression,
    corpus_pieces,
    special_tokens,
    train_bpe,
)
from lm.errors import ConfigError, DataError
from lm.io import atomic_write_text, output_file_problem
from lm.tokenizer import load_tokenizer
from lm.tokenizer.hf_json import TOKENIZER_CONFIG

log = logging.getLogger("lm.train_tokenizer")
READS = ("data.source", "data.text_column", "data.document_separator", "data.val_fraction")
"""The keys the tool reads: the corpus as lm.prepare reads it, and its held-out share; any other override (a data.dir,
a data.tokenizer) would change nothing, and is refused."""

BASELINE = "gpt2"
"""The tokenizer the new one is compared with."""


def _add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab-size", type=positive_int, required=True,
                        help="ids of the tokenizer: 256 bytes, the special tokens and the merges (e.g. 16000); at "
                             f"most {MAX_VOCAB_SIZE:,}")
    parser.add_argument("--special-token", action="append", default=[], metavar="TOKEN",
                        help="a special token after <|endoftext|> (always id 0, the end of every document); "
                             "repeat for more")
    parser.add_argument("--out", type=a_path, required=True,
                        help="the tokenizer.json to write (a path ending in .json)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")


def output_problem(out: Path, inputs: tuple[Path, ...], force: bool) -> str | None:
    """Why the tokenizer may not be written to `out`, or None; asked before training."""
    if out.suffix != ".json":
        return f"{out}: must end in .json, which is how data.tokenizer tells a tokenizer.json from a tiktoken name"
    if problem := output_file_problem(out, inputs):
        return problem
    if (step := enclosing_checkpoint(out)) is not None:
        return f"{out}: is inside the checkpoint {step}; write the tokenizer elsewhere"
    if out.exists() and not force:
        return f"{out}: exists; pass --force to replace it (a run trained with it would then read the new one)"
    if (config := out.with_name(TOKENIZER_CONFIG)).exists():
        return (f"{out}: {config} is beside it and lm would read its special tokens with the new file; "
                "write the tokenizer to another directory")
    return None


def main(argv: list[str]) -> int:
    """Train the tokenizer, write it atomically to --out and print its compression beside GPT-2's."""
    cfg, args = parse_cli(argv, "Train a byte-level BPE tokenizer.json on data.source, read as lm.prepare reads it "
                          f"(of the config, only {', '.join(READS)} apply).", extra=_add_flags,
                          prog="python -m lm.train_tokenizer", reads=READS)
    data = cfg.data
    specials = special_tokens(args.special_token)
    check_vocab_size(args.vocab_size, specials)
    corpus = find_corpus(data.source, data.document_separator)
    if problem := output_problem(args.out, corpus.files, args.force):
        raise ConfigError(f"--out {problem}")
    baseline = load_tokenizer(BASELINE)  # before training: a missing rank file should cost nothing

    log.info("training a byte-level BPE of %d ids on %s, holding out data.val_fraction=%g of the documents",
             args.vocab_size, data.source, data.val_fraction)
    start = time.perf_counter()
    seen = Tally()
    pieces = corpus_pieces(corpus, data.text_column, data.val_fraction, held_out=False)
    tokenizer = train_bpe(seen.texts(pieces), args.vocab_size, specials)
    seconds = time.perf_counter() - start
    if seen.bytes == 0:  # documents that are empty rows: a tokenizer of bare bytes, learnt from nothing
        raise DataError(f"data.source: {data.source}: its training documents ({_documents(seen.documents)}) hold no "
                        "text; nothing to train a tokenizer on")
    try:
        atomic_write_text(args.out, tokenizer.to_str())
    except OSError as err:  # checked before training; a full disk, or a directory changed since, still ends here
        raise ConfigError(f"--out {args.out}: cannot write it: {err.strerror or err}") from None
    n_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    short = f" (of {args.vocab_size:,} asked: no pair is left to merge)" if n_vocab < args.vocab_size else ""
    print(f"trained on {_documents(seen.documents)} ({seen.bytes / 1e6:.1f} MB) in {seconds:.1f} s: {n_vocab:,} ids"
          f"{short}, {', '.join(f'{t} = {tokenizer.token_to_id(t)}' for t in specials)}")

    written = tokenizers.Tokenizer.from_file(str(args.out))  # measured as written and as lm encodes: specials as text
    written.encode_special_tokens = True
    held_out = compression(corpus_pieces(corpus, data.text_column, data.val_fraction, held_out=True), {
        "new": lambda texts: [e.ids for e in written.encode_batch_fast(texts, add_special_tokens=False)],
        BASELINE: baseline.encode_ordinary_batch,
    })
    if held_out.documents == 0:  # empty and blank documents are skipped: one held out has text
        print(f"held out: no document (data.val_fraction={data.val_fraction}), so compression is not measured")
    else:
        new, old = held_out.bytes_per_token("new"), held_out.bytes_per_token(BASELINE)
        fewer = 1 - held_out.tokens["new"] / held_out.tokens[BASELINE]
        print(f"held out: {_documents(held_out.documents)}, {held_out.bytes:,} bytes: {new:.3f} bytes/token "
              f"({held_out.tokens['new']:,} tokens), {BASELINE} {old:.3f} ({held_out.tokens[BASELINE]:,} tokens); "
              f"{abs(fewer):.1%} {'fewer' if fewer >= 0 else 'more'} tokens than {BASELINE}")
    print(f"wrote {args.out}: train with --data.tokenizer={args.out} --model.vocab_size={n_vocab}")
    return 0


def _documents(count: int) -> str:
    return f"{count:,} document{'s' * (count != 1)}"


if __name__ == "__main__":
    sys.exit(run(main))
