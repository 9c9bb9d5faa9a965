"""Saving a run: the checks around a checkpoint (finite weights, a writable run directory with room for
one), and a failed write reported with the checkpoint that is still good."""

import os
import shutil
from pathlib import Path

import torch

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
    """Checkpoint the run (a collective); refuses weights that are no longer finite, and reports a failed
    write (a full disk, say) with the previous checkpoint named, which the failed save leaves intact."""
    flag = torch.tensor(float(not engine.parameters_finite()), device=env.device)
    if env.all_reduce_mean(flag).item() > 0:
        raise TrainingError(f"step {state['step']}: the weights hold NaN or inf values and are not saved; the "
                            f"last good checkpoint is {last_good(root)}")
    try:
        return save_checkpoint(root, state["step"], engine, state, cfg, env, cfg.checkpoint.keep)
    except OSError as err:
        raise CheckpointError(f"{root}: saving step {state['step']} failed ({err.strerror or err}); the previous "
                              f"checkpoint {last_good(root)} is intact") from None


def probe_output_dir(out_dir: Path, checkpoint_bytes: int) -> None:
    """Fail before training, not at the first save, when train.out_dir cannot be written or lacks the space
    for about one checkpoint (`checkpoint_bytes`: weights plus AdamW's two moments, 12 bytes a parameter)."""
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
