from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from lm.checkpoint.store import save_checkpoint
from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.models.registry import family_of
from lm.plan.disk import checkpoint_bytes
from lm.training.setup import build_run_engine
from lm.training.step import train_step
from tests.workers import pool

SMALL = ["--model.n_layer=2", "--model.d_model=64", "--model.block_size=32", "--data.seq_len=16"]


def saved_and_estimated(out: Path, overrides: list[str]) -> tuple[int, int]:
    """The bytes a checkpoint of one training step under `overrides` writes to `out`, and `checkpoint_bytes`' estimate
    of them."""
    heads = [] if "--model.arch=lstm" in overrides else ["--model.n_head=2"]
    cfg = load_config(None, [*SMALL, *heads, *overrides])
    env = init_distributed("cpu")
    family = family_of(cfg.model)
    engine = build_run_engine(cfg, family, env)
    rows = np.random.default_rng(0).integers(0, 1000, (2, cfg.data.seq_len + 1))
    batch = family.training.objective(cfg.model, cfg.data, cfg.data.seq_len, 0)(rows, np.arange(2))
    # AdamW's moments exist from the first step on
    train_step(engine, partial(family.training.loss, optim=cfg.optim), [[torch.from_numpy(a) for a in batch]],
               cfg.optim.lr, cfg.optim.grad_clip)
    step_dir = save_checkpoint(out, 1, engine, {"step": 1, "tokens_seen": 0, "position": 0}, cfg, env, keep=1)
    return sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file()), checkpoint_bytes(cfg)


@pytest.mark.parametrize("overrides", [
    [],                                                                                          # GPT-2, tied head
    ["--model.pos=rope", "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.bias=false",
     "--model.tie_embeddings=false"],                                                            # Llama, untied
    ["--model.arch=encdec", "--model.pos=sinusoidal", "--model.n_sentinels=8"],                 # shared and tied
    ["--model.arch=lstm"],
], ids=["gpt2", "llama-untied", "encdec", "lstm"])
def test_the_estimate_covers_what_a_save_writes_and_not_much_more(tmp_path, overrides):
    written, estimate = saved_and_estimated(tmp_path, overrides)
    assert written <= estimate <= 1.03 * written + 2.5 * 2**20


@pytest.mark.process  # in a pool's rank: DeepSpeed keeps its groups module-wide, so its group must outlive it
def test_the_estimate_covers_a_deepspeed_checkpoint_and_not_much_more(tmp_path):
    # DeepSpeed's own files; one micro-batch a step, so that the moments exist
    flags = ["--parallel.engine=deepspeed", "--parallel.zero_stage=1", "--train.batch_size=2",
             "--train.micro_batch_size=2"]
    written, estimate = pool(1).run(saved_and_estimated, tmp_path, flags)[0]["value"]
    assert written <= estimate <= 1.03 * written + 2.5 * 2**20
