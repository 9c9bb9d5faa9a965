"""Which source a mixture model's samples read like (docs/experiments.md: A mixture of two corpora).

Each run's final checkpoint writes N samples from end-of-text (a document's start); each sample is then
scored by the two single-source runs (weights 1:0 and 0:1), and it counts as the source whose model gives
it the lower loss.

    python -m experiments.mixture_samples runs/mixture-1to0 runs/mixture-3to1 runs/mixture-1to3 runs/mixture-0to1
"""

import argparse
import sys

import torch
import torch.nn.functional as F

from lm.checkpoint.loading import load_for_inference
from lm.cli import positive_int
from lm.cli import run as run_tool
from lm.models.generate import generate
from lm.tokenizer import load_tokenizer

SAMPLES, TOKENS = 40, 64


@torch.no_grad()
def loss(model: torch.nn.Module, ids: list[int]) -> float:
    """Mean next-token loss of `ids` (the leading end-of-text is context only)."""
    x = torch.tensor([ids])
    logits = model.logits(model(x[:, :-1]))
    return F.cross_entropy(logits[0].float(), x[0, 1:]).item()


def report(runs: list[str], samples: int = SAMPLES, tokens: int = TOKENS) -> None:
    cpu = torch.device("cpu")
    judges = [load_for_inference(run, cpu)[0] for run in (runs[0], runs[-1])]  # Shakespeare only, KJV only
    eot = load_tokenizer("gpt2").eot_token
    decode = load_tokenizer("gpt2").decode
    for run in runs:
        model = load_for_inference(run, cpu)[0]
        texts = [[eot, *generate(model, [eot], tokens, temperature=0.8, top_k=200, eot_id=eot, seed=1337 + i)]
                 for i in range(samples)]
        bible = sum(loss(judges[1], ids) < loss(judges[0], ids) for ids in texts)
        print(f"{run}: {samples - bible} of {samples} samples read as Shakespeare, {bible} as the Bible")
        print("  first sample:", repr(decode(texts[0][1:])[:160]))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.mixture_samples",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories; the first trained on Shakespeare alone, the last "
                        "on the Bible alone")
    parser.add_argument("--samples", type=positive_int, default=SAMPLES, help="samples per run")
    parser.add_argument("--tokens", type=positive_int, default=TOKENS, help="tokens per sample")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least the two single-source runs (Shakespeare alone first, the Bible alone last)")
    report(args.runs, args.samples, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
