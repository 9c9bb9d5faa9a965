"""Validation during training: the same fixed val set at every evaluation.

Pretraining scores `train.eval_batches` micro-batches of each source's val windows per rank: the mean loss
(val/loss, val/ppl), and where the family scores predictions (an encoder's masked tokens) the share it
predicts right (val/accuracy). Fine-tuning
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
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.models.family import Family
from lm.report.metrics import (
    REGRESSION_SUMS,
    classification_metrics,
    confusion_matrix,
    perplexity,
    regression_metrics,
    regression_sums,
)
from lm.training.task_data import TaskData
from lm.training.token_data import TrainingData, to_device


@torch.no_grad()
def evaluate(engine: Engine, family: Family, data: TrainingData | TaskData, cfg: JobConfig,
             env: DistEnv) -> dict[str, float]:
    """Validation metrics, a collective: every rank calls it. For a mixture, each source's val split is scored
    (val/<name>/loss, val/<name>/ppl) and val/loss is their mean weighted by the sources' shares of training."""
    engine.train(False)
    try:
        if isinstance(data, TaskData):
            return _evaluate_task(engine, family, data, cfg, env)
        return _evaluate_windows(engine, family, data, cfg, env)
    finally:
        engine.train(True)


def _evaluate_windows(engine: Engine, family: Family, data: TrainingData, cfg: JobConfig,
                      env: DistEnv) -> dict[str, float]:
    """The mean of each micro-batch's loss; where the family scores predictions (an encoder's masked tokens),
    also the share it predicts right."""
    losses, accuracies = [], []
    for windows in data.val_windows:
        total = torch.zeros((), device=env.device)
        correct = torch.zeros(2, device=env.device)  # targets predicted right, targets
        count, scores_accuracy = 0, False
        for batch in val_batches(windows, cfg.train.micro_batch_size, env.dp_rank, env.dp_size,
                                 cfg.train.eval_batches, data.objective):
            batch = to_device(batch, env.device)
            scored = engine.evaluate(lambda model, run, batch=batch: family.training.score(model, run, batch))
            total += scored.loss
            count += 1
            if scored.correct is not None:
                scores_accuracy = True
                correct += torch.stack([scored.correct, scored.correct.new_tensor(scored.count)])
        losses.append(env.all_reduce_mean(total / max(count, 1)).item())
        if scores_accuracy:
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
    if accuracies:
        metrics["val/accuracy"] = math.fsum(share * a for share, a in zip(data.shares, accuracies))
    return metrics


def _evaluate_task(engine: Engine, family: Family, data: TaskData, cfg: JobConfig, env: DistEnv) -> dict[str, float]:
    """Every val row once over the ranks; the losses and metrics from sums (`task_sums`)."""
    sums = np.zeros(task_sums_size(data.kind, data.num_classes))
    center = float(data.val_labels[0])
    for ids, labels, keep, weight in example_batches(data.val_examples, data.val_labels, cfg.train.micro_batch_size,
                                                     env.dp_rank, env.dp_size, cfg.model.pad_id):
        ids_t, keep_t = to_device((ids, keep), env.device)
        outputs = engine.evaluate(lambda model, run, ids_t=ids_t, keep_t=keep_t:
                                  family.training.head.outputs(model, run, ids_t, keep_t))
        sums += task_sums(data.kind, data.num_classes, outputs, labels, weight, center)
    if env.is_distributed:
        total = torch.from_numpy(sums).to(env.device)
        torch.distributed.all_reduce(total)
        sums = total.cpu().numpy() / env.tp  # the ranks of a tensor-parallel group scored the same rows
    return task_metrics(data.kind, data.num_classes, sums)


def task_sums_size(kind: str, num_classes: int) -> int:
    """Length of `task_sums`'s vector."""
    return 1 + num_classes * num_classes if kind == "classify" else len(REGRESSION_SUMS)


def task_sums(kind: str, num_classes: int, outputs: torch.Tensor, labels: np.ndarray,
              weight: np.ndarray, center: float = 0.0) -> np.ndarray:
    """What one batch adds to the val sums, (task_sums_size,) float64, each row counted with its weight (1 for
    real rows, 0 for `example_batches`' fillers). classify (outputs (B, n) logits): the summed cross-entropy,
    then `confusion_matrix`'s counts; regress (outputs (B,)): `regression_sums` about `center` (the same for every
    batch), whose squared error is the loss."""
    outputs = outputs.detach().float().cpu()
    if kind == "regress":
        return regression_sums(labels, outputs.numpy(), weight, center)
    cross_entropy = F.cross_entropy(outputs, torch.from_numpy(labels), reduction="none").double().numpy()  # (B,)
    confusion = confusion_matrix(labels, outputs.argmax(-1).numpy(), num_classes, weight)
    return np.concatenate([[cross_entropy @ weight], confusion.ravel()])


def task_metrics(kind: str, num_classes: int, sums: np.ndarray) -> dict[str, float | None]:
    """val/loss and the task's metrics from the summed vector of `task_sums` (None where one is undefined)."""
    if kind == "regress":
        metrics = regression_metrics(sums)
        loss = metrics["mse"]
    else:
        confusion = sums[1:].reshape(num_classes, num_classes)
        metrics = classification_metrics(confusion)
        loss = sums[0] / confusion.sum()
    return {"val/loss": float(loss), **{f"val/{k}": None if v is None else float(v) for k, v in metrics.items()}}
