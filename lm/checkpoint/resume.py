"""Resuming a run: which checkpoint (checkpoint.resume), whether it fits the config and the data, and
loading it through the engine. A checkpoint is refused, with the command that gets around it, when its
model, its optimizer, its engine family or (unless checkpoint.allow_data_change) its data differ from the
run's."""

import logging
from dataclasses import asdict
from pathlib import Path

import torch

from lm.checkpoint.manifest import verify_checkpoint
from lm.checkpoint.store import published_checkpoints, read_config, read_state, reading, restore_replaced
from lm.config import JobConfig, config_diff
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.errors import CheckpointError, ConfigError
from lm.models.config import ModelConfig

log = logging.getLogger("lm.checkpoint")


def find_resume(root: Path, mode: str, env: DistEnv, allow_unverified: bool = False) -> Path | None:
    """The checkpoint a run resumes from under checkpoint.resume=`mode` (auto, never, required), or None
    to start fresh: the newest one that verifies, corrupt or incomplete ones skipped with a warning (and ones
    without a manifest, unless `allow_unverified`). Every rank calls it."""
    found = published_checkpoints(root)
    if mode == "required" and not found:
        raise CheckpointError(f"checkpoint.resume=required, but {root} holds no complete checkpoint")
    if mode == "never" and found:
        raise CheckpointError(
            f"checkpoint.resume=never, but {root} already holds checkpoints that a new "
            "run would overwrite; pick another train.out_dir or use checkpoint.resume=auto"
        )
    return latest_valid_checkpoint(root, env, allow_unverified) if found and mode != "never" else None


def check_resume(path: Path, cfg: JobConfig, data: dict, env: DistEnv) -> bool:
    """Refuse a checkpoint that does not fit the run (model, data, engine family); True when the engine
    must load the DeepSpeed checkpoint's universal form (which the engine makes when it loads, if it is not
    there yet)."""
    resumable_state(path)
    check_compatible(path, cfg)
    check_optimizer(path, cfg)
    check_data(path, data, cfg)
    return check_engine(path, cfg, env.world_size)


def latest_valid_checkpoint(root: Path, env: DistEnv | None = None, allow_unverified: bool = False) -> Path | None:
    """The newest checkpoint under `root` that verifies, or None when there is none at all.

    Each one skipped is logged with the reason; raises CheckpointError listing them when checkpoints
    exist but none verifies. With `env`, every rank must call this: rank 0 verifies and broadcasts its
    choice, so all ranks resume from the same checkpoint.
    """
    choice, error = None, None
    if env is None or env.is_main:
        if root.is_dir():
            restore_replaced(root)
        found = published_checkpoints(root)
        problems = []
        for path in reversed(found):
            try:
                verify_checkpoint(path, require_manifest=not allow_unverified)
            except CheckpointError as err:
                log.warning("skipping checkpoint %s: %s", path, err)
                problems.append(str(err))
                continue
            choice = path
            break
        if found and choice is None:
            error = f"no usable checkpoint in {root}: " + "; ".join(problems)
    if env is not None:
        choice, error = env.broadcast_object((choice, error))
    if error is not None:
        raise CheckpointError(error)
    return choice


def resumable_state(path: Path) -> dict:
    """state.json of a checkpoint to resume, with what resuming reads from it: with no manifest to tell that
    it was edited (checkpoint.allow_unverified), a missing or mistyped key is refused by name."""
    state = read_state(path)
    optional = {"skipped_steps": 0, "skipped_in_a_row": 0}  # absent in checkpoints from before they were kept
    for key, least in (("world_size", 1), ("tokens_seen", 0), ("position", 0), *optional.items()):
        value = state.get(key, optional.get(key))
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise CheckpointError(f"{path / 'state.json'}: {key} must be an integer >= {least}, got "
                                  f"{state.get(key)!r}")
    if not isinstance(state.get("elapsed_s", 0.0), (int, float)) or not isinstance(state["engine"], str):
        raise CheckpointError(f"{path / 'state.json'}: elapsed_s must be a number and engine a name")
    return state


