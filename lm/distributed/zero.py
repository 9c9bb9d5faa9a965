"""DeepSpeed ZeRO: our config becomes a DeepSpeed config, and our model and AdamW go into its engine.

`deepspeed` is imported only here and only when the deepspeed engine is chosen, so the other engines
work without it installed.
"""

import json
import os
from pathlib import Path

import torch
import torch.nn as nn

from lm.config import ConfigError, JobConfig
from lm.distributed.env import DistEnv

# keys of a user's DeepSpeed JSON that must agree with our config, and the config key that sets each
_BATCH_KEYS = {
    "train_batch_size": "train.batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.batch_size / (train.micro_batch_size x world size)",
}


def deepspeed_config(cfg: JobConfig, world_size: int, device: torch.device, load_universal: bool = False) -> dict:
    """The DeepSpeed config our job implies, updated by the user's JSON (parallel.deepspeed_config).

    The batch arithmetic is ours: a user JSON that sets a batch key to another value is refused, since
    the loader would feed a different batch than DeepSpeed accumulates. Optimizer and schedule are ours
    too (passed in as objects), so the JSON may not name them.
    """
    accum = cfg.train.batch_size // (cfg.train.micro_batch_size * world_size)
    bf16 = cfg.train.dtype == "bfloat16" or (cfg.train.dtype == "auto" and device.type == "cuda")
    zero: dict = {"stage": cfg.parallel.zero_stage}
    if cfg.parallel.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    ours = {
        "train_batch_size": cfg.train.batch_size,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "checkpoint": {"load_universal": load_universal},
    }
    if cfg.parallel.cpu_offload:
        # our torch AdamW steps the offloaded state on the CPU; DeepSpeed would insist on its compiled one
        ours["zero_force_ds_cpu_optimizer"] = False
    if not cfg.parallel.deepspeed_config:
        return ours
    path = Path(cfg.parallel.deepspeed_config)
    try:
        user = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"parallel.deepspeed_config: no file {str(path)!r}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"parallel.deepspeed_config: {path} is not valid JSON: {err}") from None
    if not isinstance(user, dict):
        raise ConfigError(f"parallel.deepspeed_config: {path} must hold a JSON object")
    for key, source in _BATCH_KEYS.items():
        if key in user and user[key] != ours[key]:
            raise ConfigError(f"parallel.deepspeed_config: {path} sets {key}={user[key]}, but this job has "
                              f"{ours[key]} ({source}); change the job's config instead, or drop the key")
    for key in ("optimizer", "scheduler"):
        if key in user:
            raise ConfigError(f"parallel.deepspeed_config: {path} sets {key!r}; lm passes its own AdamW and "
                              "schedule (optim.*, schedule.*), so drop it")
    merged = dict(ours)
    for key, value in user.items():
        merged[key] = {**ours[key], **value} if isinstance(value, dict) and isinstance(ours.get(key), dict) else value
    return merged


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: JobConfig, env: DistEnv,
               load_universal: bool = False):
    """Wrap `model` and `optimizer` in a DeepSpeed engine on the process group lm already started."""
    import deepspeed

    # DeepSpeed reads its rank from the environment; a run started without a launcher has none
    for key, value in (("LOCAL_RANK", env.local_rank), ("RANK", env.rank), ("WORLD_SIZE", env.world_size)):
        os.environ.setdefault(key, str(value))
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(cfg, env.world_size, env.device, load_universal),
        dist_init_required=False,
    )
    return engine, ds_optimizer


def convert_to_universal(step_dir: Path, tag: str, out_tag: str) -> None:
    """Rewrite a DeepSpeed checkpoint as a universal checkpoint (loadable at any world size) next to it."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(step_dir / tag), output_folder=str(step_dir / out_tag), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
    )
    ds_to_universal.main(args)
