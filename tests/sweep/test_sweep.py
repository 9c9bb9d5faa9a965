"""lm.sweep end to end: real lm.train processes on the tiny corpus, a sweep killed and continued, bad input."""

import csv
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from lm.cli import run
from lm.sweep.__main__ import main

RUN_STEPS = 40
CHECKPOINT_EVERY = 4
"""Often enough that the killed sweep's second run has a checkpoint well before its last step (36 steps and 9 saves
after the first, about 2 s here, against the test's 10 ms poll), seldom enough that a run is not mostly saves
(a save costs about 3 steps)."""


def write_base_config(path: Path, data_config, data_dir: Path) -> Path:
    """A tiny GPT on the shared tiny corpus; its data section matches the fixture, so lm.prepare reuses it."""
    path.write_text(yaml.safe_dump({
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32},
        "data": {"source": data_config.source, "dir": str(data_dir), "val_fraction": 0.1,
                 "shard_tokens": 4096, "seq_len": 16},
        "train": {"steps": RUN_STEPS, "batch_size": 4, "micro_batch_size": 4, "device": "cpu", "eval_every": 20,
                  "eval_batches": 2},
        "checkpoint": {"every": CHECKPOINT_EVERY, "keep": 1},
        "log": {"every": 10, "tensorboard": False, "sample_every": 0},
    }))
    return path


@pytest.fixture
def base_config(tiny_data_config, tiny_data_dir, tmp_path) -> Path:
    return write_base_config(tmp_path / "base.yaml", tiny_data_config, tiny_data_dir)


def sweep_args(base: Path, out: Path) -> list[str]:
    """The killed sweep's arguments: two runs that differ in their learning rate."""
    return ["--config", str(base), "--grid", "optim.lr=3e-3,1e-2", "--out", str(out)]


def launches(run_dir: Path) -> int:
    """How many times the sweep started lm.train for this run (one header line per launch)."""
    return sum(line.startswith("# ") for line in (run_dir / "train.log").read_text().splitlines())


