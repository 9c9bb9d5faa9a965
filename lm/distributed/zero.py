"""DeepSpeed ZeRO: our config becomes a DeepSpeed config, and our model and AdamW go into its engine.

`deepspeed` is imported only here and only when the deepspeed engine is chosen, so the other engines
work without it installed.
"""

import contextlib
import functools
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn as nn

from lm.config import OptimConfig, ParallelConfig, TrainConfig, use_bf16
from lm.distributed.activation import checkpoint_blocks
from lm.distributed.env import DistEnv
from lm.distributed.materialize import WeightLoader, materialize
from lm.distributed.optim import build_optimizer, set_lr, settings_kept
from lm.errors import ConfigError
from lm.io import held_output, publish_dir
from lm.models.family import Family, Run

T = TypeVar("T")

log = logging.getLogger(__name__)

DEEPSPEED_TAG = "deepspeed"
"""Subdirectory (DeepSpeed's checkpoint tag) of a step directory holding a DeepSpeed engine's files."""
UNIVERSAL_TAG = "deepspeed_universal"
"""Its conversion to DeepSpeed's universal format, made when a run resumes at another world size or stage."""

# keys of a user's DeepSpeed JSON that must agree with our config, and the config key that sets each
_BATCH_KEYS = {
    "train_batch_size": "train.batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.batch_size / (train.micro_batch_size x world size)",
}


def deepspeed_config(parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig, world_size: int,
                     device: torch.device, load_universal: bool = False) -> dict:
    """The DeepSpeed config our job implies, updated by the user's JSON (parallel.deepspeed_config).

    The batch arithmetic is ours: a user JSON that sets a batch key to another value is refused, since
    the loader would feed a different batch than DeepSpeed accumulates. Optimizer and schedule are ours
    too (passed in as objects), so the JSON may not name them.
    """
    accum = train.batch_size // (train.micro_batch_size * world_size)
    bf16 = use_bf16(train.dtype, device.type)
    zero: dict = {"stage": parallel.zero_stage}
    if parallel.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    ours = {
        "train_batch_size": train.batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "checkpoint": {"load_universal": load_universal},
    }
    if parallel.cpu_offload:
        # our torch AdamW steps the offloaded state on the CPU; DeepSpeed would insist on its compiled one
        ours["zero_force_ds_cpu_optimizer"] = False
    if not parallel.deepspeed_config:
        return ours
    path = Path(parallel.deepspeed_config)
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
    user_zero = user.get("zero_optimization")
    stage = user_zero.get("stage", parallel.zero_stage) if isinstance(user_zero, dict) else parallel.zero_stage
    if stage != parallel.zero_stage:
        raise ConfigError(f"parallel.deepspeed_config: {path} sets zero_optimization.stage={stage!r}, but this job "
                          f"has {parallel.zero_stage} (parallel.zero_stage); change the job's config instead, "
                          "or drop the key")
    for key in ("optimizer", "scheduler"):
        if key in user:
            raise ConfigError(f"parallel.deepspeed_config: {path} sets {key!r}; lm passes its own AdamW and "
                              "schedule (optim.*, schedule.*), so drop it")
    merged = dict(ours)
    for key, value in user.items():
        merged[key] = {**ours[key], **value} if isinstance(value, dict) and isinstance(ours.get(key), dict) else value
    return merged


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict, deepspeed_json: str, env: DistEnv):
    """Wrap `model` and `optimizer` in a DeepSpeed engine with `config` (`deepspeed_config`, read from the user's
    `deepspeed_json`) on the process group lm already started."""
    # DeepSpeed reads its rank from the environment; a run started without a launcher has none
    for key, value in (("LOCAL_RANK", env.local_rank), ("RANK", env.rank), ("WORLD_SIZE", env.world_size)):
        os.environ.setdefault(key, str(value))
    from pydantic import ValidationError  # what DeepSpeed's config classes raise

    # DeepSpeed's import and setup print an accelerator notice and compiler lines: shown once they succeed,
    # dropped when they fail, so that a refused JSON ends on our one error line
    with held_output():
        import deepspeed

        try:
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=config, dist_init_required=False,
            )
        except ValidationError as err:  # a value of the user's JSON that DeepSpeed's schema refuses
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ConfigError(f"parallel.deepspeed_config: {deepspeed_json}: {err.title} {where}: "
                              f"{first['msg']}, got {first.get('input')!r}") from None
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


