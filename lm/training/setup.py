"""Putting a run together before its first step: the data it reads, where it starts from (a checkpoint of its
own to resume, or weights to start from), and its model inside an engine.

The order is fixed: the data is checked and opened (`lm.training.token_data` or `lm.training.task_data`), the
checkpoint to resume from is chosen and checked (`lm.checkpoint.resume`), the model's family builds it on the
meta device and the engine allocates, draws and wraps it (`lm.distributed.engine`); the trainer then loads a
resumed run's state into that engine.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lm.checkpoint.loading import init_from_loader
from lm.checkpoint.resume import check_resume, find_resume
from lm.config import JobConfig, use_bf16
from lm.distributed.engine import Engine, build_engine
from lm.distributed.env import DistEnv
from lm.distributed.materialize import WeightLoader
from lm.errors import ConfigError
from lm.io import physical_memory
from lm.models.family import Family
from lm.plan.counts import num_params
from lm.plan.memory import GIB
from lm.training.task_data import TaskData, open_task_data
from lm.training.token_data import TrainingData, open_training_data


def open_data(cfg: JobConfig, env: DistEnv) -> TrainingData | TaskData:
    """A fine-tuning head reads labelled rows (task.file); every other model reads token shards."""
    return open_task_data(cfg, env) if cfg.task.file else open_training_data(cfg, env)


def build_run_engine(cfg: JobConfig, family: Family, env: DistEnv, load_weights: WeightLoader | None = None,
                     load_universal: bool = False) -> Engine:
    """The model of `cfg` built by its family on the meta device and handed to the engine, which draws its
    weights from train.seed (the same on every engine and world size) or, for a new run with
    checkpoint.init_from, loads them with `load_weights` (`init_from_loader`). A precision the family cannot
    run on this device is refused here, under every engine, before any weights exist."""
    family.check_precision(cfg.model, env.device.type, use_bf16(cfg.train.dtype, env.device.type))
    check_host_room(cfg, env)
    torch.manual_seed(cfg.train.seed)
    model = family.build_meta(cfg.model)
    return build_engine(model, family, cfg.parallel, cfg.train, cfg.optim, env, load_weights, load_universal)


def check_host_room(cfg: JobConfig, env: DistEnv) -> None:
    """Refuse a run on CPUs whose float32 weights and gradients alone (8 bytes a parameter, however the engine
    shards them over this machine's ranks) exceed this machine's memory, before building it: allocated, such a
    model has the kernel kill the processes without a word. A GPU's own memory is the planner's to check
    (`lm.train --dry-run`)."""
    if env.device.type != "cpu":
        return
    params = num_params(cfg.model)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))  # this machine's ranks (torchrun sets it)
    needed = 8 * params * local // env.world_size
    memory = physical_memory()
    if needed > memory:
        raise ConfigError(f"model: {params:,} parameters need {needed / GIB:,.1f} GiB of this machine's memory for "
                          f"their float32 weights and gradients alone, and it has {memory / GIB:,.1f} GiB; make "
                          "the model smaller (python -m lm.train --dry-run plans what a model needs)")


@dataclass
class Start:
    """Where a run starts: a checkpoint of its own (`resume_from`), or fresh weights, drawn or loaded."""

    resume_from: Path | None
    load_weights: WeightLoader | None
    """Fills a new run's weights from checkpoint.init_from"""
    load_universal: bool
    """A DeepSpeed checkpoint is resumed through its universal form (another world size or ZeRO stage)"""


def choose_start(cfg: JobConfig, env: DistEnv, ckpt_root: Path, data: dict) -> Start:
    """The newest usable checkpoint under `ckpt_root` as checkpoint.resume allows, checked against the config
    and the data (`data`: what state.json records of it); or, without one, checkpoint.init_from's weights."""
    resume_from = find_resume(ckpt_root, cfg.checkpoint.resume, env, cfg.checkpoint.allow_unverified)
    if resume_from is not None:
        return Start(resume_from, None, check_resume(resume_from, cfg, data, env))
    load_weights = init_from_loader(Path(cfg.checkpoint.init_from), cfg) if cfg.checkpoint.init_from else None
    return Start(None, load_weights, False)
