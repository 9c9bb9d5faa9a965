"""Validation during training: the same fixed val set at every evaluation.

Pretraining scores `train.eval_batches` micro-batches of each source's val windows per rank: the mean loss
(val/loss, val/ppl), and for an encoder the share of masked tokens it predicts (val/accuracy). Fine-tuning
scores every held-out row of task.file once: loss plus accuracy and macro-F1 (classify) or MSE and Pearson's
r (regress). Every number is reduced from sums over ranks, so fine-tuning metrics do not depend on the
world size.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F

from lm.config import JobConfig
from lm.data.labelled import example_batches
from lm.data.loader import val_batches
from lm.data.masking import IGNORE
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.report.metrics import classification_metrics, perplexity, regression_metrics
from lm.training.data import TrainingData, to_device
from lm.training.task_data import TaskData


@torch.no_grad()
def evaluate(engine: Engine, data: TrainingData | TaskData, cfg: JobConfig, env: DistEnv) -> dict[str, float]:
    """Validation metrics, a collective: every rank calls it. For a mixture, each source's val split is scored
    (val/<name>/loss, val/<name>/ppl) and val/loss is their mean weighted by the sources' shares of training."""
    engine.train(False)
    try:
        if isinstance(data, TaskData):
            return _evaluate_task(engine, data, cfg, env)
        return _evaluate_windows(engine, data, cfg, env)
    finally:
        engine.train(True)


def _evaluate_windows(engine: Engine, data: TrainingData, cfg: JobConfig, env: DistEnv) -> dict[str, float]:
    masked = cfg.model.arch == "encoder"
    losses, accuracies = [], []
    for windows in data.val_windows:
        total = torch.zeros((), device=env.device)
        correct = torch.zeros(2, device=env.device)  # masked tokens predicted right, masked tokens
        count = 0
        for batch in val_batches(windows, cfg.train.micro_batch_size, env.rank, env.world_size,
                                 cfg.train.eval_batches, data.objective):
            batch = to_device(batch, env.device)
            logits, loss = engine.eval_outputs(batch)
            total += loss.float()
            count += 1
            if masked:  # logits (N, V) of the N masked positions, in the order of labels' non-ignored entries
                targets = batch[1][batch[1] != IGNORE]  # (N,)
                correct += torch.stack([(logits.argmax(-1) == targets).sum(), targets.new_tensor(targets.numel())])
        losses.append(env.all_reduce_mean(total / max(count, 1)).item())
        if masked:
            right, n = env.all_reduce_mean(correct).tolist()
            accuracies.append(right / n)
    metrics: dict[str, float] = {}
    if data.is_mixture:
        for source, loss in zip(data.sources, losses):
            metrics |= {f"val/{source.name}/loss": loss, f"val/{source.name}/ppl": perplexity(loss)}
        for source, accuracy in zip(data.sources, accuracies):
            metrics[f"val/{source.name}/accuracy"] = accuracy
    loss = math.fsum(share * loss for share, loss in zip(data.shares, losses))
    metrics = {"val/loss": loss, "val/ppl": perplexity(loss), **metrics}
    if masked:
        metrics["val/accuracy"] = math.fsum(share * a for share, a in zip(data.shares, accuracies))
    return metrics


def _evaluate_task(engine: Engine, data: TaskData, cfg: JobConfig, env: DistEnv) -> dict[str, float]:
    """Every val row once over the ranks; the losses and metrics from sums (`task_sums`)."""
    sums = torch.zeros(task_sums_size(data.kind, data.num_classes), dtype=torch.float64, device=env.device)
    for ids, labels, keep, weight in example_batches(data.val_examples, data.val_labels, cfg.train.micro_batch_size,
                                                     env.rank, env.world_size, cfg.model.pad_id):
        ids_t, labels_t, keep_t, weight_t = to_device((ids, labels, keep, weight), env.device)
        outputs, _ = engine.eval_outputs([ids_t, labels_t, keep_t])
        sums += task_sums(data.kind, data.num_classes, outputs.float(), labels_t, weight_t)
    if env.is_distributed:
        torch.distributed.all_reduce(sums)
    return task_metrics(data.kind, data.num_classes, sums.cpu().numpy())


def task_sums_size(kind: str, num_classes: int) -> int:
    """Length of `task_sums`'s vector: the summed loss, then a confusion matrix or the regression sums."""
    return 1 + (num_classes * num_classes if kind == "classify" else 7)


def task_sums(kind: str, num_classes: int, outputs: torch.Tensor, labels: torch.Tensor,
              weight: torch.Tensor) -> torch.Tensor:
    """What one batch adds to the val sums, (task_sums_size,) float64: the loss summed over real rows (weight
    1; filler rows weigh 0), then the (true, predicted) confusion counts (classify; outputs (B, n) logits) or
    `regression_metrics`' sums (regress; outputs (B,))."""
    weight = weight.double()
    if kind == "classify":
        loss = (F.cross_entropy(outputs, labels, reduction="none").double() * weight).sum()
        pairs = labels * num_classes + outputs.argmax(-1)  # (B,) index into the flattened confusion matrix
        confusion = torch.zeros(num_classes * num_classes, dtype=torch.float64, device=outputs.device)
        confusion.index_add_(0, pairs, weight)
        return torch.cat([loss[None], confusion])
    y, p = labels.double(), outputs.double()
    error = (p - y).square()
    stats = torch.stack([weight.sum(), (weight * y).sum(), (weight * p).sum(), (weight * y * y).sum(),
                         (weight * p * p).sum(), (weight * y * p).sum(), (weight * error).sum()])
    return torch.cat([(weight * error).sum()[None], stats])


def task_metrics(kind: str, num_classes: int, sums: np.ndarray) -> dict[str, float]:
    """val/loss and the task's metrics from the summed vector of `task_sums`."""
    if kind == "classify":
        confusion = sums[1:].reshape(num_classes, num_classes)
        metrics = classification_metrics(confusion)
        n = confusion.sum()
    else:
        metrics = regression_metrics(sums[1:])
        n = sums[1]
    return {"val/loss": float(sums[0] / n), **{f"val/{k}": float(v) for k, v in metrics.items()}}