def check_engine(path: Path, cfg: JobConfig, world_size: int) -> bool:
    """Refuse a checkpoint another engine family wrote; True when a DeepSpeed checkpoint must first be
    converted to DeepSpeed's universal format (another world size, or between ZeRO stages 1 and 2)."""
    state = read_state(path)
    saved, wanted = state["engine"], cfg.parallel.engine
    if (saved == "deepspeed") != (wanted == "deepspeed"):
        raise CheckpointError(
            f"{path}: written by the {saved} engine, and parallel.engine is {wanted}; engines other than "
            f"ddp/fsdp cannot read each other's checkpoints. Consolidate it (python -m lm.consolidate "
            f"--checkpoint {path} OUT.safetensors) and start a new run from its weights with "
            f"checkpoint.init_from=OUT.safetensors, or resume with parallel.engine={saved}"
        )
    if saved != "deepspeed":
        return False
    stage, wanted_stage = state.get("zero_stage"), cfg.parallel.zero_stage
    if stage is not None and (stage == 3) != (wanted_stage == 3):
        # the universal form keeps the writing stage's file names, which the other kind of stage does not look for
        raise CheckpointError(
            f"{path}: written under ZeRO stage {stage}, and parallel.zero_stage is {wanted_stage}; DeepSpeed "
            f"resumes between stages 1 and 2 but not between either and stage 3. Resume with "
            f"parallel.zero_stage={stage}, or consolidate it (python -m lm.consolidate --checkpoint {path} "
            f"OUT.safetensors) and start a new run from its weights with checkpoint.init_from=OUT.safetensors"
        )
    return state["world_size"] != world_size or stage != wanted_stage


def load_checkpoint(path: Path, engine: Engine, env: DistEnv) -> dict:
    """Load model and optimizer through the engine (resharded to this world size) and this rank's RNG;
    return state.json."""
    state = resumable_state(path)
    with reading(path, state["engine"]):  # a file damaged where no manifest could tell (allow_unverified)
        engine.load(path)
    rng_file = path / f"rng_rank{env.rank}.pt"
    if state["world_size"] == env.world_size and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and env.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], env.device)
    else:
        log.warning("world size changed (%d -> %d): RNG states start fresh", state["world_size"], env.world_size)
    return state


def check_compatible(path: Path, cfg: JobConfig) -> None:
    """Refuse to resume a checkpoint whose architecture or model shape differs from the current config.

    Keys missing from an older checkpoint's config take their defaults, as they did when it was written.
    """
    saved, current = read_config(path).model, cfg.model
    if mismatch := family_mismatch(saved, current):
        raise ConfigError(f"{path}: checkpoint {mismatch}; use another train.out_dir to start a new run")
    if details := model_diff(saved, current):
        raise ConfigError(f"{path}: checkpoint has a different model shape ({details}); "
                          "use another train.out_dir to start a new run")


def check_optimizer(path: Path, cfg: JobConfig) -> None:
    """Refuse a checkpoint of another optimizer (optim.name): AdamW's moments and Muon's momentum buffers are
    different state, and neither can start from the other's."""
    saved = read_config(path).optim.name
    if saved != cfg.optim.name:
        raise ConfigError(
            f"{path}: its optimizer state is {saved}'s and optim.name is {cfg.optim.name}; resume with "
            f"optim.name={saved}, or consolidate it (python -m lm.consolidate --checkpoint {path} OUT.safetensors) "
            f"and start a new run from its weights with checkpoint.init_from=OUT.safetensors"
        )


def family_mismatch(saved: ModelConfig, current: ModelConfig) -> str:
    """`is an encoder (model.arch=encoder) but the config asks for a decoder-only GPT (model.arch=gpt)` when a
    checkpoint's model (`saved`) is of another family than the config's; empty when both are of one."""
    if saved.arch == current.arch:
        return ""
    return (f"is {saved.title} (model.arch={saved.arch}) but the config asks for {current.title} "
            f"(model.arch={current.arch})")


def model_diff(saved: ModelConfig, current: ModelConfig) -> str:
    """The model keys whose values differ, `model.key: old -> new, ...` in key order; the training settings that
    change no weight (`ModelConfig.free_keys`: dropout, loss_chunk, ...) left out. Empty when the models have
    the same shape."""
    diff = config_diff({"model": asdict(saved)}, {"model": asdict(current)},
                       ignore=tuple(f"model.{key}" for key in current.free_keys(saved)))
    return ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in sorted(diff.items()))


