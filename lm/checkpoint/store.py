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

checkpoint.async (`BackgroundSaves`) keeps that order and moves the writing to a thread: training waits only for
the copy of the state to host memory, and the checkpoint is published, as above, once every rank's files are
written. A kill while it is written leaves the `.tmp` unpublished and the previous checkpoint the newest.
"""

import contextlib
import json
import logging
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from lm.checkpoint.manifest import write_manifest
from lm.config import JobConfig, read_stored_config, save_config
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.errors import CheckpointError
from lm.io import REPLACED_SUFFIX, publish_dir, restore_replaced_dir

log = logging.getLogger("lm.checkpoint")

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LEFTOVER = re.compile(r"^step_\d{8}\.(tmp|deleting|replaced)$")

# DCP warns on every single-process save and load (eval, sample, a run without torchrun); that is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def published_checkpoints(root: Path) -> list[Path]:
    """Every step directory under `root`, oldest first: a save renames one into place only when complete, so
    one without its state.json was damaged afterwards (resume reports and skips it rather than not seeing it)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def enclosing_checkpoint(path: str | Path) -> Path | None:
    """The step directory that `path` is or lies in, if any: a tool's output there would change a checkpoint
    (its manifest refuses it, or retention deletes the output with it)."""
    path = Path(path).resolve()
    return next((p for p in (path, *path.parents) if _STEP_DIR.match(p.name) and p.is_dir()), None)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (those with their state.json), oldest first."""
    return [p for p in published_checkpoints(root) if (p / "state.json").is_file()]


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
    final, tmp = _open(root, step, env)
    _agree(_attempt(_write_rank_files, tmp, engine, env), tmp, root, step, env)
    error = _attempt(_finish, tmp, final, state, cfg, env) if env.is_main else None
    _agree(error, tmp, root, step, env)
    if env.is_main:
        _prune(root, final, keep)
        log.info("saved checkpoint %s in %.1f s", final, time.perf_counter() - start)
    env.barrier()
    return final


class BackgroundSaves:
    """The checkpoints of a run that saves asynchronously (checkpoint.async): training waits for a copy of the
    state in host memory, and a thread of each rank writes it. One is written at a time: the next save, and the
    end of the run (`wait`), wait for the one being written.

    The save of step S, on every rank: wait for the previous one (and agree on how it ended); rank 0 makes
    step_S.tmp; each rank writes its RNG file and copies its state to host memory (`Engine.stage`), and the ranks
    agree that they did; then the thread writes each rank's DCP files over a group of its own
    (`Engine.write_staged`). Rank 0's write returns only once every rank's files are written (DCP gathers their
    results before it writes .metadata), so its thread then writes config, state.json and manifest, publishes
    step_S and prunes with no collective. A write that failed is one CheckpointError on every rank at the
    next `save` or `wait`, naming the checkpoint still good, as a synchronous save's.
    """

    def __init__(self, root: Path, env: DistEnv) -> None:
        self.root, self.env = root, env
        self._thread: ThreadPoolExecutor | None = None
        self._pending: tuple[int, Path, Future] | None = None
        """The step, .tmp directory and write of the checkpoint being written (the same on every rank)"""
        self.allocated = False

    def allocate(self, engine: Engine) -> None:
        """Allocate the host copy the saves fill, once, after a step (when the optimizer has state): pinning it
        takes seconds at billions of parameters, which the first save would otherwise hold training up for."""
        if self.allocated:
            return
        start = time.perf_counter()
        held = engine.allocate_stage()
        self.allocated = True
        if self.env.is_main:
            log.info("allocated the host copy for checkpoint.async: %.2f GB in %.2f s", held / 1e9,
                     time.perf_counter() - start)

    def save(self, step: int, engine: Engine, state: dict, cfg: JobConfig, keep: int) -> Path:
        """Collectively start writing the checkpoint of `step`; returns, once this rank's state is in host memory,
        the directory it will be published as."""
        start = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - start
        final, tmp = _open(self.root, step, self.env)
        try:
            _write_rng(tmp, self.env)
            staged, error = engine.stage(), None
        except Exception as err:
            staged, error = None, err
        _agree(error, tmp, self.root, step, self.env)  # so that every rank's thread writes, or none
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lm-checkpoint")
        written = self._thread.submit(self._write, engine, staged, tmp, final, state, cfg, keep, start + waited)
        self._pending = (step, tmp, written)
        if self.env.is_main:
            log.info("checkpoint of step %d copied to host memory in %.2f s, after %.2f s waiting for the previous "
                     "write; writing %s in the background", step, time.perf_counter() - start - waited, waited, final)
        return final

    def _write(self, engine: Engine, staged: dict, tmp: Path, final: Path, state: dict, cfg: JobConfig, keep: int,
               start: float) -> None:
        """The thread's part: this rank's DCP files, then, on rank 0, the files and the publishing of `_finish`.
        A write that fails removes its `.tmp` at once: training goes on until the next save, and a full disk must
        not stay full under it."""
        try:
            engine.write_staged(staged, tmp)  # collective over the engine's background group
            if self.env.is_main:
                _finish(tmp, final, state, cfg, self.env)
        except BaseException:
            if self.env.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.env.is_main:
            _prune(self.root, final, keep)
            log.info("saved checkpoint %s in %.1f s, in the background", final, time.perf_counter() - start)

    def wait(self) -> None:
        """Collectively wait for the checkpoint being written, if any. A failed write is one CheckpointError on
        every rank that names the checkpoint still good; its `.tmp` is removed."""
        if self._pending is None:
            return
        step, tmp, written = self._pending
        self._pending = None
        _agree(_attempt(written.result), tmp, self.root, step, self.env)

    def close(self) -> None:
        """Let the checkpoint being written end on this rank, with no collective (for a run that stopped with an
        error, whose ranks may not meet again); a failed write is only logged, as another error is on its way."""
        if self._pending is not None:
            step, _, written = self._pending
            self._pending = None
            if (error := _attempt(written.result)) is not None:
                log.warning("the checkpoint of step %d was not saved: %s", step, describe_failure(error))
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None


def _open(root: Path, step: int, env: DistEnv) -> tuple[Path, Path]:
    """The final and `.tmp` directories of the checkpoint of `step`, the latter made by rank 0 once what killed
    saves left is removed (a collective; a failure, say a full disk or a read-only directory, is the save's)."""
    final = root / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    _agree(_attempt(_make_tmp, root, tmp) if env.is_main else None, tmp, root, step, env)
    return final, tmp


def _make_tmp(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root)
    tmp.mkdir()


def _write_rank_files(tmp: Path, engine: Engine, env: DistEnv) -> None:
    engine.save(tmp)  # collective: DCP raises the same CheckpointException on every rank
    _write_rng(tmp, env)


def _write_rng(tmp: Path, env: DistEnv) -> None:
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
    free = shutil.disk_usage(next(p for p in (root, *root.parents) if p.exists())).free / 2**20
    kept = f"the previous checkpoint {found[-1]} is intact" if found else "no earlier checkpoint was lost"
    raise CheckpointError(f"{root}: saving step {step} failed ({reason}; {free:,.0f} MiB free there); "
                          f"{kept}") from error


@contextlib.contextmanager
def reading(step_dir: Path, engine: str) -> Iterator[None]:
    """Turn any failure to read a checkpoint's files (a missing or corrupt file, weights that do not fit the
    config) into one CheckpointError naming `step_dir`; DCP raises its failure on every rank."""
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as err:
        raise CheckpointError(f"{step_dir}: cannot read the {engine} checkpoint: {describe_failure(err)}") from err


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
    """Delete an old checkpoint; renamed first, so a kill half-way never leaves a dir that looks complete. One
    that cannot be deleted is a warning, not a failed save: the new checkpoint is complete."""
    doomed = path.with_name(path.name + ".deleting")
    try:
        path.rename(doomed)
        shutil.rmtree(doomed)
    except OSError as err:
        left = doomed if doomed.exists() else path  # renamed aside already, or not even that
        log.warning("%s: could not delete this old checkpoint (%s); the next save tries again", left,
                    describe_failure(err))


def _step(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def _prune(root: Path, final: Path, keep: int) -> None:
    """Keep `keep` checkpoints: `final`, just written, always; then the newest complete one below its step;
    steps above it next, as they belong to a run that resumed from an earlier checkpoint; step directories
    damaged after publishing (no state.json, which resume skips) last, so they go first."""
    found = [p for p in published_checkpoints(root) if p != final]
    complete = [p for p in found if (p / "state.json").is_file()]
    below = [p for p in complete if _step(p) < _step(final)]
    above = [p for p in complete if _step(p) > _step(final)]
    damaged = [p for p in found if p not in complete]
    ranked = [final, *reversed(below), *reversed(above), *reversed(damaged)]
    for old in ranked[keep:]:
        _remove(old)


def restore_replaced(root: Path) -> None:
    """A kill between the two renames of `publish_dir` leaves the replaced checkpoint only under `.replaced`."""
    for final in (aside.with_suffix("") for aside in root.glob(f"step_*{REPLACED_SUFFIX}")):
        if restore_replaced_dir(final):
            log.warning("%s: a save was killed while replacing this checkpoint; restored it", final)


def _clean_leftovers(root: Path) -> None:
    """Remove what killed saves left (`.tmp`, `.deleting`, `.replaced` dirs); none is a complete checkpoint
    once `.replaced` ones without a successor are restored."""
    restore_replaced(root)
    for path in root.iterdir():
        if _LEFTOVER.match(path.name):
            shutil.rmtree(path, ignore_errors=path.name.endswith(".deleting"))  # what _remove could not delete
