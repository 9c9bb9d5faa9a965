"""Validation during training: the mean loss over a fixed set of val batches, the same at every evaluation."""

import torch

from lm.config import JobConfig
from lm.data.loader import val_batches
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.training.data import TrainingData, to_device


@torch.no_grad()
def evaluate(engine: Engine, data: TrainingData, cfg: JobConfig, env: DistEnv) -> float:
    """Mean validation loss over `train.eval_batches` micro-batches per rank, averaged over ranks (a
    collective: every rank calls it)."""
    engine.train(False)
    total = torch.zeros((), device=env.device)
    count = 0
    for batch in val_batches(data.val_windows, cfg.train.micro_batch_size, env.rank, env.world_size,
                             cfg.train.eval_batches, data.objective):
        total += engine.eval_loss(to_device(batch, env.device)).float()
        count += 1
    engine.train(True)
    mean = total / max(count, 1)
    return env.all_reduce_mean(mean).item()
