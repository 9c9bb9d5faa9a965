"""What only a GPU can show: skipped on machines without CUDA (CI), run by launch/bench_gpu.sh on one.

A training step must never wait for the host (CUDA's sync debug mode turns any synchronising call into an
error), attention must run a fused SDPA kernel in bf16, and bf16 training through torchrun (NCCL) must
learn.
"""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lm.bench.training import random_batch, sdpa_kernel
from lm.config import load_config
from lm.distributed.env import DistEnv, init_device
from lm.models.registry import family_of
from lm.training.faults import nan_at
from lm.training.nonfinite import SkippedSteps
from lm.training.setup import build_run_engine
from lm.training.step import train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = ["--model.n_layer=2", "--model.n_head=4", "--model.d_model=128", "--model.block_size=128",
        "--data.seq_len=128", "--train.device=cuda", "--train.batch_size=4", "--train.micro_batch_size=4"]


@pytest.mark.parametrize("optim", [[], ["--optim.name=muon", "--optim.z_loss=1e-4"]], ids=["adamw", "muon"])
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_training_step_never_waits_for_the_host(engine, optim):
    # Muon skips like the fused AdamW (torch.where on the device), and the z-loss is summed on the device
    cfg = load_config(None, [*TINY, f"--parallel.engine={engine}", *optim])
    device = init_device("cuda", "train.device")  # "cuda:0", as the trainer sets it: NCCL needs an index
    try:
        sync_free_steps(cfg, device)
    finally:
        if dist.is_initialized():  # the engine's one-process NCCL group
            dist.destroy_process_group()


def sync_free_steps(cfg, device: torch.device) -> None:
    family = family_of(cfg.model)
    built = build_run_engine(cfg, family, DistEnv(rank=0, local_rank=0, world_size=1, device=device))
    x = random_batch(cfg, 4, device)
    batch = [x[:, :-1], x[:, 1:]]
    poisoned = [False]
    # a NaN loss from the test's side, as lm.training.faults makes one
    loss = nan_at(functools.partial(family.training.loss, optim=cfg.optim), lambda: poisoned[0])

    def step(poison: bool) -> torch.Tensor:
        poisoned[0] = poison
        return train_step(built, loss, [batch], cfg.optim.lr, cfg.optim.grad_clip).applied

    step(False)  # warm-up: lazy initialisation (cuBLAS handles, FSDP's first all-gather) may synchronise
    skipped = SkippedSteps(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for poison in (True, False):  # a skipped step, then an applied one
            skipped.add(step(poison))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert skipped.read() == (1, 1)


def test_attention_runs_a_fused_kernel_in_bf16():
    cfg = load_config(None, [*TINY, "--train.dtype=bfloat16"])
    assert sdpa_kernel(cfg, torch.device("cuda"), 4) in ("flash_attention", "efficient_attention", "cudnn_attention")


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_bf16_training_under_torchrun_learns(engine, tiny_data_dir, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "lm.train",
           *TINY, "--train.dtype=bfloat16", f"--parallel.engine={engine}", "--train.steps=30", "--log.every=10",
           "--train.eval_every=30", "--train.eval_batches=2", "--optim.lr=3e-3", "--log.tensorboard=false",
           f"--data.dir={tiny_data_dir}", f"--train.out_dir={tmp_path / 'run'}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5
    assert all(r["perf/mfu"] is None or 0 < r["perf/mfu"] < 1 for r in rows if "perf/mfu" in r)
