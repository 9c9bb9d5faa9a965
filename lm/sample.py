"""`python -m lm.sample`: generate text from a checkpoint saved at any world size.

The model's family writes the text: a next-token model (a GPT, an LSTM) continues the prompt; an
encoder-decoder fills its `<mask>`s (`lm.models.encdec.sampling`); an encoder writes none.
"""

import argparse
import sys

from lm.checkpoint.loading import load_for_inference
from lm.cli import a_path, finite_float, in_range, positive_int, run
from lm.config.rules import MAX_SEED
from lm.distributed.env import init_device
from lm.errors import ConfigError, PromptError
from lm.io import read_utf8
from lm.models.family import SampleOptions
from lm.models.registry import family_of
from lm.tokenizer import model_tokenizer

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4
"""Sampling temperatures besides 0 (greedy): below 1e-4 the logits divided by it leave float32's range (inf, then
nan probabilities); above 1e4 every token is as likely as any other."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lm.sample", description="Sample text from a trained checkpoint.")
    parser.add_argument("--checkpoint", required=True, type=a_path,
                        help="run directory, its checkpoints/ or one step_XXXXXXXX directory")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="",
                        help="prompt text, led by the tokenizer's BOS if it has one (default: empty, start from the "
                             "BOS, or without one from end-of-text)")
    source.add_argument("--prompt-file", type=a_path, help="read the prompt from this UTF-8 file")
    parser.add_argument("--max-new-tokens", type=positive_int, default=200)
    parser.add_argument("--temperature", type=in_range(float, 0.0, MAX_TEMPERATURE), default=0.8,
                        help=f"0 means greedy; else {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}")
    parser.add_argument("--top-k", type=positive_int, help="keep the K most likely tokens (default 200)")
    parser.add_argument("--top-p", type=finite_float, default=None, help="nucleus sampling threshold in (0, 1]")
    parser.add_argument("--num-samples", type=positive_int, default=1)
    parser.add_argument("--seed", type=in_range(int, 0, MAX_SEED),
                        help="same seed, same text (sample i of --num-samples takes seed + i; default 1337)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--compile", action="store_true",
                        help="decode through a static KV cache with the per-token step compiled (torch.compile, a CUDA "
                             "graph on a GPU): the same tokens, faster once compiled (a compile takes 10-60 s)")
    args = parser.parse_args(argv)
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p: must be in (0, 1], got {args.top_p}")
    if args.temperature == 0:  # greedy: the most likely token every time, whatever these say
        for flag, given in (("--top-k", args.top_k is not None), ("--top-p", args.top_p is not None),
                            ("--seed", args.seed is not None), ("--num-samples", args.num_samples > 1)):
            if given:
                parser.error(f"{flag}: greedy decoding (--temperature 0) takes the most likely token every time, "
                             "so it would change nothing; drop it, or sample at a temperature")
    args.top_k = 200 if args.top_k is None else args.top_k
    args.seed = 1337 if args.seed is None else args.seed
    if 0 < args.temperature < MIN_TEMPERATURE:
        parser.error(f"--temperature: {args.temperature:g} is too close to 0: the logits divided by it overflow; "
                     f"0 for greedy, or at least {MIN_TEMPERATURE:g}")

    device = init_device(args.device, "--device")
    model, cfg, step_dir = load_for_inference(args.checkpoint, device)
    family = family_of(cfg.model)
    if family.sampler is None:
        raise ConfigError(f"--checkpoint: {step_dir} is {cfg.model.title} (model.arch={cfg.model.arch}), which "
                          "generates no text; score it with python -m lm.eval, or a fine-tuned head with "
                          "python -m lm.predict")
    tokenizer = model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    text = args.prompt if args.prompt_file is None else read_utf8(args.prompt_file)
    for i in range(args.num_samples):
        options = SampleOptions(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed + i,
                                compiled=args.compile)
        try:
            sample = family.sampler.sample(model, tokenizer, text, options)
        except PromptError as err:  # a prompt or length the model cannot take
            parser.error(str(err))
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(sample)
    return 0


if __name__ == "__main__":
    sys.exit(run(main, logs=sys.stderr))  # stdout holds the samples alone
