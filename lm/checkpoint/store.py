"""The store of a run's checkpoints: naming, listing, writing, publishing and pruning step directories.

Layout of a run directory:

    <out_dir>/config.yaml                  resolved config of the run
    <out_dir>/checkpoints/step_00000300/   one complete checkpoint
        .metadata, __<rank>_0.distcp       ddp, fsdp: DCP model and optimizer, each rank its own shard
        deepspeed/, latest                 deepspeed: the engine's own checkpoint (tag "deepspeed")
        rng_rank<r>.pt                     each rank's RNG states
        config.yaml                        the config that wrote it
        manifest.json                      size and sha256 of every file above (`lm.checkpoint.manifest`)
        state.json                         step, loader position, tokens seen, world size, engine

ddp and fsdp write the same DCP format, so either resumes the other's checkpoints at any world size.

A checkpoint is written under `step_XXXXXXXX.tmp`; rank 0 writes manifest.json and then state.json only
after every rank has finished, and renames the directory into place last (`lm.io.publish_dir`), so a
directory without a suffix and with a state.json is always complete. A kill at any moment of a save
leaves the previous checkpoints as they were: a same-step checkpoint being replaced waits under
`.replaced` (restored when the store is next read if the kill came between the two renames), and an old
checkpoint is renamed to `.deleting` before it is deleted, so a half-deleted one never looks complete.
"""

import json
import logging
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from lm.checkpoint.manifest import write_manifest
from lm.config import JobConfig, read_stored_config, save_config
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.errors import CheckpointError
from lm.io import REPLACED_SUFFIX, publish_dir

log = logging.getLogger("lm.checkpoint")

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LEFTOVER = re.compile(r"^step_\d{8}\.(tmp|deleting|replaced)$")

# DCP warns on every single-process save and load (eval, sample, a run without torchrun); that is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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


def home_run(path: str | Path) -> Path:
    """The run directory a checkpoint path belongs to: a step directory's run (step_X in checkpoints/), the run of
    a checkpoints/ directory, or the path itself (a run directory, a consolidated file, a Hugging Face export)."""
    path = Path(path)
    if path.parent.name == "checkpoints" and (path / "state.json").is_file():
        return path.parent.parent
    if path.name == "checkpoints" and path.is_dir():
        return path.parent
    return path


def step_store(path: str | Path) -> Path:
    """The directory of step directories that checkpoint `path` comes from (what a tool reading the checkpoint
    must not write into), or `path` itself when it has none (a consolidated file, an export)."""
    home = home_run(path)
    return checkpoint_root(home) if checkpoint_root(home).is_dir() else home


def read_state(path: Path) -> dict:
    """state.json of a step directory; checkpoints from before the engine key were written by ddp."""
    try:
        state = {"engine": "ddp", **json.loads((path / "state.json").read_text())}
    except (OSError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path / 'state.json'}: unreadable: {err}") from None
    if not isinstance(state.get("step"), int):
        raise CheckpointError(f"{path / 'state.json'}: no integer step in it")
    return state


def read_config(path: Path) -> JobConfig:
    """The config a checkpoint was written with, validated like any other config (`read_stored_config`)."""
    return read_stored_config(path / "config.yaml")


def save_checkpoint(root: Path, step: int, engine: Engine, state: dict, cfg: JobConfig, env: DistEnv,
                    keep: int) -> Path:
    """Collectively write one checkpoint; every rank must call this. Returns the final directory.

    Retention then keeps `keep` complete checkpoints, always including this one. A save that fails on any
    rank, with any exception (a full disk's OSError, DCP's CheckpointException), fails on every rank with
    one CheckpointError that names the previous checkpoint: the half-written `.tmp` is removed, so a full
    disk is not left full, and the previous checkpoints are untouched.
    """
    start = time.perf_counter()
    final = root / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        _clean_leftovers(root)
        tmp.mkdir()
    env.barrier()
    _agree(_attempt(_write_rank_files, tmp, engine, env), tmp, root, step, env)
    error = _attempt(_finish, tmp, final, state, cfg, env) if env.is_main else None
    _agree(error, tmp, root, step, env)
    if env.is_main:
        _prune(root, final, keep)
        log.info("saved checkpoint %s in %.1f s", final, time.perf_counter() - start)
    env.barrier()
    return final


