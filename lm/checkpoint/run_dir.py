"""The run directory (train.out_dir): kept apart from the data it trains on, writable with room for a
checkpoint, and used by one run at a time.

The lock is an OS lock (`fcntl.flock`) on `<out_dir>/.lock`, taken by rank 0 before the run reads or writes
anything there and held until it ends. The kernel drops it when the holding process dies, however it dies
(kill -9 included), so a crashed run never leaves a stale lock behind: a lock file that nobody holds is
simply taken over. While a run holds it (also workers that outlive a killed torchrun), a second run on the
same directory stops with an error naming the holder's pid, host and start time. flock is local to a
machine, and on NFS it holds across machines only where the mount supports it (NFSv4 does).
"""

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from lm.checkpoint.store import home_run
from lm.config import JobConfig, saved_by_lm
from lm.distributed.env import DistEnv
from lm.errors import CheckpointError, ConfigError
from lm.hf.importing import is_hf_checkpoint
from lm.plan.disk import checkpoint_bytes
from lm.report.metrics import METRICS_FILE

LOCK = ".lock"
RUN_FILES = ("config.yaml", METRICS_FILE, "tb", "checkpoints", LOCK)
"""What a run writes into its directory (beside which a tool may write its own outputs, as lm.predict's)."""


def run_files(checkpoint: str | Path) -> list[Path]:
    """The files and directories of the run that `checkpoint` (any path a tool takes) belongs to, which a tool's
    output must not replace; none for a checkpoint outside a run directory (a consolidated file, an export)."""
    home = home_run(checkpoint)
    return [home / name for name in RUN_FILES] if (home / "checkpoints").is_dir() else []


def check_run_paths(cfg: JobConfig) -> None:
    """Refuse a run directory inside a data directory (data.dir or a mixture's), or data inside the run
    directory (by resolved path): `lm.prepare --force` replaces a data directory whole, which would take a
    run's checkpoints with it. A fine-tuning run reads task.file, not data.dir, so only the next rule holds
    for it: no run directory that is, or is inside, the run that checkpoint.init_from (lm.finetune's --encoder)
    comes from, whose files (a step directory's config.yaml, its checkpoints/) the run would write over or
    among."""
    out = Path(cfg.train.out_dir).resolve()
    if cfg.checkpoint.init_from:
        home = home_run(Path(cfg.checkpoint.init_from).resolve())
        if out == home or home in out.parents:
            where = "is" if out == home else "is inside"
            raise ConfigError(f"train.out_dir: {cfg.train.out_dir!r} {where} {str(home)!r}, the run of the "
                              "checkpoint this run starts from (checkpoint.init_from, lm.finetune's --encoder); "
                              "writing there would change that run's files: put the run elsewhere")
    if cfg.task.file:  # the run appends to its metrics.jsonl, rewrites config.yaml, prunes its checkpoints
        task = Path(cfg.task.file).resolve()
        if any(task == out / name or out / name in task.parents for name in RUN_FILES):
            raise ConfigError(f"task.file: {cfg.task.file!r} is one of the files of train.out_dir "
                              f"{cfg.train.out_dir!r}, which the run writes; keep the labelled file elsewhere")
    for source in [] if cfg.task.file else cfg.data.sources:
        key = "data.mixture" if cfg.data.mixture else "data.dir"
        data = Path(source.dir).resolve()
        if out == data or data in out.parents:
            raise ConfigError(f"train.out_dir: {cfg.train.out_dir!r} is inside {key} {source.dir!r}; preparing "
                              "the data again replaces that directory and the run's checkpoints with it: put the "
                              "run elsewhere")
        if out in data.parents:
            raise ConfigError(f"{key}: {source.dir!r} is inside train.out_dir {cfg.train.out_dir!r}; keep "
                              "prepared data out of the run directory")
    check_foreign_files(out, cfg.train.out_dir)


def check_foreign_files(out: Path, key: str) -> None:
    """Refuse a directory holding a config.yaml that lm did not write (`saved_by_lm`: a user's own config, say, in
    the directory train.out_dir names), or a metrics.jsonl without an lm config.yaml beside it, unless it holds a
    run's checkpoints (a run from before config.yaml's first line named lm): a run would replace the one and
    append to the other. A Hugging Face checkpoint (a config.json) is refused too: lm's tools read a directory
    holding one as that checkpoint, not as the run."""
    if is_hf_checkpoint(out):
        raise ConfigError(f"train.out_dir: {key!r} holds a Hugging Face checkpoint (config.json), which lm's tools "
                          "would read in place of the run's checkpoints; use another train.out_dir")
    if (out / "checkpoints").is_dir():
        return
    config, metrics = out / "config.yaml", out / METRICS_FILE
    if config.is_file() and not saved_by_lm(config):
        raise ConfigError(f"train.out_dir: {key!r} holds a config.yaml that no lm run wrote ({str(config)!r} does "
                          "not start with lm's line), which the run would replace; use another train.out_dir")
    if metrics.exists() and not config.is_file():
        raise ConfigError(f"train.out_dir: {key!r} holds a {METRICS_FILE} without a run's config.yaml, which the "
                          "run would append to; use another train.out_dir")


def probe_output_dir(cfg: JobConfig) -> None:
    """Fail before training, not at the first save, when train.out_dir cannot be written or lacks the space
    for one checkpoint of `cfg` (`lm.plan.disk`)."""
    out_dir, needed = Path(cfg.train.out_dir), checkpoint_bytes(cfg)
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
    if free < needed:
        raise CheckpointError(f"train.out_dir: {out_dir} has {free / 2**20:,.0f} MiB free, less than one "
                              f"checkpoint needs (about {needed / 2**20:,.0f} MiB)")


class RunLock:
    """Rank 0's hold on a run directory for the life of a run; `release` lets go (idempotent)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path = out_dir / LOCK
        self._file = None
        self._made_dir = False

    def acquire(self) -> None:
        """Take the lock or raise CheckpointError naming the run that holds it."""
        self._made_dir = not self.out_dir.exists()
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            while self._file is None:
                handle = open(self.path, "a+")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.seek(0)
                    holder = handle.read().strip()
                    handle.close()
                    raise CheckpointError(
                        f"train.out_dir: {self.out_dir} is in use by another run ({_describe(holder)}); wait for "
                        "it to end or stop it, or give this run another train.out_dir"
                    ) from None
                # a holder that released and unlinked the file between our open and our lock: lock the new one
                if os.fstat(handle.fileno()).st_ino != _inode(self.path):
                    handle.close()
                    continue
                handle.seek(0)
                handle.truncate()
                handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                         "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
                handle.flush()
                self._file = handle
        except OSError as err:
            raise CheckpointError(f"train.out_dir: cannot write to {self.out_dir}: {err.strerror or err}") from None

    def release(self) -> None:
        """Remove the lock file and let go; a run directory this lock created and left empty goes too, so
        a run refused before it wrote anything leaves no trace."""
        if self._file is None:
            return
        self.path.unlink(missing_ok=True)
        self._file.close()  # closing drops the flock
        self._file = None
        if self._made_dir and not any(self.out_dir.iterdir()):
            self.out_dir.rmdir()


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that is starting"


def lock_run_dir(out_dir: Path, env: DistEnv) -> RunLock:
    """Rank 0 takes the run directory's lock; every rank raises the same error when it is held elsewhere.
    A collective: every rank calls it."""
    lock = RunLock(out_dir)
    error = None
    if env.is_main:
        try:
            lock.acquire()
        except CheckpointError as err:
            error = str(err)
    error = env.broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)
    return lock
