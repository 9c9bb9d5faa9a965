"""A run's metrics log, <out_dir>/metrics.jsonl: its name, its reader, the perplexity of a loss, and the
scores of a fine-tuned head.

The trainer writes it (`lm.training.logger`); plots, sweeps and anyone else read it here. Each line is one
JSON object: `step`, `tokens` (trained so far), `elapsed_s` (wall seconds of training so far, carried
over resumes) and the namespaced scalars (`train/loss`, `val/ppl`, ...).

A head's scores come from sufficient statistics, counts and sums that add up over batches and ranks (one
all-reduce of a small array), rather than from every prediction gathered in one place.
"""

import json
import math
from pathlib import Path

import numpy as np

from lm.errors import MetricsError
from lm.io import read_utf8


def perplexity(loss: float) -> float:
    """exp(loss), saturating instead of overflowing for a diverged run (and NaN for a NaN loss)."""
    return math.exp(loss) if loss < 700 or math.isnan(loss) else math.inf


METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of <run_dir>/metrics.jsonl as the run's final history.

    A run resumed from a checkpoint logs again the steps after that checkpoint; the later row supersedes:
    a row of step s drops every earlier row of the same kind (train, val or tasks, `row_kind`) at step >= s.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MetricsError(f"{path}: no metrics log; is {run_dir} a training run directory (train.out_dir)?")
    rows: list[dict] = []
    text = read_utf8(path)  # not UTF-8: one error naming the file
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                break  # a row cut short by a killed run or a full disk: the rows before it stand
            raise MetricsError(f"{path}:{number}: not a JSON object ({err.msg})") from None
        if not isinstance(row, dict) or not _is_number(row.get("step"), int):
            raise MetricsError(f"{path}:{number}: expected a JSON object with an integer 'step'")
        for key, value in row.items():  # what the trainer writes: numbers, and null for a score it could not tell
            if (key in ("tokens", "elapsed_s") or "/" in key) and value is not None and not _is_number(value):
                raise MetricsError(f"{path}:{number}: {key!r} is {value!r}; expected a number (or null)")
        kind = row_kind(row)
        rows = [r for r in rows if row_kind(r) != kind or r["step"] < row["step"]]
        rows.append(row)
    if not rows:
        raise MetricsError(f"{path}: the metrics log is empty; the run has not logged a step yet")
    return rows


def _is_number(value: object, kind: type | tuple[type, ...] = (int, float)) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def row_kind(row: dict) -> str:
    """The namespace of a row's scalars: 'val' (validation), 'tasks' (`train.eval_tasks`) or 'train'."""
    for kind in ("val", "tasks"):
        if any(key.startswith(f"{kind}/") for key in row):
            return kind
    return "train"


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int,
                     weight: np.ndarray | None = None) -> np.ndarray:
    """(num_classes, num_classes) float64 counts: [i, j] = the (weighted) examples of class i predicted as j,
    from labels and predictions (N,) of classes in [0, num_classes) and optional weights (N,)."""
    labels, predictions = np.asarray(labels, dtype=np.int64), np.asarray(predictions, dtype=np.int64)
    flat = np.bincount(labels * num_classes + predictions, weights=weight, minlength=num_classes * num_classes)
    return flat.astype(np.float64).reshape(num_classes, num_classes)


def classification_metrics(confusion: np.ndarray) -> dict[str, float]:
    """Accuracy and macro F1 of a confusion matrix (n, n) (rows true classes, columns predictions; the sum of
    `confusion_matrix` over batches and ranks).

    F1 of class c is 2 tp / (2 tp + fp + fn); the macro mean leaves out the classes that are neither in the
    data nor predicted (0 / 0), as such a class says nothing of the model.
    """
    confusion = np.asarray(confusion, dtype=np.float64)
    if confusion.ndim != 2 or confusion.shape[0] != confusion.shape[1] or confusion.sum() <= 0:
        raise ValueError(f"a confusion matrix is square with a positive total, got shape {confusion.shape} "
                         f"and total {confusion.sum()}")
    tp = np.diag(confusion)  # (n,)
    seen = confusion.sum(axis=0) + confusion.sum(axis=1)  # (n,) 2 tp + fp + fn
    present = seen > 0
    return {"accuracy": float(tp.sum() / confusion.sum()), "f1": float(np.mean(2 * tp[present] / seen[present]))}


REGRESSION_SUMS = ("n", "sum_y", "sum_p", "sum_yy", "sum_pp", "sum_yp", "sum_sq_err")
"""The layout of `regression_sums`: the count, then sums of y, p, y^2, p^2, y*p and (p - y)^2 for targets y
and predictions p, each less a common `center`. The squared error is summed itself, not derived from the
others, so the MSE of a good model does not lose its digits to cancellation."""


def regression_sums(labels: np.ndarray, predictions: np.ndarray, weight: np.ndarray | None = None,
                    center: float = 0.0) -> np.ndarray:
    """The sufficient statistics (7,) float64 (layout `REGRESSION_SUMS`) of targets and predictions (N,),
    each example counted with its weight (N,) (default 1), both less `center`, the same for every batch summed (a
    target, say the first): the sums then hold the spread and not the offset, whose square would cancel the
    variances' digits away (targets near 1e8 lost their correlation), and constant targets sum to exactly 0."""
    y = np.asarray(labels, dtype=np.float64) - center
    p = np.asarray(predictions, dtype=np.float64) - center
    w = np.ones_like(y) if weight is None else np.asarray(weight, dtype=np.float64)
    return np.array([w.sum(), (w * y).sum(), (w * p).sum(), (w * y * y).sum(), (w * p * p).sum(),
                     (w * y * p).sum(), (w * (p - y) ** 2).sum()])


def regression_metrics(sums: np.ndarray) -> dict[str, float | None]:
    """Mean squared error and Pearson correlation from sums (7,) in the layout `REGRESSION_SUMS` (summed over
    batches and ranks, best in float64). Pearson is None, undefined, when the targets or the predictions are
    constant (as one row always is): a NaN would be no JSON in metrics.jsonl."""
    n, sum_y, sum_p, sum_yy, sum_pp, sum_yp, sum_sq_err = np.asarray(sums, dtype=np.float64).tolist()
    if n <= 0:
        raise ValueError(f"regression sums need a positive count, got n = {n}")
    cov = sum_yp - sum_y * sum_p / n
    var_y, var_p = sum_yy - sum_y * sum_y / n, sum_pp - sum_p * sum_p / n
    # a column whose variance is at the rounding of its squares is constant (a constant off the center leaves one)
    spread = var_y > 1e-12 * sum_yy and var_p > 1e-12 * sum_pp
    # clipped: rounding can carry |r| of identical columns a hair past 1
    pearson = min(1.0, max(-1.0, cov / math.sqrt(var_y * var_p))) if spread else None
    return {"mse": sum_sq_err / n, "pearson": pearson}
