"""Fine-tuning starts from a pretrained encoder: its trunk (embeddings, blocks, final norm) comes from the
checkpoint and the new head (`model.head` classify or regress) is drawn fresh.

The encoder's trunk parameters have the same names under every head (`lm.models.encoder`), so the trunk is
the checkpoint's state dict without its MLM head, loaded by name. Any checkpoint form a run can be scored
from works: a run directory or step directory of any engine, or a consolidated .safetensors file.
"""

import dataclasses
import functools
from pathlib import Path

import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from lm.checkpoint.consolidated import load_consolidated, read_consolidated_config
from lm.checkpoint.resume import ARCH_NAMES, model_diff
from lm.checkpoint.store import read_config, resolve_checkpoint
from lm.checkpoint.weights import load_checkpoint_weights
from lm.config import JobConfig
from lm.distributed.weights import WeightLoader
from lm.errors import CheckpointError, ConfigError
from lm.hf.importing import is_hf_checkpoint
from lm.models.config import ModelConfig
from lm.models.factory import build_model

HEAD_KEYS = ("head", "num_classes", "pooling")
"""Model keys that choose the head, not the trunk: free to differ between a checkpoint and its fine-tuning"""


def saved_config(path: Path) -> JobConfig:
    """The config of the encoder checkpoint at `path` (a consolidated file, a run or a step directory)."""
    if is_hf_checkpoint(path):
        raise ConfigError(f"checkpoint.init_from: {path} is a Hugging Face checkpoint; fine-tuning starts from an "
                          "lm encoder checkpoint (a run directory, a step directory or a consolidated .safetensors)")
    if path.suffix == ".safetensors":
        return read_consolidated_config(path)
    return read_config(resolve_checkpoint(path))


def check_trunk(saved: ModelConfig, current: ModelConfig, path: Path) -> None:
    """One error unless `saved` is an encoder whose trunk is the one `current` describes."""
    if saved.arch != "encoder":
        raise ConfigError(f"checkpoint.init_from: {path} holds {ARCH_NAMES[saved.arch]} (model.arch={saved.arch}); "
                          f"model.head={current.head} fine-tunes an encoder's checkpoint (model.arch=encoder)")
    as_saved = dataclasses.replace(current, **{key: getattr(saved, key) for key in HEAD_KEYS})
    if details := model_diff(saved, as_saved):
        raise ConfigError(f"checkpoint.init_from: {path} holds another encoder ({details})")


def trunk_loader(path: Path, cfg: JobConfig) -> WeightLoader:
    """The loader that fills a fine-tuning model's trunk from the encoder checkpoint at `path`, checked first."""
    check_trunk(saved_config(path).model, cfg.model, path)
    return functools.partial(load_trunk, path)


def load_trunk(path: Path, model: nn.Module) -> None:
    """Copy the trunk of the checkpoint at `path` into `model` (whole, or sharded by FSDP: each rank keeps its
    slices); the head keeps the weights it was drawn with. Every trunk parameter must be in the checkpoint."""
    if path.suffix == ".safetensors":
        source, _ = load_consolidated(path, device="cpu")
    else:
        step_dir = resolve_checkpoint(path)
        source = build_model(read_config(step_dir).model)
        load_checkpoint_weights(step_dir, source)
    weights = source.state_dict()
    # in the model's order, the same on every rank: a sharded model scatters each tensor in a collective
    trunk = [name for name in model.state_dict() if not _is_head(name)]
    missing = sorted(name for name in trunk if name not in weights)
    if missing:
        raise CheckpointError(f"{path}: lacks the trunk weights {missing[:5]} of this model")
    weights = {name: weights[name] for name in trunk}
    if any(isinstance(p, DTensor) for p in model.parameters()):
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        model.load_state_dict(weights, strict=False)


def _is_head(name: str) -> bool:
    return name.startswith("score.")
