"""`python -m lm.sample`: generate text from a checkpoint saved at any world size.

A GPT or an LSTM continues the prompt. An encoder-decoder reads the prompt as its source: each `<mask>`
in it becomes a sentinel whose span the decoder writes, and the output is the prompt with the spans
filled in; a prompt without `<mask>` gets one at its end, so the model writes a continuation.
"""

import argparse
import logging
import sys
from pathlib import Path

import torch

from lm.checkpoint import load_for_inference
from lm.cli import run
from lm.runtime import tune_cpu
from lm.data.shards import DataError
from lm.models.config import ModelConfig
from lm.models.generate import generate, generate_seq2seq
from lm.tokenizer import load_tokenizer

log = logging.getLogger("lm.sample")


def fit_prompt(ids: list[int], max_new_tokens: int, block_size: int) -> list[int]:
    """Keep the tail of a prompt so that prompt + generated tokens fit the model's context."""
    if max_new_tokens >= block_size:
        raise ValueError(f"--max-new-tokens: {max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {block_size} tokens")
    room = block_size - max_new_tokens
    if len(ids) > room:
        log.warning("prompt has %d tokens; keeping its last %d so that %d new tokens fit the context of %d",
                    len(ids), room, max_new_tokens, block_size)
        return ids[-room:]
    return ids


MASK = "<mask>"


def encdec_source(text: str, encode, cfg: ModelConfig) -> tuple[list[int], list[str]]:
    """Source ids for an encoder-decoder prompt and the text pieces around its masks.

    Every `<mask>` becomes the next sentinel id; a prompt without one gets one at its end. Returns
    (ids, pieces) with len(pieces) == number of masks + 1.
    """
    pieces = text.split(MASK)
    if len(pieces) == 1:
        pieces.append("")
    n_masks = len(pieces) - 1
    if n_masks + 1 > cfg.n_sentinels:  # the spans' sentinels plus the end marker
        raise ValueError(f"prompt has {n_masks} {MASK} markers; the model has {cfg.n_sentinels} sentinels, "
                         f"so at most {cfg.n_sentinels - 1} spans can be filled")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        ids += encode(piece) if piece else []
        if i < n_masks:
            ids.append(cfg.sentinel_start + i)
    if len(ids) > cfg.block_size:
        raise ValueError(f"prompt of {len(ids)} tokens is longer than the encoder's positions "
                         f"(model.block_size={cfg.block_size}); shorten it")
    return ids, pieces


def split_spans(tokens: list[int], n_spans: int, sentinel_start: int) -> list[list[int]]:
    """The decoder's output `s0 span0 s1 span1 ...` cut into n_spans spans (missing ones are empty);
    tokens before the first sentinel, and sentinels out of order, start no span."""
    spans: list[list[int]] = [[] for _ in range(n_spans)]
    current = None
    for token in tokens:
        if sentinel_start <= token < sentinel_start + n_spans:
            current = token - sentinel_start
        elif current is not None:
            spans[current].append(token)
    return spans


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{args.prompt_file}: not UTF-8 (invalid byte at offset {err.start})") from None
    except OSError as err:
        raise DataError(f"--prompt-file: cannot read {args.prompt_file!r}: {err.strerror}") from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lm.sample", description="Sample text from a trained checkpoint.")
    parser.add_argument("--checkpoint", required=True, help="run directory, its checkpoints/ or one step_XXXXXXXX directory")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="", help="prompt text (default: empty, start from end-of-text)")
    source.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=200)
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold in (0, 1]")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1337, help="same seed, same text")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p: must be in (0, 1], got {args.top_p}")
    if args.temperature < 0:
        parser.error(f"--temperature: must be >= 0, got {args.temperature}")
    for flag in ("top_k", "max_new_tokens", "num_samples"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")

    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        tune_cpu()
    model, cfg, step_dir = load_for_inference(args.checkpoint, device)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    text = read_prompt(args)
    if cfg.model.arch == "encdec":
        return sample_encdec(model, cfg.model, tokenizer, text, args, parser)
    ids = tokenizer.encode_ordinary(text) if text else [tokenizer.eot_token]
    try:
        ids = fit_prompt(ids, args.max_new_tokens, cfg.model.block_size)
    except ValueError as err:
        parser.error(str(err))
    for i in range(args.num_samples):
        new = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, eot_id=tokenizer.eot_token, seed=args.seed + i)
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(text + tokenizer.decode(new))
    return 0


def sample_encdec(model, cfg: ModelConfig, tokenizer, text: str, args: argparse.Namespace,
                  parser: argparse.ArgumentParser) -> int:
    """Fill the prompt's masks (or continue it) with an encoder-decoder; prints one text per sample."""
    if args.max_new_tokens > cfg.block_size:
        parser.error(f"--max-new-tokens: {args.max_new_tokens} exceeds the decoder's positions "
                     f"(model.block_size={cfg.block_size})")
    try:
        encdec_source(text, tokenizer.encode_ordinary, cfg)
    except ValueError as err:
        parser.error(str(err))
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(fill_masks(model, cfg, tokenizer, text, args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed + i))
    return 0


def fill_masks(model, cfg: ModelConfig, tokenizer, text: str, max_new_tokens: int, temperature: float,
               top_k: int | None, top_p: float | None, seed: int) -> str:
    """The prompt with each `<mask>` replaced by the span an encoder-decoder writes for it."""
    ids, pieces = encdec_source(text, tokenizer.encode_ordinary, cfg)
    n_spans = len(pieces) - 1
    # the end marker, and any sentinel after it, end the output
    stop = set(range(cfg.sentinel_start + n_spans, cfg.sentinel_start + cfg.n_sentinels))
    out = generate_seq2seq(model, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           stop_ids=stop, seed=seed)
    spans = split_spans(out, n_spans, cfg.sentinel_start)
    filled = [pieces[0]]
    for span, piece in zip(spans, pieces[1:]):
        filled += [tokenizer.decode(span), piece]  # spans hold no sentinel: they delimit or stop
    return "".join(filled)


if __name__ == "__main__":
    sys.exit(run(main))
