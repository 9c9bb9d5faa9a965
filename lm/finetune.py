"""`python -m lm.finetune`: train a classification or regression head on a pretrained trunk (an encoder's).

    python -m lm.finetune --encoder runs/encoder --model.head=classify --model.num_classes=2 \\
        --task.file=data/lines.csv --train.out_dir=runs/lines

The checkpoint (a run directory, a step directory of any engine, or a consolidated .safetensors) gives the run
its model (`model.*`: the trunk must stay the checkpoint's; the keys that choose the head, its family's
`TaskHead.keys`, are the run's), its tokenizer and its window length (the longest example, data.seq_len); the
trunk's weights start from it and the head is drawn fresh (`lm.checkpoint.trunk`). Everything else is a
training run like `lm.train`'s: any engine under torchrun, checkpoints, resume (the same command again), metrics
in TensorBoard. Run under torchrun for several processes.
"""

import argparse
import dataclasses
from pathlib import Path

from lm.checkpoint.trunk import saved_config
from lm.cli import a_path, exit_without_teardown, run
from lm.config import JobConfig, parse_cli
from lm.errors import ConfigError
from lm.hf.importing import is_hf_checkpoint
from lm.models.registry import family_of

READS = ("model", "optim", "schedule", "train", "parallel", "checkpoint", "log", "task", "data.seq_len")
"""What a fine-tuning run reads of the config: of the data section only the window length; the tokenizer is the
encoder's, and the labelled rows are task.file's."""
DESCRIPTION = "Fine-tune a pretrained encoder: a classify or regress head on a labelled file (task.file)."


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--encoder", required=True, type=a_path,
                        help="the pretrained encoder: a run directory, a step directory or a consolidated .safetensors")


def encoder_base(path: Path, saved: JobConfig) -> dict:
    """The config sections a fine-tuning run takes from the checkpoint at `path`, whose config is `saved`: the
    trunk's model keys, the tokenizer and window length, and checkpoint.init_from itself."""
    head = family_of(saved.model).training.head
    model = {k: v for k, v in dataclasses.asdict(saved.model).items() if head is None or k not in head.keys}
    return {"model": model, "data": {"tokenizer": saved.data.tokenizer, "seq_len": saved.data.seq_len},
            "checkpoint": {"init_from": str(path)}}


def encoder_config(path: Path) -> JobConfig:
    """The config of the checkpoint --encoder names, one of a family that fine-tunes a head."""
    if not path.exists():
        raise ConfigError(f"--encoder: no such file or directory {str(path)!r}")
    if is_hf_checkpoint(path):
        raise ConfigError(f"--encoder: {path} is a Hugging Face checkpoint; lm.finetune starts from an lm "
                          "checkpoint (a run directory, a step directory or a consolidated .safetensors)")
    saved = saved_config(path)
    if family_of(saved.model).training.head is None:
        raise ConfigError(f"--encoder: {path} holds {saved.model.title} (model.arch={saved.model.arch}), which "
                          "has no fine-tuning head; lm.finetune trains a head on an encoder's checkpoint "
                          "(model.arch=encoder)")
    return saved


def main(argv: list[str]) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--encoder")
    encoder = pre.parse_known_args(argv)[0].encoder
    # an empty one is left to parse_cli, which names the flag
    base = None if not (encoder or "").strip() else encoder_base(Path(encoder), encoder_config(Path(encoder)))
    cfg, _ = parse_cli(argv, DESCRIPTION, extra=_flags, prog="python -m lm.finetune", base=base, reads=READS)
    if encoder is not None and Path(cfg.checkpoint.init_from).resolve() != Path(encoder).resolve():
        raise ConfigError(f"checkpoint.init_from: {cfg.checkpoint.init_from!r}, but --encoder {encoder} names the "
                          "weights to start from (and the model to build); give the checkpoint as --encoder alone")
    if cfg.model.task_head is None:
        head = getattr(cfg.model, "head", None)
        raise ConfigError(f"model.head: lm.finetune trains a classify or regress head, got {head!r}; "
                          "set --model.head=classify (with --model.num_classes) or --model.head=regress")
    from lm.training.job import run_job  # after the config is known good: --help needs no trainer

    run_job(cfg)
    return 0


if __name__ == "__main__":
    exit_without_teardown(run(main))
