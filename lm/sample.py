"""`python -m lm.sample`: generate text from a checkpoint saved at any world size."""

import argparse
import logging
import sys
from pathlib import Path

import torch

from lm.checkpoint import load_for_inference
from lm.cli import run
from lm.runtime import tune_cpu
from lm.data.shards import DataError
from lm.models.generate import generate
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


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{args.prompt_file}: not UTF-8 (invalid byte at offset {err.start})") from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Sample text from a trained checkpoint.")
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


if __name__ == "__main__":
    sys.exit(run(main))
