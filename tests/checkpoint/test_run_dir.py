"""The run directory: apart from the data, and one run at a time (an OS lock held by rank 0)."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lm.checkpoint.run_dir import LOCK, RUN_FILES, RunLock, check_run_paths, lock_run_dir, run_files
from lm.config import load_config, read_stored_config, save_config
from lm.distributed.env import init_distributed
from lm.errors import CheckpointError, ConfigError
from tests.training.test_faults import TINY, refused_run, run_env
from tests.workers import pool, train_in_pool


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


def lock_on_every_rank(out: str) -> str | None:
    try:
        lock_run_dir(Path(out), init_distributed("cpu"))
    except CheckpointError as err:
        return str(err)
    return None


@pytest.mark.process
def test_a_held_run_directory_is_refused_on_every_rank_with_rank_0s_error(tmp_path):
    out = tmp_path / "run"
    held = RunLock(out)
    held.acquire()
    try:
        replies = [reply["value"] for reply in pool(2).run(lock_on_every_rank, str(out))]
    finally:
        held.release()
    assert replies[0] is not None and replies[0].startswith(f"train.out_dir: {out} is in use by another run "
                                                            f"(pid {os.getpid()} on ")
    assert replies[1] == replies[0]


def lock_own_directory(root: str) -> tuple[bool, bool]:
    out = Path(root) / f"rank{dist.get_rank()}"
    lock = lock_run_dir(out, init_distributed("cpu"))
    dist.barrier()
    made = (out / LOCK).exists()
    lock.release()
    return made, out.exists()


@pytest.mark.process
def test_only_rank_0_takes_the_lock(tmp_path):
    # the other ranks never touch the run directory: the lock is rank 0's alone
    replies = [reply["value"] for reply in pool(2).run(lock_own_directory, str(tmp_path))]
    assert replies == [(True, False), (False, False)]
    assert not (tmp_path / "rank1").exists()


def test_a_run_inside_one_of_a_mixtures_directories_is_refused_naming_the_mixture(tmp_path):
    mixture = f"--data.mixture=[{{dir: {tmp_path / 'a'}}}, {{dir: {tmp_path / 'b'}}}]"
    cfg = load_config(None, [mixture, f"--train.out_dir={tmp_path / 'b' / 'run'}"])
    with pytest.raises(ConfigError, match=rf"^train.out_dir: '{tmp_path / 'b' / 'run'}' is inside data.mixture "
                                          rf"'{tmp_path / 'b'}'; preparing the data again"):
        check_run_paths(cfg)


@pytest.mark.parametrize("inside", ["checkpoints/rows.csv", "tb/rows.csv"])
def test_a_task_file_inside_a_directory_the_run_writes_is_refused(tmp_path, inside):
    # retention prunes checkpoints/ and TensorBoard writes into tb/: a labelled file there is the run's to change
    out = tmp_path / "run"
    cfg = load_config(None, ["--model.arch=encoder", "--model.head=regress", f"--task.file={out / inside}",
                             f"--train.out_dir={out}"])
    with pytest.raises(ConfigError, match=r"^task.file: '.*rows.csv' is one of the files of train.out_dir"):
        check_run_paths(cfg)


def test_a_lock_held_before_its_holder_wrote_its_name_says_so(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with open(out / LOCK, "a+") as starting:  # locked, its line not written yet
        fcntl.flock(starting, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(CheckpointError, match=rf"^train.out_dir: {out} is in use by another run \(a process that "
                                                  r"is starting\); wait for it"):
            RunLock(out).acquire()


def test_the_run_files_of_a_checkpoint_are_its_runs_and_none_outside_a_run(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    assert run_files(step) == [tmp_path / "run" / name for name in RUN_FILES]
    (tmp_path / "export").mkdir()
    assert run_files(tmp_path / "export" / "model.safetensors") == []