def check_data(path: Path, current: dict, cfg: JobConfig) -> None:
    """Refuse to resume on data other than the checkpoint's unless checkpoint.allow_data_change is set.
    `current` is what state.json records of the data ({"content_hash", "source", "train_tokens"}: the
    trainer's `TrainingData.identity()`). Checkpoints from before state.json recorded its data are not checked."""
    saved = read_state(path).get("data")
    if cfg.task.file:  # a fine-tuning head trains on a labelled file, not on shards
        key, where = "task.file", f"task.file={cfg.task.file!r}"
    else:
        key = "data.mixture" if cfg.data.mixture else "data.dir"
        where = key if cfg.data.mixture else f"data.dir={cfg.data.dir!r}"
    if cfg.task.file:
        check_task_rows(path, cfg)
    check_order(path, cfg)
    if saved is None or saved["content_hash"] == current["content_hash"]:
        return
    unit = "train rows" if cfg.task.file else "train tokens"  # what TaskData.identity() counts instead
    what = (f"{path} trained on {saved['source']!r} ({saved['train_tokens']:,} {unit}, content hash "
            f"{saved['content_hash'][:12]}), but {where} now holds {current['source']!r} "
            f"({current['train_tokens']:,} {unit}, content hash {current['content_hash'][:12]})")
    if not cfg.checkpoint.allow_data_change:
        raise CheckpointError(f"{what}. Prepare the original data again, point {key} at it, or set "
                              "checkpoint.allow_data_change=true to go on with the new data")
    log.warning("%s; going on with the new data (checkpoint.allow_data_change=true)", what)


TASK_ROWS = ("val_fraction", "text_column", "label_column")
"""The task keys that choose what a fine-tuning run trains on out of task.file: its train rows and what they hold."""


def check_task_rows(path: Path, cfg: JobConfig) -> None:
    """Refuse to resume a fine-tuning run whose task.file is read otherwise than the checkpoint read it (another
    task.val_fraction scores rows the run trained on as validation, and moves the loader's position onto other
    rows; another column trains on other texts or labels), unless checkpoint.allow_data_change is set."""
    saved = read_config(path).task
    changed = [f"task.{key}={getattr(saved, key)!r}, now {getattr(cfg.task, key)!r}" for key in TASK_ROWS
               if getattr(saved, key) != getattr(cfg.task, key)]
    if not changed:
        return
    what = f"{path} trained on the rows of {cfg.task.file!r} read with {'; '.join(changed)}"
    if not cfg.checkpoint.allow_data_change:
        raise CheckpointError(f"{what}. Resume with the checkpoint's settings, use another train.out_dir, or set "
                              "checkpoint.allow_data_change=true to go on with the new rows")
    log.warning("%s; going on with the new rows (checkpoint.allow_data_change=true)", what)


ORDER = ("train.seed", "data.seq_len")
"""The keys that decide which samples the loader's saved position stands for: the seed of the shuffle, and the
windows the shards are cut into (a fine-tuning run reads whole rows: its seed alone)."""


def check_order(path: Path, cfg: JobConfig) -> None:
    """Refuse to resume in another sample order than the checkpoint's unless checkpoint.allow_data_change is set:
    its position would point elsewhere in the data, and the rest of the epoch would read again samples the run
    has read and never read others."""
    saved = read_config(path)
    keys = ORDER[:1] if cfg.task.file else ORDER
    changed = [f"{key}={_value(saved, key)!r}, now {_value(cfg, key)!r}" for key in keys
               if _value(saved, key) != _value(cfg, key)]
    if not changed:
        return
    what = (f"{path} read its samples in the order of {'; '.join(changed)}: the rest of its epoch would read "
            "again samples it has read, and never others")
    if not cfg.checkpoint.allow_data_change:
        raise CheckpointError(f"{what}. Resume with the checkpoint's settings, use another train.out_dir, or set "
                              "checkpoint.allow_data_change=true to go on in the new order")
    log.warning("%s; going on in the new order (checkpoint.allow_data_change=true)", what)


def _value(cfg: JobConfig, key: str) -> object:
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def changed_settings(checkpoint: Path, cfg: JobConfig) -> dict[str, tuple[object, object]]:
    """Config keys outside `model` whose value differs from the checkpoint's: {"optim.lr": (old, new)}."""
    return config_diff(read_config(checkpoint).to_dict(), cfg.to_dict(), ignore=("model",))
