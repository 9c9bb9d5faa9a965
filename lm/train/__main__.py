"""`python -m lm.train`: pretrain a model, alone or under torchrun (one process per device)."""

import sys

from lm.cli import run
from lm.config import parse_cli
from lm.distributed import init_distributed
from lm.train.trainer import Trainer


def main(argv: list[str]) -> int:
    cfg, _ = parse_cli(argv, "Pretrain a language model on prepared token shards. "
                             "Run under torchrun for several processes.",
                       prog="python -m lm.train")
    env = init_distributed(cfg.train.device)
    try:
        Trainer(cfg, env).fit()
    finally:
        env.close()
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
