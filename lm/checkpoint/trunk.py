"""Fine-tuning starts from a pretrained trunk: its weights (embeddings, blocks, final norm) come from a
checkpoint of the same family and the new head (`model.head` classify or regress) is drawn fresh.

A family that fine-tunes names its trunk parameters alike under every head (the encoder's, `lm.models.encoder`),
so the trunk is the checkpoint's state dict without its head (`TaskHead.is_param`), loaded by name; the keys
that choose the head (`TaskHead.keys`) may differ from the checkpoint's, no other. Any checkpoint form a run
can be scored from works: a run directory or step directory of any engine, or a consolidated .safetensors file.
"""

import dataclasses
import functools
from pathlib import Path

import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from lm.checkpoint.consolidated import load_consolidated, read_consolidated_config
from lm.checkpoint.model_weights import load_checkpoint_weights
from lm.checkpoint.resume import family_mismatch, model_diff
from lm.checkpoint.store import read_config, resolve_checkpoint
from lm.config import JobConfig
from lm.distributed.materialize import WeightLoader
from lm.errors import CheckpointError, ConfigError
from lm.models.config import ModelConfig
from lm.models.registry import family_of


def saved_config(path: Path) -> JobConfig:
    """The config of the checkpoint at `path` (a consolidated file, a run or a step directory)."""
    if path.suffix == ".safetensors":
        return read_consolidated_config(path)
    return read_config(resolve_checkpoint(path))


def check_trunk(saved: ModelConfig, current: ModelConfig, path: Path) -> None:
    """One error unless `saved` is of the family of `current` and its trunk is the one `current` describes."""
    if mismatch := family_mismatch(saved, current):
        raise ConfigError(f"checkpoint.init_from: {path} {mismatch}; model.head={current.task_head} fine-tunes a "
                          "pretrained checkpoint of its own family")
    head = family_of(current).training.head
    as_saved = dataclasses.replace(current, **{key: getattr(saved, key) for key in (head.keys if head else ())})
    if details := model_diff(saved, as_saved):
        raise ConfigError(f"checkpoint.init_from: {path} holds another {current.arch} ({details})")


def trunk_loader(path: Path, cfg: JobConfig) -> WeightLoader:
    """The loader that fills a fine-tuning model's trunk from the checkpoint at `path`, checked first."""
    check_trunk(saved_config(path).model, cfg.model, path)
    return functools.partial(load_trunk, path)


def load_trunk(path: Path, model: nn.Module) -> None:
    """Copy the trunk of the checkpoint at `path` into `model` (whole, or sharded by FSDP: each rank keeps its
    slices); the head keeps the weights it was drawn with. Every trunk parameter must be in the checkpoint."""
    head = family_of(model.cfg).training.head
    if path.suffix == ".safetensors":
        source, _ = load_consolidated(path, device="cpu")
    else:
        step_dir = resolve_checkpoint(path)
        saved = read_config(step_dir).model
        source = family_of(saved).build(saved)
        load_checkpoint_weights(step_dir, source)
    weights = source.state_dict()
    # in the model's order, the same on every rank: a sharded model scatters each tensor in a collective
    trunk = [name for name in model.state_dict() if head is None or not head.is_param(name)]
    missing = sorted(name for name in trunk if name not in weights)
    if missing:
        raise CheckpointError(f"{path}: lacks the trunk weights {missing[:5]} of this model")
    weights = {name: weights[name] for name in trunk}
    if any(isinstance(p, DTensor) for p in model.parameters()):
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        model.load_state_dict(weights, strict=False)
