"""Training steps on one GPU for the tests of tests/gpu: a config's engine built at world size 1, stepped on one
fixed random batch."""

import functools

import torch.distributed as dist

from lm.bench.training import random_batch
from lm.config import JobConfig
from lm.distributed.env import DistEnv, init_device
from lm.models.registry import family_of
from lm.training.setup import build_run_engine
from lm.training.step import train_step


def step_losses(cfg: JobConfig, steps: int) -> list[float]:
    """Training losses of `steps` steps of `cfg` on one fixed random micro-batch, from train.seed's weights, the
    family's update after each step (a router's bias) included."""
    device = init_device("cuda", "train.device")
    family = family_of(cfg.model)
    try:
        built = build_run_engine(cfg, family, DistEnv(rank=0, local_rank=0, world_size=1, device=device))
        x = random_batch(cfg, cfg.train.micro_batch_size, device)
        loss = functools.partial(family.training.loss, optim=cfg.optim)
        return [train_step(built, loss, [[x[:, :-1], x[:, 1:]]], cfg.optim.lr, 1.0,
                           family.training.after_step).terms["loss"].value.item() for _ in range(steps)]
    finally:
        if dist.is_initialized():  # the fsdp engine's one-process group
            dist.destroy_process_group()
