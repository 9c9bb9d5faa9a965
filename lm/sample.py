"""`python -m lm.sample`: generate text from a checkpoint saved at any world size.

A GPT or an LSTM continues the prompt; an encoder-decoder fills its `<mask>`s (`lm.inference.prompts`).
"""

import argparse
import sys

from lm.checkpoint.loading import load_for_inference
from lm.cli import finite_float, positive_int, run
from lm.distributed.env import init_device
from lm.errors import ConfigError
from lm.inference.prompts import encdec_source, fill_masks, fit_prompt
from lm.io import read_utf8
from lm.models.config import ModelConfig
from lm.models.generate import generate
from lm.tokenizer import continuation_text, model_tokenizer, prompt_ids


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lm.sample", description="Sample text from a trained checkpoint.")
    parser.add_argument("--checkpoint", required=True,
                        help="run directory, its checkpoints/ or one step_XXXXXXXX directory")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="",
                        help="prompt text, led by the tokenizer's BOS if it has one (default: empty, start from the "
                             "BOS, or without one from end-of-text)")
    source.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    parser.add_argument("--max-new-tokens", type=positive_int, default=200)
    parser.add_argument("--temperature", type=finite_float, default=0.8, help="0 means greedy")
    parser.add_argument("--top-k", type=positive_int, default=200)
    parser.add_argument("--top-p", type=finite_float, default=None, help="nucleus sampling threshold in (0, 1]")
    parser.add_argument("--num-samples", type=positive_int, default=1)
    parser.add_argument("--seed", type=int, default=1337, help="same seed, same text")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p: must be in (0, 1], got {args.top_p}")
    if args.temperature < 0:
        parser.error(f"--temperature: must be >= 0, got {args.temperature}")

    device = init_device(args.device, "--device")
    model, cfg, step_dir = load_for_inference(args.checkpoint, device)
    if cfg.model.arch == "encoder":
        raise ConfigError(f"--checkpoint: {step_dir} is an encoder (model.arch=encoder), which generates no text; "
                          "score it with python -m lm.eval, or its fine-tuned head with python -m lm.predict")
    tokenizer = model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    text = args.prompt if args.prompt_file is None else read_utf8(args.prompt_file)
    if cfg.model.arch == "encdec":
        return sample_encdec(model, cfg.model, tokenizer, text, args, parser)
    ids = prompt_ids(tokenizer, text)
    try:
        ids = fit_prompt(ids, args.max_new_tokens, cfg.model.block_size)
    except ValueError as err:
        parser.error(str(err))
    for i in range(args.num_samples):
        new = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, eot_id=tokenizer.eot_token, seed=args.seed + i)
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(text + continuation_text(tokenizer, ids, new))
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


if __name__ == "__main__":
    sys.exit(run(main))
