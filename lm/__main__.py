"""The `lm` console script: `lm TOOL [ARGS]` is `python -m lm.TOOL [ARGS]`, for every tool in TOOLS."""

import importlib
import sys

from lm.cli import exit_without_teardown, run

TRAINING_TOOLS = ("train", "finetune", "eval")
"""Tools that may have run a process group (eval: --tasks under torchrun): they end without the interpreter's
teardown (see there)"""

TOOLS = {
    "prepare": ("lm.prepare", "tokenize a corpus into memory-mapped token shards"),
    "train_tokenizer": ("lm.train_tokenizer", "train a byte-level BPE tokenizer.json on a corpus"),
    "train": ("lm.train", "pretrain a model (use torchrun for several processes)"),
    "finetune": ("lm.finetune", "train a classification or regression head on a pretrained encoder"),
    "predict": ("lm.predict", "a fine-tuned encoder's predictions (and scores) for a labelled file"),
    "eval": ("lm.eval", "loss, perplexity and bits per byte of a checkpoint"),
    "sample": ("lm.sample", "generate text from a checkpoint"),
    "sweep": ("lm.sweep.__main__", "train a grid of configs and compare them in a table and a plot"),
    "layouts": ("lm.layouts", "train one short job under several parallel layouts and compare their losses"),
    "plot": ("lm.plot", "loss and perplexity curves of runs as a PNG"),
    "bench": ("lm.bench.__main__", "training, sampling and data throughput, ours beside transformers"),
    "export": ("lm.export", "write a checkpoint as a Hugging Face transformers model"),
    "consolidate": ("lm.consolidate", "merge any checkpoint (DCP or DeepSpeed) into one safetensors file"),
}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in TOOLS:
        asked = len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help")
        out = sys.stdout if asked else sys.stderr  # a usage error's listing goes with its error line
        print("usage: lm {" + ",".join(TOOLS) + "} [--help] [ARGS]\n", file=out)
        for name, (_, doc) in TOOLS.items():
            print(f"  {name:{max(map(len, TOOLS))}s} {doc}", file=out)
        if asked:
            return 0
        given = f"unknown tool {sys.argv[1]!r}" if len(sys.argv) >= 2 else "no tool given"
        print(f"\nerror: {given}; expected one of the tools above", file=sys.stderr)
        return 2
    module = importlib.import_module(TOOLS[sys.argv[1]][0])
    code = run(module.main, sys.argv[2:])
    if sys.argv[1] in TRAINING_TOOLS:
        exit_without_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
