"""A checkpoint, in whatever form, as a model ready to score or sample on one process."""

from pathlib import Path

import torch
import torch.nn as nn

from lm.checkpoint.consolidated import load_consolidated
from lm.checkpoint.manifest import verify_checkpoint
from lm.checkpoint.store import read_config, resolve_checkpoint
from lm.checkpoint.weights import load_checkpoint_weights
from lm.config import JobConfig
from lm.models.factory import build_model


def load_for_inference(path: str | Path, device: torch.device) -> tuple[nn.Module, JobConfig, Path]:
    """Build the model a checkpoint describes and load its weights; returns (model, config, source).

    `path`: a run directory, its checkpoints/ or one step directory of any engine (DeepSpeed's are
    merged by zero_to_fp32), or a consolidated .safetensors file. A step directory is verified against
    its manifest first: a damaged one raises CheckpointError naming the file.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        model, cfg = load_consolidated(path, device)
        return model, cfg, path
    step_dir = resolve_checkpoint(path)
    verify_checkpoint(step_dir, require_manifest=False)
    cfg = read_config(step_dir)
    model = build_model(cfg.model)
    load_checkpoint_weights(step_dir, model)
    return model.to(device).eval(), cfg, step_dir
