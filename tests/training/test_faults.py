"""Faults during training: NaN steps, preemption signals, a rank killed under torchrun, unwritable output."""

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lm.checkpoint.model_weights import load_model_weights
from lm.checkpoint.store import complete_checkpoints
from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.errors import CheckpointError, ConfigError, DataError, TrainingError
from lm.models.registry import family_of
from lm.models.terms import Losses, Reduce, Term
from lm.plan.counts import num_params
from lm.training import setup
from lm.training.faults import install_faults, nan_at
from lm.training.trainer import Trainer
from tests.workers import pool, train_in_pool

TINY = [
    "--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32",
    "--data.seq_len=16", "--train.batch_size=4", "--train.micro_batch_size=2", "--train.device=cpu",
    "--train.eval_every=1000", "--train.eval_batches=2", "--log.every=1", "--log.tensorboard=false",
    "--optim.lr=3e-3", "--schedule.warmup_steps=2", "--log.sample_tokens=4",
]


def config(data_dir, out_dir, *extra):
    return load_config(None, [*TINY, f"--data.dir={data_dir}", f"--train.out_dir={out_dir}", *extra])


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    cfg = load_config(run_dir / "config.yaml")
    model = family_of(cfg.model).build(cfg.model)
    load_model_weights(complete_checkpoints(run_dir / "checkpoints")[-1], model)
    return model.state_dict()


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def faulty_trainer(cfg) -> Trainer:
    """A trainer with the faults the LM_FAULT_* variables ask for, as `lm.train` installs them."""
    trainer = Trainer(cfg, init_distributed("cpu"))
    install_faults(trainer)
    return trainer