def _write_rank_files(tmp: Path, engine: Engine, env: DistEnv) -> None:
    engine.save(tmp)  # collective: DCP raises the same CheckpointException on every rank
    rng = {"cpu": torch.get_rng_state()}
    if env.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(env.device)
    torch.save(rng, tmp / f"rng_rank{env.rank}.pt")


def _finish(tmp: Path, final: Path, state: dict, cfg: JobConfig, env: DistEnv) -> None:
    """Rank 0, once every rank's files are written: config, state.json, then the manifest over all of them,
    and the rename into place (a same-step checkpoint, of a run resumed from an earlier one, replaced last)."""
    save_config(cfg, tmp / "config.yaml")
    meta = {"world_size": env.world_size, "engine": cfg.parallel.engine}
    if cfg.parallel.engine == "deepspeed":
        meta["zero_stage"] = cfg.parallel.zero_stage
    (tmp / "state.json").write_text(json.dumps({**state, **meta}, indent=2))
    write_manifest(tmp)
    publish_dir(tmp, final)


def _attempt(fn, *args) -> BaseException | None:
    """Run `fn(*args)`; the exception it raised, or None. DCP's CheckpointException is a BaseException."""
    try:
        fn(*args)
    except (Exception, dcp.CheckpointException) as err:
        return err
    return None


def _agree(error: BaseException | None, tmp: Path, root: Path, step: int, env: DistEnv) -> None:
    """A collective: when the save failed on any rank, rank 0 removes the half-written checkpoint and
    every rank raises the same CheckpointError naming the checkpoint that is still good."""
    if not env.any_rank(error is not None):
        return
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    found = complete_checkpoints(root)
    reason = describe_failure(error) if error is not None else "on another rank"
    # a full disk often shows only as a writer's odd error (torch.save's "unexpected pos"): say what is free
    free = shutil.disk_usage(root).free / 2**20
    raise CheckpointError(f"{root}: saving step {step} failed ({reason}; {free:,.0f} MiB free there); the "
                          f"previous checkpoint {found[-1] if found else '(none)'} is intact") from error


def describe_failure(err: BaseException) -> str:
    """One line for an exception of a checkpoint write or read; for DCP's, which holds every rank's error
    with its traceback, the first rank's error alone."""
    if isinstance(err, dcp.CheckpointException):
        err = next(iter(err.failures.values()))[0]
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    detail = str(err).strip()
    return f"{type(err).__name__}{': ' + detail if detail else ''}"


def _remove(path: Path) -> None:
    """Delete a checkpoint; renamed first, so a kill half-way never leaves a dir that looks complete."""
    doomed = path.with_name(path.name + ".deleting")
    path.rename(doomed)
    shutil.rmtree(doomed)


def _step(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def _prune(root: Path, final: Path, keep: int) -> None:
    """Keep `keep` complete checkpoints: `final`, just written, always; then the newest below its step;
    steps above it come last, as they belong to a run that resumed from an earlier checkpoint."""
    others = [p for p in complete_checkpoints(root) if p != final]
    below = [p for p in others if _step(p) < _step(final)]
    above = [p for p in others if _step(p) > _step(final)]
    ranked = [final, *reversed(below), *reversed(above)]
    for old in ranked[keep:]:
        _remove(old)


def restore_replaced(root: Path) -> None:
    """A kill between the two renames of `publish_dir` leaves the replaced checkpoint only under `.replaced`."""
    for aside in root.glob(f"step_*{REPLACED_SUFFIX}"):
        final = aside.with_suffix("")
        if not final.exists():
            log.warning("%s: a save was killed while replacing this checkpoint; restoring it", final)
            aside.rename(final)


def _clean_leftovers(root: Path) -> None:
    """Remove what killed saves left (`.tmp`, `.deleting`, `.replaced` dirs); none is a complete checkpoint
    once `.replaced` ones without a successor are restored."""
    restore_replaced(root)
    for path in root.iterdir():
        if _LEFTOVER.match(path.name):
            shutil.rmtree(path)
