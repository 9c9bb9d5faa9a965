"""Sharded checkpoints through torch.distributed.checkpoint (DCP).

Layout of a run directory:

    <out_dir>/config.yaml                  resolved config of the run
    <out_dir>/checkpoints/step_00000300/   one complete checkpoint
        .metadata, __<rank>_0.distcp       ddp, fsdp: DCP model and optimizer, each rank its own shard
        deepspeed/, latest                 deepspeed: the engine's own checkpoint (tag "deepspeed")
        rng_rank<r>.pt                     each rank's RNG states
        state.json                         step, loader position, tokens seen, world size, engine
        config.yaml                        the config that wrote it

ddp and fsdp write the same DCP format, so either resumes the other's checkpoints at any world size.

A checkpoint is written under `step_XXXXXXXX.tmp` and renamed into place by rank 0 only after every
rank has finished, so a directory without the suffix and with a state.json is always complete.
"""

import json
import logging
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from lm.config import ConfigError, JobConfig, load_config, save_config
from lm.distributed.env import DistEnv

log = logging.getLogger(__name__)

ARCH_NAMES = {"gpt": "decoder-only GPT", "encdec": "encoder-decoder"}
DEEPSPEED_TAG = "deepspeed"
"""Subdirectory (DeepSpeed's checkpoint tag) of a step directory holding a DeepSpeed engine's files."""
UNIVERSAL_TAG = "deepspeed_universal"
"""Its conversion to DeepSpeed's universal format, made when a run resumes at another world size or stage."""

_STEP_DIR = re.compile(r"^step_(\d{8})$")


# DCP warns on every single-process save and load (eval, sample, a run without torchrun); that is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message names the path."""


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a run directory, its checkpoints/ directory or one step directory; return the step dir."""
    path = Path(path)
    if (path / "state.json").is_file():
        return path
    for root in (path, checkpoint_root(path)):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointError(
        f"{path}: no complete checkpoint (expected a step_XXXXXXXX directory with state.json, "
        f"or a run directory containing checkpoints/)"
    )


def read_state(path: Path) -> dict:
    """state.json; checkpoints from before the engine switch were written by ddp."""
    return {"engine": "ddp", **json.loads((path / "state.json").read_text())}


def check_engine(path: Path, cfg: JobConfig, world_size: int) -> bool:
    """Refuse a checkpoint another engine family wrote; True when a DeepSpeed checkpoint must first be
    converted to DeepSpeed's universal format (another world size or ZeRO stage)."""
    state = read_state(path)
    saved, wanted = state["engine"], cfg.parallel.engine
    if (saved == "deepspeed") != (wanted == "deepspeed"):
        raise CheckpointError(
            f"{path}: written by the {saved} engine, and parallel.engine is {wanted}; engines other than "
            f"ddp/fsdp cannot read each other's checkpoints. Consolidate it (python -m lm.consolidate "
            f"--checkpoint {path} OUT.safetensors) and start a new run from its weights with "
            f"checkpoint.init_from=OUT.safetensors, or resume with parallel.engine={saved}"
        )
    return saved == "deepspeed" and (state["world_size"] != world_size or state.get("zero_stage") != cfg.parallel.zero_stage)


def read_config(path: Path) -> JobConfig:
    """The config a checkpoint was written with, validated like any other config."""
    return load_config(path / "config.yaml")


def save_checkpoint(root: Path, step: int, engine, state: dict, cfg: JobConfig, env: DistEnv, keep: int) -> Path:
    """Collectively write one checkpoint; every rank must call this. Returns the final directory."""
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a save that crashed; never a complete checkpoint
            shutil.rmtree(tmp)
        tmp.mkdir()
    env.barrier()
    engine.save(tmp)
    rng = {"cpu": torch.get_rng_state()}
    if env.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(env.device)
    torch.save(rng, tmp / f"rng_rank{env.rank}.pt")
    env.barrier()
    if env.is_main:
        save_config(cfg, tmp / "config.yaml")
        meta = {"world_size": env.world_size, "engine": cfg.parallel.engine}
        if cfg.parallel.engine == "deepspeed":
            meta["zero_stage"] = cfg.parallel.zero_stage
        (tmp / "state.json").write_text(json.dumps({**state, **meta}, indent=2))
        if final.exists():  # the same step saved again after a resume: the new one replaces it
            shutil.rmtree(final)
        tmp.rename(final)
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
        log.info("saved checkpoint %s", final)
    env.barrier()
    return final