def test_a_nan_step_is_skipped_and_counted(tiny_data_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LM_FAULT_NAN_STEPS", "2")
    with caplog.at_level(logging.INFO, logger="lm"):
        history = faulty_trainer(config(tiny_data_dir, tmp_path / "run", "--train.steps=4")).fit()
    rows = {r["step"]: r for r in history if "train/skipped_steps" in r}
    assert [rows[s]["train/skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    # step 2's line trained nothing: it has no loss (a 0, perplexity 1, would read as a perfect model)
    assert [s for s in rows if "train/loss" in rows[s] or "train/ppl" in rows[s]] == [1, 3, 4]
    assert any(m.startswith("step 2/4 | loss n/a | lr ") and m.endswith("| 1 skipped") for m in caplog.messages)
    assert all(torch.isfinite(torch.tensor(rows[s]["train/loss"])) for s in (1, 3, 4))
    assert all(torch.isfinite(w).all() for w in final_weights(tmp_path / "run").values())


def test_too_many_nan_steps_in_a_row_stop_the_run_naming_the_last_good_checkpoint(tiny_data_dir, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("LM_FAULT_NAN_STEPS", "3,4,5")
    cfg = config(tiny_data_dir, tmp_path / "run", "--train.steps=8", "--checkpoint.every=2",
                 "--train.max_nonfinite_steps=3")
    with pytest.raises(TrainingError, match=r"step 5: 3 steps in a row with a non-finite loss or gradient norm .*"
                                            r"the last good checkpoint is .*step_00000004"):
        faulty_trainer(cfg).fit()


def test_a_limit_reached_between_log_steps_stops_the_run_at_the_next_one(tiny_data_dir, tmp_path, monkeypatch,
                                                                          caplog):
    monkeypatch.setenv("LM_FAULT_NAN_STEPS", "2,3")
    cfg = config(tiny_data_dir, tmp_path / "run", "--train.steps=8", "--log.every=4", "--train.max_nonfinite_steps=2")
    with caplog.at_level(logging.WARNING, logger="lm.train"), pytest.raises(
            TrainingError, match=r"step 4: 2 steps in a row with a non-finite .* the last good checkpoint is none"):
        faulty_trainer(cfg).fit()
    assert "step 4: 2 optimizer steps skipped since the last check" in caplog.text


def test_skipped_steps_are_counted_on_across_a_resume(tiny_data_dir, tmp_path, monkeypatch):
    """A run stopped after step 3 (skipped) and resumed: its skips stay in the count, and the non-finite steps
    3-5 are one run in a row that reaches the limit at step 5, as without the stop."""
    monkeypatch.setenv("LM_FAULT_NAN_STEPS", "1,3,4,5")
    flags = ["--checkpoint.every=3", "--train.max_nonfinite_steps=3"]
    first = faulty_trainer(config(tiny_data_dir, tmp_path / "run", "--train.steps=3", *flags)).fit()
    assert [r["train/skipped_steps"] for r in first if "train/skipped_steps" in r] == [1, 1, 2]
    resumed = faulty_trainer(config(tiny_data_dir, tmp_path / "run", "--train.steps=8", *flags))
    with pytest.raises(TrainingError, match=r"step 5: 3 steps in a row with a non-finite loss"):
        resumed.fit()
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_steps"] for r in rows if "train/skipped_steps" in r][3:] == [3]  # then the limit


def test_a_checkpoint_between_log_steps_counts_the_skips_since_the_last_one(tiny_data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LM_FAULT_NAN_STEPS", "1")
    faulty_trainer(config(tiny_data_dir, tmp_path / "run", "--train.steps=4", "--log.every=4",
                          "--checkpoint.every=2", "--checkpoint.keep=2")).fit()
    state = json.loads((tmp_path / "run/checkpoints/step_00000002/state.json").read_text())
    assert (state["skipped_steps"], state["skipped_in_a_row"]) == (1, 0)


def test_a_skipped_steps_loss_stays_out_of_its_windows_mean(tiny_data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LM_FAULT_NAN_STEPS", "2")
    history = faulty_trainer(config(tiny_data_dir, tmp_path / "run", "--train.steps=4", "--log.every=2")).fit()
    rows = {r["step"]: r for r in history if "train/skipped_steps" in r}
    assert rows[2]["train/skipped_steps"] == 1 and torch.isfinite(torch.tensor(rows[2]["train/loss"]))


def test_weights_that_are_not_finite_are_never_saved(tiny_data_dir, tmp_path):
    trainer = Trainer(config(tiny_data_dir, tmp_path / "run", "--train.steps=2"), init_distributed("cpu"))
    trainer.fit()
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = float("nan")
    with pytest.raises(TrainingError, match="the weights hold NaN or inf values and are not saved"):
        trainer.save()
    assert [p.name for p in complete_checkpoints(tmp_path / "run/checkpoints")] == ["step_00000002"]


def test_an_unwritable_output_directory_is_found_before_training(tiny_data_dir, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointError, match="train.out_dir: cannot write to .*file/run"):
        Trainer(config(tiny_data_dir, tmp_path / "file" / "run"), init_distributed("cpu"))


def test_a_model_too_large_for_this_machine_is_refused_before_it_is_built(tiny_data_dir, tmp_path):
    # 645 B parameters: allocated, the kernel had killed the run without a word; building it on the meta device
    # alone took minutes
    big = config(tiny_data_dir, tmp_path / "run", "--model.d_model=16384", "--model.n_head=128",
                 "--model.n_layer=200")
    with pytest.raises(ConfigError, match=r"^model: 645,112,430,592 parameters need 4,806.5 GiB of this machine's "
                                          r"memory for their float32 weights and gradients alone, and it has "):
        Trainer(big, init_distributed("cpu"))
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_val_split_smaller_than_a_micro_batch_is_refused_before_training(tmp_path):
    # it was refused at the first evaluation: after train.eval_every steps, with no checkpoint saved
    from lm.data.prepare import prepare

    for i in range(5):
        (tmp_path / f"n{i}.txt").write_text(f"Doc {i} line one.\n\nPara two of {i}.\n")
    data = load_config(None, [f"--data.source={tmp_path}/*.txt", '--data.document_separator="\\n\\n"',
                              "--data.val_fraction=0.1", f"--data.dir={tmp_path / 'data'}"]).data
    prepare(data)
    cfg = config(tmp_path / "data", tmp_path / "run", "--data.seq_len=4")
    with pytest.raises(DataError, match=r"the val split has 1 windows of data.seq_len=4, fewer than "
                                        r"train.micro_batch_size \(2\) x world size \(1\)"):
        Trainer(cfg, init_distributed("cpu"))
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_missing_mixture_source_is_named_by_its_entry(tiny_data_dir, tmp_path):
    # it was named data.dir, the key a mixture does not read
    mixture = f"--data.mixture=[{{dir: {tiny_data_dir}}}, {{dir: {tmp_path / 'gone'}}}]"
    with pytest.raises(DataError, match=r"^data.mixture\[1\].dir: no directory '.*gone'; run `python -m lm.prepare`"):
        Trainer(config(tiny_data_dir, tmp_path / "run", mixture), init_distributed("cpu"))


def test_changed_settings_are_accepted_and_logged_on_resume(tiny_data_dir, tmp_path, caplog):
    Trainer(config(tiny_data_dir, tmp_path / "run", "--train.steps=2"), init_distributed("cpu")).fit()
    with caplog.at_level(logging.INFO, logger="lm.train"):
        trainer = Trainer(config(tiny_data_dir, tmp_path / "run", "--train.steps=3", "--optim.lr=1e-3"),
                          init_distributed("cpu"))
    assert trainer.step == 2
    assert "config changed since the checkpoint: optim.lr 0.003 -> 0.001" in caplog.text
    assert "config changed since the checkpoint: train.steps 2 -> 3" in caplog.text


def train_cmd(nproc: int, data_dir: Path, out: Path, *extra: str) -> list[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "--max-restarts=1"] \
        if nproc > 1 else []
    return [sys.executable, *launcher, "-m", "lm.train", *TINY, f"--data.dir={data_dir}", f"--train.out_dir={out}",
            *extra]


def run_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def straight_run(nproc: int, data_dir: Path, out: Path, *extra: str) -> Path:
    """The uninterrupted run a faulty one is compared with, on the tests' pool of `nproc` ranks: how the ranks
    were started is not what it checks, and a pool job starts no process."""
    train_in_pool(nproc, [*TINY, f"--data.dir={data_dir}", f"--train.out_dir={out}", *extra], run_env())
    return out


def train_exit_code(args: list[str]) -> int:
    """In a rank of a pool: what `python -m lm.train ARGS` exits with; its `error:` line is on the job's stderr."""
    from lm.cli import run
    from lm.train import main

    return run(main, args)


def refused_run(nproc: int, data_dir: Path, out: Path, *extra: str) -> list[dict]:
    """`lm.train` on the tests' pool of `nproc` ranks, for a run that must stop with an `error:` line: each rank's
    reply ("value" its exit code, "stdout", "stderr"). What is checked is the refusal, not how the ranks were
    started; a rank left waiting in a collective fails the test after 120 s."""
    args = [*TINY, f"--data.dir={data_dir}", f"--train.out_dir={out}", *extra]
    return pool(nproc).run(train_exit_code, args, env=run_env(), timeout_s=120)


KILLED = ["--train.steps=8", "--checkpoint.every=2", "--train.batch_size=8"]
"""The runs whose ranks are killed: 8 steps of 8 sequences on 2 ranks, a checkpoint every 2."""


@pytest.mark.process
def test_sigterm_saves_exits_0_and_the_resumed_run_equals_an_uninterrupted_one(tiny_data_dir, tmp_path):
    # the schedule's length is fixed, so a run cut short follows the same learning rates as a long one
    steps = ["--train.steps=400", "--checkpoint.every=1000", "--schedule.decay_steps=400"]
    proc = subprocess.Popen(train_cmd(1, tiny_data_dir, tmp_path / "stopped", *steps), env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "stopped/metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    stopped_at = json.loads((tmp_path / "stopped/checkpoints" / complete_checkpoints(
        tmp_path / "stopped/checkpoints")[-1].name / "state.json").read_text())["step"]
    assert 3 <= stopped_at < 400 and f"stopped at step {stopped_at} by SIGTERM" in output
    # resume the stopped run to step stopped_at + 3, and compare with a run that never stopped
    target = [f"--train.steps={stopped_at + 3}", "--checkpoint.every=1000", "--schedule.decay_steps=400"]
    for out in ("stopped", "straight"):
        straight_run(1, tiny_data_dir, tmp_path / out, *target)
    assert_same_weights(tmp_path / "stopped", tmp_path / "straight")


# Each kill runs under one engine (ddp mid-step, fsdp mid-save): torchrun's restart is the same for both, and
# both engines' resume from their own checkpoints is checked in tests/distributed/test_engines.py.
@pytest.mark.process
def test_a_killed_rank_restarts_the_group_which_finishes_like_an_uninterrupted_run(tiny_data_dir, tmp_path):
    extra = [*KILLED, "--parallel.engine=ddp"]
    killed = subprocess.run(train_cmd(2, tiny_data_dir, tmp_path / "killed", *extra),
                            env=run_env(LM_FAULT_KILL="1:5"), capture_output=True, text=True, timeout=300)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert "resumed from" in killed.stdout and "step_00000004 at step 4" in killed.stdout
    assert_same_weights(tmp_path / "killed", straight_run(2, tiny_data_dir, tmp_path / "straight", *extra))


@pytest.mark.process
def test_a_rank_killed_during_a_save_restarts_from_the_previous_checkpoint(tiny_data_dir, tmp_path):
    # rank 1 dies right after writing its shard of step 6, while rank 0 waits for it: step_00000006.tmp is
    # left half-written, and the restarted group must resume from step 4 and still end like a straight run
    extra = [*KILLED, "--parallel.engine=fsdp"]
    killed = subprocess.run(train_cmd(2, tiny_data_dir, tmp_path / "killed", *extra),
                            env=run_env(LM_FAULT_KILL_SAVE="1:6"), capture_output=True, text=True, timeout=300)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert "step_00000004 at step 4" in killed.stdout
    assert [p.name for p in complete_checkpoints(tmp_path / "killed/checkpoints")] == [
        "step_00000004", "step_00000006", "step_00000008"]
    assert not list((tmp_path / "killed/checkpoints").glob("*.tmp"))
    assert_same_weights(tmp_path / "killed", straight_run(2, tiny_data_dir, tmp_path / "straight", *extra))


@pytest.mark.process
def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint(tiny_data_dir, tmp_path):
    # checkpoint.async: the process dies in the background write of step 6, its files written but not published,
    # while training goes on; the same command then resumes from step 4 and ends like a synchronous straight run
    extra = ["--train.steps=8", "--checkpoint.every=2"]
    args = [*TINY, f"--data.dir={tiny_data_dir}", f"--train.out_dir={tmp_path / 'killed'}", *extra,
            "--checkpoint.async=true"]
    killed = subprocess.run([sys.executable, "-m", "lm.train", *args], env=run_env(LM_FAULT_KILL_WRITE="0:6"),
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert [p.name for p in complete_checkpoints(tmp_path / "killed/checkpoints")] == [
        "step_00000002", "step_00000004"]
    assert (tmp_path / "killed/checkpoints/step_00000006.tmp/.metadata").is_file()  # written, never published
    assert "step_00000004 at step 4" in train_in_pool(1, args, run_env())
    assert [p.name for p in complete_checkpoints(tmp_path / "killed/checkpoints")] == [
        "step_00000004", "step_00000006", "step_00000008"]
    assert_same_weights(tmp_path / "killed", straight_run(1, tiny_data_dir, tmp_path / "straight", *extra))


def test_the_host_room_check_counts_every_rank_on_this_machine(tiny_data_dir, tmp_path, monkeypatch):
    """Two ranks of a 2-rank run on one machine each hold half the float32 weights and gradients (FSDP) or all of
    them: the machine must hold 8 bytes a parameter for each of its ranks' shares, i.e. 8 x params in all here.
    Two ranks on two machines need half that on each."""
    cfg = config(tiny_data_dir, tmp_path / "run")
    params = num_params(cfg.model)
    monkeypatch.setattr(setup, "physical_memory", lambda: 6 * params)  # 75% of what two local ranks need
    two_ranks = SimpleNamespace(device=torch.device("cpu"), world_size=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank here, the other on another machine
    setup.check_host_room(cfg, two_ranks)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # both ranks on this machine
    with pytest.raises(ConfigError, match=r"parameters need .* GiB of this machine's memory for their float32 "
                                          r"weights and gradients alone"):
        setup.check_host_room(cfg, two_ranks)


def test_a_nan_step_makes_every_term_nan_and_keeps_the_objective_and_reductions():
    def loss(scale: float) -> Losses:
        return Losses({"loss": Term(torch.tensor(2.0 * scale), Reduce.MEAN, 8),
                       "z_loss": Term(torch.tensor(3.0), Reduce.MEAN, 8),
                       "n": Term(torch.tensor(5.0), Reduce.SUM, 1),
                       "objective": Term(torch.tensor(2.5), Reduce.MEAN, 8)}, objective="objective")

    now = [False]
    faulty = nan_at(loss, lambda: now[0])
    clean = faulty(2.0)
    assert {name: term.value.item() for name, term in clean.terms.items()} == {
        "loss": 4.0, "z_loss": 3.0, "n": 5.0, "objective": 2.5}
    now[0] = True
    nan = faulty(2.0)
    assert nan.objective == "objective"
    assert all(math.isnan(term.value.item()) for term in nan.terms.values())
    assert {name: (term.reduce, term.weight) for name, term in nan.terms.items()} == {
        "loss": (Reduce.MEAN, 8), "z_loss": (Reduce.MEAN, 8), "n": (Reduce.SUM, 1), "objective": (Reduce.MEAN, 8)}


def test_a_kill_asked_of_another_rank_adds_no_hook_to_this_one(tiny_data_dir, tmp_path, monkeypatch):
    # one process is rank 0: LM_FAULT_KILL=1:S is another rank's, LM_FAULT_KILL=0:S this one's
    flags = ["--model.n_layer=1", "--model.n_head=2", "--model.d_model=16", "--model.block_size=32",
             "--data.seq_len=16", "--train.batch_size=2", "--train.micro_batch_size=2", "--train.device=cpu",
             "--log.tensorboard=false", f"--data.dir={tiny_data_dir}"]
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    hooks = []
    for rank in (1, 0):
        monkeypatch.setenv("LM_FAULT_KILL", f"{rank}:3")
        cfg = load_config(None, [*flags, f"--train.out_dir={tmp_path / f'rank{rank}'}"])
        trainer = Trainer(cfg, init_distributed("cpu"))
        before = len(trainer.after_step)
        install_faults(trainer)
        hooks.append(len(trainer.after_step) - before)
    assert hooks == [0, 1]
