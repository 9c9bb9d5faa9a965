"""`python -m lm.consolidate --checkpoint RUN OUT.safetensors`: any checkpoint as one safetensors file.

Every engine's checkpoint goes in, on one process and without a process group (`lm.checkpoint.model_weights`);
out comes the consolidated format (`lm.checkpoint.consolidated`), which lm.eval, lm.sample, lm.export and
checkpoint.init_from read.
"""

import argparse
import sys

from lm.checkpoint.consolidated import consolidate, output_problem
from lm.cli import a_path, run


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lm.consolidate",
        description="Consolidate a checkpoint of any engine (ddp, fsdp, deepspeed ZeRO 1-3) and world size into "
                    "one safetensors file holding the fp32 weights and the run's config, which lm.eval, lm.sample "
                    "and lm.export read on a single process. A tied output head is stored once.",
    )
    parser.add_argument("--checkpoint", required=True, type=a_path,
                        help="run directory, its checkpoints/ or one step_XXXXXXXX directory")
    parser.add_argument("out", type=a_path, metavar="OUT", help="the .safetensors file to write")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    if problem := output_problem(args.out, args.force):
        parser.error(problem)
    consolidate(args.checkpoint, args.out, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
