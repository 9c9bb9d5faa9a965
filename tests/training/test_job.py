"""A training job refuses what cannot run before it joins a process group (`lm.training.job.run_job`)."""

import json
import os
import signal

import pytest

from lm.checkpoint.store import complete_checkpoints
from lm.config import load_config
from lm.errors import ConfigError
from lm.training import job


def _no_group(*args, **kwargs):
    raise AssertionError("a process group was started for a run that was to be refused")


@pytest.mark.parametrize("flags, message", [
    (["--parallel.engine=fsdp", "--parallel.tp=2", "--model.n_head=2"],
     r"^parallel.tp=2 does not divide the world size 1 \(ranks torchrun started\)"),
    (["--train.float8=tensorwise"], r"^train.float8=tensorwise needs a CUDA GPU .* this run's device is cpu$"),
])
def test_a_run_that_cannot_start_is_refused_before_its_process_group(flags, message, monkeypatch, tmp_path):
    # refused here, a layout or a device that does not fit costs no group, no data read and no run directory
    monkeypatch.setattr(job, "init_distributed", _no_group)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(None, ["--train.device=cpu", f"--train.out_dir={tmp_path / 'run'}", *flags])
    with pytest.raises(ConfigError, match=message):
        job.run_job(cfg)
    assert not (tmp_path / "run").exists()


def test_a_stop_signal_that_comes_during_setup_stops_the_run_at_its_first_log_step(tiny_data_dir, monkeypatch,
                                                                                  tmp_path):
    # a scheduler may send SIGTERM while the job is still building: it is kept, and honoured at the first log step
    monkeypatch.setattr(job, "install_faults", lambda trainer: os.kill(os.getpid(), signal.SIGTERM))
    out = tmp_path / "run"
    cfg = load_config(None, [
        "--model.n_layer=1", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32", "--data.seq_len=16",
        f"--data.dir={tiny_data_dir}", "--train.steps=8", "--train.batch_size=4", "--train.micro_batch_size=2",
        "--train.device=cpu", "--train.eval_batches=1", "--train.eval_every=100", "--log.every=2",
        "--checkpoint.every=100", "--log.tensorboard=false", f"--train.out_dir={out}",
    ])
    job.run_job(cfg)
    last = complete_checkpoints(out / "checkpoints")[-1]
    assert json.loads((last / "state.json").read_text())["step"] == 2