def ensure_universal(path: Path, env: DistEnv) -> None:
    """Give a DeepSpeed checkpoint a universal twin (`deepspeed_universal/`), which loads at any world
    size and ZeRO stage; rank 0 converts once, into a temporary directory renamed when complete."""
    from lm.distributed.zero import convert_to_universal

    if env.is_main and not (path / UNIVERSAL_TAG).is_dir():
        log.info("%s: converting the DeepSpeed checkpoint to a universal one for another world size or stage", path)
        tmp_tag = UNIVERSAL_TAG + ".tmp"
        shutil.rmtree(path / tmp_tag, ignore_errors=True)
        convert_to_universal(path, DEEPSPEED_TAG, tmp_tag)
        (path / tmp_tag).rename(path / UNIVERSAL_TAG)
    env.barrier()


def load_checkpoint(path: Path, engine, env: DistEnv) -> dict:
    """Load model and optimizer through the engine (resharded to this world size) and this rank's RNG;
    return state.json."""
    state = read_state(path)
    engine.load(path, state)
    rng_file = path / f"rng_rank{env.rank}.pt"
    if state["world_size"] == env.world_size and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and env.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], env.device)
    else:
        log.warning("world size changed (%d -> %d): RNG states start fresh", state["world_size"], env.world_size)
    return state


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model weights of a checkpoint saved at any world size, on one process."""
    model_sd = get_model_state_dict(model)
    dcp.load({"model": model_sd}, checkpoint_id=path)
    model.load_state_dict(model_sd)


def check_compatible(path: Path, cfg: JobConfig) -> None:
    """Refuse to resume a checkpoint whose architecture or model shape differs from the current config.

    Keys missing from an older checkpoint's config take their defaults, as they did when it was written.
    """
    saved = read_config(path).to_dict()["model"]
    current = cfg.to_dict()["model"]
    if saved["arch"] != current["arch"]:
        raise ConfigError(f"{path}: checkpoint is a {ARCH_NAMES[saved['arch']]} (model.arch={saved['arch']}) "
                          f"but the config asks for a {ARCH_NAMES[current['arch']]} (model.arch={current['arch']}); "
                          "use another train.out_dir to start a new run")
    diff = sorted(k for k in current if saved[k] != current[k] and k != "dropout")
    if diff:
        details = ", ".join(f"model.{k}: {saved[k]!r} -> {current[k]!r}" for k in diff)
        raise ConfigError(f"{path}: checkpoint has a different model shape ({details}); "
                          "use another train.out_dir to start a new run")


def check_init_from(path: Path, cfg: JobConfig) -> None:
    """Refuse a consolidated file (checkpoint.init_from) whose model differs from the config's."""
    from lm.consolidate import read_consolidated_config

    saved = read_consolidated_config(path).to_dict()["model"]
    current = cfg.to_dict()["model"]
    diff = sorted(k for k in current if saved[k] != current[k] and k != "dropout")
    if diff:
        details = ", ".join(f"model.{k}: {saved[k]!r} -> {current[k]!r}" for k in diff)
        raise ConfigError(f"checkpoint.init_from: {path} holds a different model ({details})")


def load_for_inference(path: str | Path, device: torch.device) -> tuple[nn.Module, JobConfig, Path]:
    """Build the model a checkpoint describes and load its weights; returns (model, config, source).

    `path`: a run directory, its checkpoints/ or one step directory of any engine (DeepSpeed's are
    merged by zero_to_fp32), or a consolidated .safetensors file.
    """
    from lm.consolidate import load_checkpoint_weights, load_consolidated
    from lm.models.factory import build_model

    path = Path(path)
    if path.suffix == ".safetensors":
        model, cfg = load_consolidated(path, device)
        return model, cfg, path
    step_dir = resolve_checkpoint(path)
    cfg = read_config(step_dir)
    model = build_model(cfg.model)
    load_checkpoint_weights(step_dir, model)
    return model.to(device).eval(), cfg, step_dir
