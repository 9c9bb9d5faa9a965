"""fsdp's parallel.cpu_offload on a GPU: skipped without CUDA (a CPU run refuses offload). FSDP2 offloads the
parameters alone; a buffer the forward reads (a mixture of experts' balancing bias) stays on the GPU."""

import functools

import pytest
import torch
import torch.distributed as dist

from lm.bench.training import random_batch
from lm.config import load_config
from lm.distributed.env import DistEnv, init_device
from lm.models.registry import family_of
from lm.training.setup import build_run_engine
from lm.training.step import train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MOE = ["--model.n_layer=2", "--model.n_head=4", "--model.d_model=128", "--model.block_size=128", "--model.pos=rope",
       "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.bias=false", "--model.n_experts=4",
       "--model.experts_per_token=2", "--model.expert_d_ff=128", "--model.router_bias_rate=0.01",
       "--data.seq_len=128", "--train.device=cuda", "--train.batch_size=4", "--train.micro_batch_size=4",
       "--parallel.engine=fsdp", "--optim.lr=3e-3", "--schedule.warmup_steps=0"]


def losses(flags: list[str], steps: int = 4) -> list[float]:
    cfg = load_config(None, [*MOE, *flags])
    device = init_device("cuda", "train.device")
    family = family_of(cfg.model)
    try:
        built = build_run_engine(cfg, family, DistEnv(rank=0, local_rank=0, world_size=1, device=device))
        x = random_batch(cfg, 4, device)
        loss = functools.partial(family.training.loss, optim=cfg.optim)
        return [train_step(built, loss, [[x[:, :-1], x[:, 1:]]], cfg.optim.lr, 1.0,
                           family.training.after_step).terms["loss"].value.item() for _ in range(steps)]
    finally:
        if dist.is_initialized():  # the fsdp engine's one-process group
            dist.destroy_process_group()


def test_an_offloaded_mixture_of_experts_trains_as_one_on_the_gpu():
    on_gpu, offloaded = losses([]), losses(["--parallel.cpu_offload=true"])
    assert offloaded == pytest.approx(on_gpu, rel=1e-3) and offloaded[-1] < offloaded[0]
