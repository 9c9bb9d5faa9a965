"""The run directory: apart from the data, and one run at a time (an OS lock held by rank 0)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lm.checkpoint.run_dir import LOCK, RunLock, check_run_paths
from lm.config import load_config, read_stored_config, save_config
from lm.errors import CheckpointError, ConfigError
from tests.training.test_faults import TINY, refused_run, run_env
from tests.workers import train_in_pool


@pytest.mark.parametrize("data, out, message", [
    ("d", "d", r"train.out_dir: '.*d' is inside data.dir"),
    ("d", "d/run", r"train.out_dir: '.*d/run' is inside data.dir"),
    ("d", "d/../d/./run", r"train.out_dir: .* is inside data.dir"),  # by resolved path
    ("r/data", "r", r"data.dir: '.*r/data' is inside train.out_dir"),
])
def test_a_run_inside_its_data_or_data_inside_its_run_is_refused(tmp_path, data, out, message):
    cfg = load_config(None, [f"--data.dir={tmp_path / data}", f"--train.out_dir={tmp_path / out}"])
    with pytest.raises(ConfigError, match=message):
        check_run_paths(cfg)


def test_side_by_side_is_fine(tmp_path):
    check_run_paths(load_config(None, [f"--data.dir={tmp_path}/data", f"--train.out_dir={tmp_path}/data_run"]))


def test_files_no_lm_run_wrote_are_not_replaced_or_appended_to(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    cfg = load_config(None, [f"--data.dir={tmp_path}/data", f"--train.out_dir={out}"])
    (out / "config.yaml").write_text("train:\n  steps: 5  # my own notes\n")  # a user's config where the run goes
    with pytest.raises(ConfigError, match=r"holds a config.yaml that no lm run wrote .* which the run would replace"):
        check_run_paths(cfg)
    save_config(cfg, out / "config.yaml")  # one lm wrote: an earlier start of this run, replaced as before
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    check_run_paths(cfg)
    assert read_stored_config(out / "config.yaml") == cfg
    (out / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"holds a metrics.jsonl without a run's config.yaml"):
        check_run_paths(cfg)
    (out / "checkpoints").mkdir()  # a run's directory, whatever its config.yaml's first line
    (out / "config.yaml").write_text("train:\n  steps: 5\n")
    check_run_paths(cfg)
    (out / "config.json").write_text("{}")  # a Hugging Face checkpoint's: lm's tools would read it, not the run
    with pytest.raises(ConfigError, match=r"holds a Hugging Face checkpoint \(config.json\), which lm's tools would "
                                          r"read in place of the run's checkpoints"):
        check_run_paths(cfg)


def test_a_held_lock_names_its_holder_and_a_released_one_is_taken_over(tmp_path):
    out = tmp_path / "run"
    first = RunLock(out)
    first.acquire()
    holder = json.loads((out / LOCK).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(CheckpointError, match=rf"train.out_dir: {out} is in use by another run \(pid {os.getpid()} "
                                              rf"on {holder['host']}, since .*\); wait for it"):
        RunLock(out).acquire()  # flock is per open file: the same process is refused too
    first.release()
    assert not out.exists()  # made by the lock and left empty: removed, so a refused run leaves no trace
    second = RunLock(out)
    second.acquire()
    second.release()


def test_a_lock_file_left_by_a_dead_process_is_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # a holder killed with SIGKILL leaves its file behind, but the kernel released its flock
    (out / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "yesterday"}))
    lock = RunLock(out)
    lock.acquire()
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert out.is_dir() and not (out / LOCK).exists()  # a directory it did not make stays


def wait_for_steps(metrics: Path, n: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.05)


@pytest.mark.process
def test_workers_left_by_a_killed_torchrun_keep_the_directory_from_a_second_run(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    steps = ["--train.steps=400", "--checkpoint.every=2"]
    args = [*TINY, f"--data.dir={tiny_data_dir}", f"--train.out_dir={out}", *steps]
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 "-m", "lm.train", *args], env=run_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    workers = []
    try:
        wait_for_steps(out / "metrics.jsonl", 3, launcher)
        workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                                  text=True).stdout.split()]
        launcher.kill()  # kill -9 of the launcher alone: its workers, in sessions of their own, train on
        launcher.wait()
        holder = json.loads((out / LOCK).read_text())["pid"]
        assert holder in workers
        # the second run and the third need no launcher of their own: a pool's rank is another process too
        (second,) = refused_run(1, tiny_data_dir, out, *steps)
        assert second["value"] == 2
        assert second["stderr"].strip().splitlines() == [
            f"error: train.out_dir: {out} is in use by another run (pid {holder} on "
            f"{json.loads((out / LOCK).read_text())['host']}, since "
            f"{json.loads((out / LOCK).read_text())['since']}); wait for it to end or stop it, or give this run "
            "another train.out_dir"]
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    time.sleep(0.5)
    # the workers are gone (killed, as a lost machine would be): the next run takes over and resumes
    third = train_in_pool(1, [*args[:-2], "--train.steps=6", "--checkpoint.every=2"], run_env())
    assert "resumed from" in third and not (out / LOCK).exists()
