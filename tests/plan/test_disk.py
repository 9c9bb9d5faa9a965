from functools import partial

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

SMALL = ["--model.n_layer=2", "--model.d_model=64", "--model.block_size=32", "--data.seq_len=16"]


@pytest.mark.parametrize("overrides", [
    [],                                                                                          # GPT-2, tied head
    ["--model.pos=rope", "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.bias=false",
     "--model.tie_embeddings=false"],                                                            # Llama, untied
    ["--model.arch=encdec", "--model.pos=sinusoidal", "--model.n_sentinels=8"],                 # shared and tied
    ["--model.arch=lstm"],
    ["--parallel.engine=deepspeed", "--parallel.zero_stage=1", "--train.batch_size=2",
     "--train.micro_batch_size=2"],                                          # its own files; one micro-batch a step
], ids=["gpt2", "llama-untied", "encdec", "lstm", "deepspeed"])
def test_the_estimate_covers_what_a_save_writes_and_not_much_more(tmp_path, overrides):
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
    step_dir = save_checkpoint(tmp_path, 1, engine, {"step": 1, "tokens_seen": 0, "position": 0}, cfg, env, keep=1)
    written = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    assert written <= checkpoint_bytes(cfg) <= 1.03 * written + 2.5 * 2**20
