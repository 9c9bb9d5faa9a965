"""`python -m lm.consolidate --checkpoint RUN OUT.safetensors`: any checkpoint as one safetensors file.

Every engine's checkpoint goes in, on one process and without a process group:

- ddp and fsdp (`state.json` engine ddp or fsdp, or none in older checkpoints): the DCP shards, resharded
  to one process by `lm.checkpoint.load_model_weights`.
- deepspeed (engine deepspeed, ZeRO stage 1, 2 or 3): the fp32 master weights of the step directory's
  `deepspeed/` tag, merged from every rank's optimizer shard by DeepSpeed's own `zero_to_fp32`.

Out comes one file holding the model's fp32 weights under our parameter names, and in its metadata the
resolved config (`lm_config`, YAML), the step, the engine and the step directory it came from, so the
file alone is enough for `lm.eval`, `lm.sample` and `lm.export` (`load_consolidated` rebuilds the model).

A tied tensor is stored once: safetensors refuses tensors that share memory, so the output head of a
model with `tie_embeddings` (`lm_head.weight`, the same tensor as `wte.weight`, or `tgt_embed.weight` in
the encoder-decoder) is left out, and the `tied` metadata entry records it as `{"lm_head.weight":
"wte.weight"}`. `load_consolidated` builds the model, whose head is tied again, so nothing is lost.
"""

import argparse
import contextlib
import io
import json
import logging
import os
import secrets
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from lm.checkpoint import (
    DEEPSPEED_TAG, CheckpointError, load_model_weights, read_config, read_state, resolve_checkpoint,
    verify_checkpoint,
)
from lm.cli import run
from lm.config import ConfigError, JobConfig, load_config
from lm.models.factory import build_model

__all__ = [
    "consolidate", "load_checkpoint_weights", "load_consolidated", "load_consolidated_weights",
    "read_consolidated_config", "tied_names",
]

log = logging.getLogger("lm.consolidate")


def tied_names(model: nn.Module) -> dict[str, str]:
    """Parameters that are another parameter's tensor (a tied output head): {alias: name stored}.

    The name stored is the one `named_parameters()` meets first, e.g. {"lm_head.weight": "wte.weight"}.
    """
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _read_state(step_dir: Path) -> dict:
    try:
        state = read_state(step_dir)
    except (OSError, TypeError, ValueError) as err:
        raise CheckpointError(f"{step_dir / 'state.json'}: unreadable: {err}") from None
    if not isinstance(state.get("step"), int):
        raise CheckpointError(f"{step_dir / 'state.json'}: no integer step in it")
    return state


def _deepspeed_state_dict(step_dir: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a DeepSpeed ZeRO checkpoint, merged over all of its ranks."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as err:
        raise CheckpointError(f"{step_dir}: a deepspeed checkpoint needs DeepSpeed ({err}); install it with "
                              "`pip install -e .[deepspeed]` or `bash launch/setup.sh --deepspeed`") from None
    if not (step_dir / DEEPSPEED_TAG).is_dir():
        raise CheckpointError(f"{step_dir}: state.json says engine deepspeed but there is no {DEEPSPEED_TAG}/ "
                              "directory of DeepSpeed files")
    chatter = io.StringIO()  # zero_to_fp32 prints and draws progress bars; keep them out of our one-line log
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag=DEEPSPEED_TAG)
    log.debug("zero_to_fp32: %s", chatter.getvalue().strip())
    return state_dict