def ensure_universal(path: Path, env: DistEnv) -> None:
    """Give a DeepSpeed checkpoint a universal twin (`deepspeed_universal/`), which loads at any world
    size, and under stage 1 or 2 where stage 1 or 2 wrote it (`check_engine` refuses a move to or from stage 3);
    rank 0 converts once, into a temporary directory renamed when complete."""
    if env.is_main and not (path / UNIVERSAL_TAG).is_dir():
        log.info("%s: converting the DeepSpeed checkpoint to a universal one for another world size or stage", path)
        tmp_tag = UNIVERSAL_TAG + ".tmp"
        shutil.rmtree(path / tmp_tag, ignore_errors=True)
        convert_to_universal(path, DEEPSPEED_TAG, tmp_tag)
        publish_dir(path / tmp_tag, path / UNIVERSAL_TAG)
    env.barrier()


class DeepSpeedEngine:
    """DeepSpeed ZeRO stage 1-3 around our model and our AdamW; DeepSpeed's own checkpoints."""

    name = "deepspeed"
    skips_nonfinite = False  # without fp16 loss scaling it applies every step before its norm is known
    schedule = None

    def __init__(self, model: nn.Module, family: Family, parallel: ParallelConfig, train: TrainConfig,
                 optim: OptimConfig, env: DistEnv, load_weights: WeightLoader | None,
                 load_universal: bool = False) -> None:
        self.optim, self.env, self.zero_stage, self.load_universal = optim, env, parallel.zero_stage, load_universal
        if train.compile:  # not wired up (nor tried) inside DeepSpeed's engine
            log.warning("train.compile is not applied under parallel.engine=deepspeed; the model runs eager")
        # whole and final before initialize: DeepSpeed copies the weights into its fp32 master partitions
        self.model = materialize(model, env.device, load_weights)
        checkpoint_blocks(family.blocks(self.model), parallel.activation_checkpointing)
        optimizer = build_optimizer(self.model, optim, family.output_layers(self.model))
        config = deepspeed_config(parallel, train, optim, env.world_size, env.device, load_universal)
        self.engine, self.optimizer = initialize(self.model, optimizer, config, parallel.deepspeed_config, env)
        self.run = self.engine
        # the step divides the loss by the micro-batches itself, as it does for the other engines
        self.backward = functools.partial(self.engine.backward, scale_wrt_gas=False)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr, self.optim)

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        """One micro-batch's forward and backward run inside; then DeepSpeed counts it, and on the last one reduces
        the gradients, clips them (its gradient_clipping) and steps."""
        yield
        self.engine.step()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The gradient norm DeepSpeed clipped by in its last micro-step (to the same max_norm, from its config),
        as a 0-dim tensor on the device like the other engines' (DeepSpeed hands it over as a Python float)."""
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(0.0 if norm is None else norm, dtype=torch.float32, device=self.env.device)

    def optimizer_step(self, norm: torch.Tensor) -> torch.Tensor:
        """The step already happened inside DeepSpeed's last micro-step, which (without fp16 loss scaling)
        cannot skip it; whether its norm was finite, a 0-dim tensor on the device."""
        return torch.isfinite(norm)

    def parameters_finite(self) -> bool:
        """Whether this rank's partition of the fp32 master weights holds only finite values."""
        return all(bool(torch.isfinite(p).all()) for group in self.optimizer.param_groups for p in group["params"])

    def evaluate(self, fn: Callable[[nn.Module, Run], T]) -> T:
        return fn(self.model, self.engine)

    def train(self, mode: bool) -> None:
        self.engine.train(mode)

    def full_weights(self) -> contextlib.AbstractContextManager:
        """Every parameter whole on every rank inside the block (ZeRO-3 gathers them; stages 1-2 hold them)."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()))

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=DEEPSPEED_TAG)

    def load(self, directory: Path) -> None:
        tag = DEEPSPEED_TAG
        if self.load_universal:
            ensure_universal(directory, self.env)
            tag = UNIVERSAL_TAG
        with settings_kept(self.optimizer):
            path, _ = self.engine.load_checkpoint(str(directory), tag=tag, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"{directory / tag}: DeepSpeed found no checkpoint to load")
        # ZeRO-3's universal load gives the parameter groups one shared `step` tensor: AdamW then counts it up once
        # per group and step, and the second group's bias correction ran ahead (its updates 0.93x a step later)
        base = getattr(self.optimizer, "optimizer", self.optimizer)
        steps: set[int] = set()
        for state in base.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in steps:
                    state["step"] = step.clone()
                steps.add(id(state["step"]))
