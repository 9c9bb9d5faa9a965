"""A checkpoint's weights into a model on one process, from any engine's checkpoint at any world size.

- ddp and fsdp (`state.json` engine ddp or fsdp, or none in older checkpoints): the DCP shards,
  resharded to one process.
- deepspeed (engine deepspeed, ZeRO stage 1, 2 or 3): the fp32 master weights of the step directory's
  `deepspeed/` tag, merged from every rank's optimizer shard by DeepSpeed's own `zero_to_fp32`.
"""

import contextlib
import io
import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from lm.checkpoint.manifest import verify_checkpoint
from lm.checkpoint.store import read_state, reading
from lm.distributed.zero import DEEPSPEED_TAG
from lm.errors import CheckpointError
from lm.io import held_output

log = logging.getLogger("lm.checkpoint")


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


def fill_tied(weights: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Add the tied names a state dict leaves out (a strict load of `model` expects every name)."""
    for alias, name in tied_names(model).items():
        if alias not in weights and name in weights:
            weights[alias] = weights[name]


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model weights of a checkpoint saved at any world size, on one process."""
    model_sd = get_model_state_dict(model)
    dcp.load({"model": model_sd}, checkpoint_id=path)
    model.load_state_dict(model_sd)


def _deepspeed_state_dict(step_dir: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a DeepSpeed ZeRO checkpoint, merged over all of its ranks."""
    try:
        with held_output():  # DeepSpeed's import-time accelerator notice stays off an error path
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


def load_checkpoint_weights(step_dir: Path, model: nn.Module) -> None:
    """Load the weights of the checkpoint in `step_dir` (any engine, any world size) into `model`.

    `model` is the one its family builds from `read_config(step_dir).model`; every parameter must be present
    and of the right shape (strict). The files are first checked against the checkpoint's manifest, as a
    resume checks them, so every tool that reads weights refuses a damaged or changed file alike. Raises
    CheckpointError naming the directory or file when the files are damaged, cannot be read or do not fit
    the model.
    """
    verify_checkpoint(step_dir, require_manifest=False)
    state = read_state(step_dir)
    engine = state.get("engine", "ddp")  # checkpoints older than the engine key were all DDP
    with reading(step_dir, engine):
        if engine == "deepspeed":
            weights = _deepspeed_state_dict(step_dir)
            fill_tied(weights, model)
            model.load_state_dict(weights, strict=True)
        elif engine in ("ddp", "fsdp"):
            load_model_weights(step_dir, model)
        else:
            raise CheckpointError(f"{step_dir}: unknown engine {engine!r} in state.json")