def _fill_tied(weights: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Add the tied names a state dict leaves out (a strict load of `model` expects every name)."""
    for alias, name in tied_names(model).items():
        if alias not in weights and name in weights:
            weights[alias] = weights[name]


def load_checkpoint_weights(step_dir: Path, model: nn.Module) -> None:
    """Load the weights of the checkpoint in `step_dir` (any engine, any world size) into `model`.

    `model` is the one `build_model(read_config(step_dir).model)` gives; every parameter must be present
    and of the right shape (strict). Raises CheckpointError naming the directory when the files cannot
    be read or do not fit the model.
    """
    state = _read_state(step_dir)
    engine = state.get("engine", "ddp")  # checkpoints older than the engine key were all DDP
    try:
        if engine == "deepspeed":
            weights = _deepspeed_state_dict(step_dir)
            _fill_tied(weights, model)
            model.load_state_dict(weights, strict=True)
        elif engine in ("ddp", "fsdp"):
            load_model_weights(step_dir, model)
        else:
            raise CheckpointError(f"{step_dir}: unknown engine {engine!r} in state.json")
    except CheckpointError:
        raise
    # a missing or corrupt file, or weights that do not fit the config; DCP's own exception is a
    # BaseException holding each rank's error with its traceback: report the first error alone
    except (Exception, dcp.CheckpointException) as err:
        cause = next(iter(err.failures.values()))[0] if isinstance(err, dcp.CheckpointException) else err
        detail = str(cause).strip()
        raise CheckpointError(f"{step_dir}: cannot read the {engine} checkpoint: {type(cause).__name__}"
                              f"{': ' + detail if detail else ''}") from err


def _output_problem(out: Path, force: bool) -> str | None:
    if out.suffix != ".safetensors":
        return f"{out}: the output must be a .safetensors file"
    if out.is_dir():
        return f"{out}: is a directory; name the .safetensors file to write"
    if out.exists() and not force:
        return f"{out}: exists; pass --force to replace it"
    return None


def consolidate(checkpoint: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the checkpoint `checkpoint` (run dir, checkpoints/ or step dir) as one safetensors file `out`.

    The file appears whole or not at all (written beside `out`, then renamed). Returns the step dir read.
    """
    out = Path(out)
    if problem := _output_problem(out, force):
        raise CheckpointError(problem)
    step_dir = resolve_checkpoint(checkpoint)
    verify_checkpoint(step_dir)
    state = _read_state(step_dir)
    cfg = read_config(step_dir)
    model = build_model(cfg.model)
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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
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
    text = _metadata(path)["lm_config"]
    with tempfile.TemporaryDirectory() as tmp:  # load_config validates a file; the config text is one
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(text)
        try:
            return load_config(config_file)
        except ConfigError as err:
            raise ConfigError(f"{path}: the stored config is invalid: {err}") from None


def load_consolidated_weights(path: str | Path, model: nn.Module) -> None:
    """Load a consolidated file's weights into `model` (built from the same model config; strict)."""
    path = Path(path)
    _metadata(path)
    try:
        weights = load_file(str(path), device="cpu")
        _fill_tied(weights, model)
        model.load_state_dict(weights, strict=True)
    except (SafetensorError, RuntimeError) as err:
        raise CheckpointError(f"{path}: its weights do not fit the model: {str(err).strip()}") from None


def load_consolidated(path: Path, device: torch.device) -> tuple[nn.Module, JobConfig]:
    """Build the model a consolidated file describes and load its weights; returns (model in eval mode, config)."""
    cfg = read_consolidated_config(path)
    model = build_model(cfg.model)
    load_consolidated_weights(path, model)
    return model.to(device).eval(), cfg


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lm.consolidate",
        description="Consolidate a checkpoint of any engine (ddp, fsdp, deepspeed ZeRO 1-3) and world size into "
                    "one safetensors file holding the fp32 weights and the run's config, which lm.eval, lm.sample "
                    "and lm.export read on a single process. A tied output head is stored once.",
    )
    parser.add_argument("--checkpoint", required=True,
                        help="run directory, its checkpoints/ or one step_XXXXXXXX directory")
    parser.add_argument("out", type=Path, metavar="OUT", help="the .safetensors file to write")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    if problem := _output_problem(args.out, args.force):
        parser.error(problem)
    consolidate(args.checkpoint, args.out, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
