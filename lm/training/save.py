"""Saving a run: the check before a checkpoint (finite weights), and a failed write reported with the
checkpoint that is still good. That the run directory has room for one is checked before training
(`lm.checkpoint.run_dir.probe_output_dir`)."""

from pathlib import Path

from lm.checkpoint.store import BackgroundSaves, complete_checkpoints, save_checkpoint
from lm.config import JobConfig
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.errors import TrainingError


def last_good(root: Path) -> str:
    """The newest complete checkpoint under `root`, for messages that send the user back to it."""
    found = complete_checkpoints(root)
    return str(found[-1]) if found else "none (no checkpoint was saved)"


def save_run(engine: Engine, root: Path, state: dict, cfg: JobConfig, env: DistEnv,
             background: BackgroundSaves | None = None) -> Path:
    """Checkpoint the run (a collective), unless the weights are no longer finite: those are never saved.
    A failed write is one CheckpointError naming the intact previous checkpoint (`save_checkpoint`).
    `background`: write it there, in the background (checkpoint.async), once the previous one is written."""
    if env.any_rank(not engine.parameters_finite()):
        raise TrainingError(f"step {state['step']}: the weights hold NaN or inf values and are not saved; the "
                            f"last good checkpoint is {last_good(root)}")
    if background is not None:
        return background.save(state["step"], engine, state, cfg, cfg.checkpoint.keep)
    return save_checkpoint(root, state["step"], engine, state, cfg, env, cfg.checkpoint.keep)
