"""Saving a run: the checks around a checkpoint (finite weights, a writable run directory with room for
one), and a failed write reported with the checkpoint that is still good."""

import os
import shutil
from pathlib import Path

from lm.checkpoint.store import complete_checkpoints, save_checkpoint
from lm.config import JobConfig
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.errors import CheckpointError, TrainingError


def last_good(root: Path) -> str:
    """The newest complete checkpoint under `root`, for messages that send the user back to it."""
    found = complete_checkpoints(root)
    return str(found[-1]) if found else "none (no checkpoint was saved)"


def save_run(engine: Engine, root: Path, state: dict, cfg: JobConfig, env: DistEnv) -> Path:
    """Checkpoint the run (a collective), unless the weights are no longer finite: those are never saved.
    A failed write is one CheckpointError naming the intact previous checkpoint (`save_checkpoint`)."""
    if env.any_rank(not engine.parameters_finite()):
        raise TrainingError(f"step {state['step']}: the weights hold NaN or inf values and are not saved; the "
                            f"last good checkpoint is {last_good(root)}")
    return save_checkpoint(root, state["step"], engine, state, cfg, env, cfg.checkpoint.keep)


def probe_output_dir(out_dir: Path, checkpoint_bytes: int) -> None:
    """Fail before training, not at the first save, when train.out_dir cannot be written or lacks the space
    for one checkpoint (`checkpoint_bytes`, `lm.plan.disk`)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write_probe"
        with open(probe, "wb") as f:
            f.write(b"lm")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        free = shutil.disk_usage(out_dir).free
    except OSError as err:
        raise CheckpointError(f"train.out_dir: cannot write to {out_dir}: {err.strerror or err}") from None
    if free < checkpoint_bytes:
        raise CheckpointError(f"train.out_dir: {out_dir} has {free / 2**20:,.0f} MiB free, less than one "
                              f"checkpoint needs (about {checkpoint_bytes / 2**20:,.0f} MiB)")