@pytest.mark.process
def test_a_killed_sweep_continues_where_it_stopped_and_a_finished_one_trains_nothing(base_config, tmp_path, capsys,
                                                                                     caplog):
    """The sweep that is killed is a process of its own (`kill -9`, as the out-of-memory killer would): its run,
    in a session of its own, gets a SIGTERM, saves and exits rather than train on for nobody. The two sweeps that
    follow call the tool's `main` in-process, which starts lm.prepare and lm.train as processes all the same: what
    they test is what the sweep does with the directory, not how it starts."""
    out = tmp_path / "sweep"
    first = subprocess.Popen([sys.executable, "-m", "lm.sweep", *sweep_args(base_config, out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    # kill the sweep alone once the second run has saved a checkpoint; the first run is finished by then
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and first.poll() is None:
        second = sorted(out.glob("runs/*lr=0.01-*/checkpoints/step_*"))
        if any(not p.name.endswith(".tmp") and (p / "manifest.json").is_file() for p in second):
            break
        time.sleep(0.01)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    run_b = sorted(out.glob("runs/*lr=0.01-*"))[0]
    when(lambda: train_pid(run_b) is None, timeout_s=120)  # it saved at its next log step and exited
    assert "SIGTERM received" in (run_b / "train.log").read_text()
    run_a, run_b = sorted(out.glob("runs/*lr=0.003-*"))[0], sorted(out.glob("runs/*lr=0.01-*"))[0]
    steps_b = [int(p.name.split("_")[1]) for p in (run_b / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    assert (run_a / "checkpoints" / f"step_{RUN_STEPS:08d}").is_dir()
    assert steps_b and max(steps_b) < RUN_STEPS, "the second run finished before the kill: the test proves nothing"
    assert not (out / "results.md").exists()

    caplog.set_level(logging.INFO, logger="lm.sweep")
    assert run(main, sweep_args(base_config, out)) == 0, capsys.readouterr().err
    assert launches(run_a) == 1 and launches(run_b) == 2
    assert "resumed from" in (run_b / "train.log").read_text()
    assert [m for m in caplog.messages if m.endswith(": finished before, skipped")] == [f"[1/2] {run_a.name}: "
                                                                                       "finished before, skipped"]
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [row["status"] for row in table] == ["finished", "finished"]
    assert {row["optim.lr"] for row in table} == {"0.003", "0.01"}
    val = [float(row["val loss"]) for row in table]
    assert val == sorted(val) and all(0 < v < 11 for v in val)
    for row in table:
        assert int(row["tokens"]) == RUN_STEPS * 4 * 16 and float(row["wall time (s)"]) > 0
        assert int(row["params"]) > 0 and int(float(row["tokens/s"])) > 0
    assert (out / "results.md").read_text().count("| finished |") == 2
    assert (out / "val_loss_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    caplog.clear()
    assert run(main, sweep_args(base_config, out)) == 0
    assert sum(m.endswith(": finished before, skipped") for m in caplog.messages) == 2
    assert launches(run_a) == 1 and launches(run_b) == 2


def train_pid(run_dir: Path) -> int | None:
    """The process of the lm.train run that trains into `run_dir`, if one is running."""
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and b"lm.train" in args and f"--train.out_dir={run_dir}".encode() in args:
            return int(proc.name)
    return None


def saved_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit())


def when(condition, timeout_s: float = 240):
    """Poll `condition()` until it gives something true; that value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.01)
    raise AssertionError(f"{condition} did not hold within {timeout_s} s")


@pytest.mark.process
def test_ctrl_c_reaches_the_run_once_so_it_saves_and_the_sweep_stops_with_one_line(base_config, tmp_path):
    # a terminal's Ctrl-C: SIGINT to the sweep's process group; the run, in a group of its own, gets it from the
    # sweep, once: it trains to its next log step (10, 20 or 30), saves there and exits
    out = tmp_path / "sweep"
    sweep = subprocess.Popen([sys.executable, "-m", "lm.sweep", *sweep_args(base_config, out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    run_dir = when(lambda: next(iter(out.glob("runs/*lr=0.003-*")), None))
    when(lambda: saved_steps(run_dir))
    os.killpg(sweep.pid, signal.SIGINT)
    err = sweep.communicate(timeout=120)[1].strip().splitlines()
    assert sweep.returncode == 128 + signal.SIGINT, err
    assert err[-1].startswith(f"stopped: {run_dir.name}: SIGINT passed on to the run, which exited 0 (log: ")
    assert err[-1].endswith("the same command resumes the sweep from its newest checkpoint") and "Traceback" not in err
    log_text = (run_dir / "train.log").read_text()
    stop = int(log_text.split("stopped at step ")[1].split()[0])
    assert stop < RUN_STEPS and saved_steps(run_dir)[-1] == stop and "checkpoint saved" in log_text
    assert not list(out.glob("runs/*lr=0.01-*")) and not (out / "results.md").exists()


@pytest.mark.process
def test_a_run_a_signal_stopped_is_not_called_finished(base_config, tmp_path, capsys):
    # SIGTERM to the run alone (a scheduler stopping it): lm.train saves and exits 0, short of its steps
    out = tmp_path / "sweep"
    args = ["--config", str(base_config), "--grid", "optim.lr=3e-3", "--out", str(out)]
    stopper = threading.Thread(target=lambda: os.kill(when(lambda: train_pid(next(out.glob("runs/*"))) if
                                                            list(out.glob("runs/*/checkpoints/step_*")) else None),
                                                      signal.SIGTERM), daemon=True)
    stopper.start()
    assert run(main, args) == 1
    stopper.join()
    with open(out / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    step = saved_steps(next(out.glob("runs/*")))[-1]
    assert step < RUN_STEPS and row["status"] == f"stopped at step {step} of {RUN_STEPS} by a signal"


TORCHRUN_SWEEP = ["--grid", "model.arch=gpt", "--train.steps=2", "--train.batch_size=4", "--train.micro_batch_size=2",
                  "--checkpoint.every=2", "--train.eval_every=2"]
"""A one-run sweep of 2 steps on the base config, 2 data-parallel ranks splitting its batch of 4."""


@pytest.fixture(scope="module")
def torchrun_sweep(tiny_data_config, tiny_data_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(base config, sweep directory) of a finished `TORCHRUN_SWEEP` with --nproc 2. Read-only: shared by the
    --nproc test and, copied, as the sweep of another base config (the run is the expensive part of both)."""
    root = tmp_path_factory.mktemp("torchrun_sweep")
    base = write_base_config(root / "base.yaml", tiny_data_config, tiny_data_dir)
    assert run(main, ["--config", str(base), "--out", str(root / "sweep"), "--nproc", "2", *TORCHRUN_SWEEP]) == 0
    return base, root / "sweep"


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("args, message", [
    (["--grid", "model.n_layr=1,2"], r"--grid model.n_layr=1: model.n_layr: not a key of a decoder-only GPT "
                                     r"\(model.arch=gpt\); did you mean 'n_layer'"),
    (["--grid", "model.n_layer=1,two"], r"--grid model.n_layer=two: model.n_layer: expected int, got str 'two'"),
    (["--grid", "optim.lr=1e-3,fast"], r"--grid optim.lr=fast: optim.lr: expected float, got str 'fast'"),
    (["--grid", "model.n_head=2,3"], r"--grid model.n_head=3: model.d_model: 32 is not divisible by model.n_head=3"),
    (["--grid", "model.d_model=34", "model.n_head=4"],
     r"--grid combination --model.d_model=34 --model.n_head=4: model.d_model: 34 is not divisible by model.n_head=4"),
    ([], r"--grid: empty"),
    (["--grid", "data.seq_len=8,16"], r"--grid data.seq_len: every run of a sweep has the same data"),
    (["--grid", "optim.lr=1e-3,3e-3", "--random", "3"], r"--random: 3 runs asked for, but the grid has 2"),
    (["--grid", "optim.lr=1,1.0"], r"--grid: --optim.lr=1 and --optim.lr=1.0 train the same config; list each value "
                                   r"once"),
    (["--grid", "optim.lr=1e-3,3e-3", "--optim.lr=7e-3"],
     r"^error: --optim.lr: also a --grid key, whose values would replace it in every run; give its values in --grid "
     r"only$"),
    (["--grid", "optim.lr=1e-3", "--checkpoint.every=0"],
     r"^error: checkpoint.every=0: a sweep tells a finished run by its final checkpoint"),
    (["--grid", "optim.lr=1e-3,3e-3", "--nproc", "3"],
     r"^error: --nproc 3 \(--grid combination --optim.lr=0.001\): train.batch_size: 4 is not a multiple of "
     r"train.micro_batch_size \(4\) x 3 data-parallel replica"),
])
def test_bad_grids_are_refused_before_any_run_starts(base_config, tmp_path, capsys, args, message):
    import re

    out = tmp_path / "sweep"
    assert run(main, ["--config", str(base_config), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not out.exists()


@pytest.mark.process
def test_a_directory_of_another_base_config_is_refused_unless_forced(torchrun_sweep, tmp_path, capsys):
    """The directory is a copy of the --nproc test's finished sweep: --nproc is no key of the base config, so the
    runs added here train in one process."""
    base_config, sweep = torchrun_sweep
    out = tmp_path / "sweep"
    shutil.copytree(sweep, out)
    args = ["--config", str(base_config), "--out", str(out), *TORCHRUN_SWEEP]
    before = tree_digest(out)
    assert run(main, [*args, "--model.d_model=64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {out}: holds a sweep of another base config (model.d_model: 32 -> 64); use another "
                   "--out, or --force to add these runs beside the others (no run directory is reused)"]
    assert run(main, [*args, "--model.d_model=64", "--dry-run"]) == 2  # lists no runs the real one refuses
    assert capsys.readouterr().err.strip().splitlines() == err
    assert tree_digest(out) == before  # nothing written, nothing trained
    assert run(main, [*args, "--model.d_model=64", "--force"]) == 0
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert len(runs) == 2 and all(name.startswith("arch=gpt-") for name in runs)
    after = tree_digest(out)
    assert all(after[path] == digest for path, digest in before.items() if path.startswith("runs/"))  # untouched
    # the table compares this sweep's run only (rewritten: the copied sweep's table had one row too)
    assert (out / "results.md").read_text().count("| finished |") == 1 and after["results.md"] != before["results.md"]


@pytest.mark.process
def test_a_directory_whose_runs_trained_on_other_data_is_refused(torchrun_sweep, tmp_path, capsys):
    """lm.prepare rebuilds a data directory whose sources changed; the sweep's finished runs, skipped, would then
    be ranked against new ones validated on other tokens. Here the record says the runs saw other data."""
    base_config, sweep = torchrun_sweep
    out = tmp_path / "sweep"
    shutil.copytree(sweep, out)
    record = json.loads((out / "sweep.json").read_text())
    (data_dir, content), = record["data"].items()
    record["data"][data_dir] = "0" * 64
    (out / "sweep.json").write_text(json.dumps(record))
    before = tree_digest(out)
    assert run(main, ["--config", str(base_config), "--out", str(out), *TORCHRUN_SWEEP]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {out}: its runs trained on other data: {data_dir} held content hash 000000000000 and holds "
        f"{content[:12]} now (lm.prepare rebuilt it from changed sources); use another --out")
    assert tree_digest(out) == before


@pytest.mark.parametrize("record, message", [
    ('{"base": {"model": 3}}', "sweep.json: base.model: expected an object of settings, got 3"),
    ('{"base": ["model"]}', "sweep.json: base: expected an object of config sections, got ['model']"),
    ('{"grid": {}}', "sweep.json: not a sweep record (JSON with a 'base' config)"),
    ("[1]", "sweep.json: not a sweep record (JSON with a 'base' config)"),
], ids=["section-not-an-object", "base-a-list", "no-base", "a-list"])
def test_a_sweep_record_of_the_wrong_shape_is_named_by_key_before_any_work(base_config, tmp_path, capsys, record,
                                                                            message):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text(record)
    assert run(main, ["--config", str(base_config), "--grid", "optim.lr=3e-3", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out / message}"), err
    assert [p.name for p in out.iterdir()] == ["sweep.json"] and (out / "sweep.json").read_text() == record


def test_dry_run_lists_the_runs_and_writes_nothing(base_config, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert run(main, ["--config", str(base_config), "--grid", "model.n_layer=1,2", "optim.lr=1e-3,3e-3",
                      "--out", str(out), "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith(f"[1/4] {out}/runs/n_layer=1_lr=0.001-")
    assert lines[3].endswith("--model.n_layer=2 --optim.lr=0.003")
    assert not out.exists()


@pytest.mark.process
def test_nproc_runs_each_combination_as_a_torchrun_job(torchrun_sweep):
    _, out = torchrun_sweep
    (run_dir,) = (out / "runs").iterdir()
    log = (run_dir / "train.log").read_text()
    assert "-m torch.distributed.run --standalone --nproc_per_node=2 -m lm.train" in log.splitlines()[0]
    assert "2 ranks on cpu" in log
    with open(out / "results.csv") as f:
        (row,) = csv.DictReader(f)
    assert row["status"] == "finished" and int(row["tokens"]) == 2 * 4 * 16


def test_a_value_the_base_refuses_alone_is_fine_in_a_combination_that_accepts_it(base_config, tmp_path, capsys):
    # d_model 33 splits into none of the base's 2 heads, but into 3
    out = tmp_path / "sweep"
    assert run(main, ["--config", str(base_config), "--grid", "model.n_head=3", "model.d_model=33", "--out", str(out),
                      "--dry-run"]) == 0
    assert capsys.readouterr().out.strip().endswith("--model.n_head=3 --model.d_model=33")
