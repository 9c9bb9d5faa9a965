"""The consolidated format: a checkpoint of any engine as one safetensors file.

The file holds the model's fp32 weights under our parameter names, and in its metadata the resolved
config (`lm_config`, YAML), the step, the engine and the step directory it came from, so the file alone
is enough for `lm.eval`, `lm.sample`, `lm.export` and `checkpoint.init_from` (`load_consolidated`
rebuilds the model).

A tied tensor is stored once: safetensors refuses tensors that share memory, so the output head of a
model with `tie_embeddings` (`lm_head.weight`, the same tensor as `wte.weight`, or `tgt_embed.weight` in
the encoder-decoder) is left out, and the `tied` metadata entry records it as `{"lm_head.weight":
"wte.weight"}`. Loading ties the head again, so nothing is lost.
"""

import json
import logging
from pathlib import Path

import torch
import torch.nn as nn
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from lm.checkpoint.model_weights import fill_tied, load_checkpoint_weights, tied_names
from lm.checkpoint.store import enclosing_checkpoint, read_config, read_state, resolve_checkpoint
from lm.config import JobConfig, config_from_yaml
from lm.errors import CheckpointError, ConfigError
from lm.io import atomic_path, output_file_problem
from lm.models.registry import family_of

log = logging.getLogger("lm.consolidate")


def output_problem(out: Path, force: bool) -> str | None:
    """Why `out` may not be written, or None: not inside a checkpoint, whose retention would delete it."""
    if out.suffix != ".safetensors":
        return f"{out}: the output must be a .safetensors file"
    if problem := output_file_problem(out):
        return problem
    if (step := enclosing_checkpoint(out)) is not None:
        return f"{out}: is inside the checkpoint {step}; write it elsewhere"
    if out.exists() and not force:
        return f"{out}: exists; pass --force to replace it"
    return None


def consolidate(checkpoint: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the checkpoint `checkpoint` (run dir, checkpoints/ or step dir) as one safetensors file `out`.

    The file appears whole or not at all (written beside `out`, then renamed). Returns the step dir read.
    """
    out = Path(out)
    if problem := output_problem(out, force):
        raise CheckpointError(problem)
    step_dir = resolve_checkpoint(checkpoint)
    state = read_state(step_dir)
    cfg = read_config(step_dir)
    model = family_of(cfg.model).build(cfg.model)
    load_checkpoint_weights(step_dir, model)

    aliases = tied_names(model)
    # The model's own tensors: loading copied the weights out of ZeRO's flat buffers, whose views
    # safetensors would refuse as shared memory, so only the tied aliases are left to drop.
    tensors = {name: tensor.detach().to(torch.float32).contiguous()
               for name, tensor in model.state_dict().items() if name not in aliases}
    metadata = {
        "format": "pt",
        "lm_config": yaml.safe_dump(cfg.to_dict(), sort_keys=False),
        "step": str(state["step"]),
        "engine": state.get("engine", "ddp"),
        "source": str(step_dir.resolve()),
        "tied": json.dumps(aliases),
    }
    with atomic_path(out) as tmp:
        save_file(tensors, tmp, metadata=metadata)
    n_params = sum(t.numel() for t in tensors.values())
    log.info("consolidated %s (step %d, engine %s) into %s: %d tensors, %.2fM parameters, %.1f MB",
             step_dir, state["step"], metadata["engine"], out, len(tensors), n_params / 1e6,
             out.stat().st_size / 1e6)
    return step_dir


def _metadata(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file: {err}") from None
    if "lm_config" not in metadata:
        raise CheckpointError(f"{path}: a safetensors file without an lm_config entry in its metadata; "
                              "write one with `python -m lm.consolidate`")
    return metadata


def read_consolidated_config(path: str | Path) -> JobConfig:
    """The config stored in a consolidated file, validated like any other; reads only the file's header."""
    path = Path(path)
    try:
        return config_from_yaml(_metadata(path)["lm_config"], path)
    except ConfigError as err:
        raise ConfigError(f"{path}: the stored config is invalid: {err}") from None


def load_consolidated_weights(path: str | Path, model: nn.Module) -> None:
    """Load a consolidated file's weights into `model` (built from the same model config; strict), whole or
    sharded by FSDP: every rank reads the file whole and a sharded model keeps its slices of each tensor."""
    path = Path(path)
    _metadata(path)
    try:
        weights = load_file(str(path), device="cpu")
        fill_tied(weights, model)
        if any(isinstance(p, DTensor) for p in model.parameters()):
            set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
        else:
            model.load_state_dict(weights, strict=True)
    except (SafetensorError, RuntimeError) as err:
        # torch's message spans lines (a header, then the keys): one line, as every error of a tool is
        raise CheckpointError(f"{path}: its weights do not fit the model: {' '.join(str(err).split())}") from None


def load_consolidated(path: Path, device: torch.device) -> tuple[nn.Module, JobConfig]:
    """Build the model a consolidated file describes and load its weights; returns (model in eval mode, config)."""
    cfg = read_consolidated_config(path)
    model = family_of(cfg.model).build(cfg.model)
    load_consolidated_weights(path, model)
    return model.to(device).eval(), cfg
