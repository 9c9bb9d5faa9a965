"""Validation during training: the mean loss over a fixed set of val batches, the same at every evaluation."""

import math

import torch

from lm.config import JobConfig
from lm.data.loader import val_batches
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.report.metrics import perplexity
from lm.training.data import TrainingData, to_device


@torch.no_grad()
def evaluate(engine: Engine, data: TrainingData, cfg: JobConfig, env: DistEnv) -> dict[str, float]:
    """Validation metrics (a collective: every rank calls it): val/loss, the mean loss over
    `train.eval_batches` micro-batches per rank averaged over ranks, and val/ppl. For a mixture, each
    source's val split is scored so (val/<name>/loss, val/<name>/ppl) and val/loss is their mean weighted
    by the sources' shares of training."""
    engine.train(False)
    losses = []
    for windows in data.val_windows:
        total = torch.zeros((), device=env.device)
        count = 0
        for batch in val_batches(windows, cfg.train.micro_batch_size, env.rank, env.world_size,
                                 cfg.train.eval_batches, data.objective):
            total += engine.eval_loss(to_device(batch, env.device)).float()
            count += 1
        losses.append(env.all_reduce_mean(total / max(count, 1)).item())
    engine.train(True)
    if not data.is_mixture:
        return {"val/loss": losses[0], "val/ppl": perplexity(losses[0])}
    metrics = {}
    for source, loss in zip(data.sources, losses):
        metrics |= {f"val/{source.name}/loss": loss, f"val/{source.name}/ppl": perplexity(loss)}
    mean = math.fsum(share * loss for share, loss in zip(data.shares, losses))
    return {"val/loss": mean, "val/ppl": perplexity(mean), **metrics}
