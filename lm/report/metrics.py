"""A run's metrics log, <out_dir>/metrics.jsonl: its name, its reader, and the perplexity of a loss.

The trainer writes it (`lm.training.logger`); plots, sweeps and anyone else read it here. Each line is one
JSON object: `step`, `tokens` (trained so far), `elapsed_s` (wall seconds of training so far, carried
over resumes) and the namespaced scalars (`train/loss`, `val/ppl`, ...).
"""

import json
import math
from pathlib import Path

from lm.errors import MetricsError


def perplexity(loss: float) -> float:
    """exp(loss), saturating instead of overflowing for a diverged run."""
    return math.exp(loss) if loss < 700 else math.inf


METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of <run_dir>/metrics.jsonl as the run's final history.

    A run resumed from a checkpoint logs again the steps after that checkpoint; the later row supersedes:
    a row of step s drops every earlier row of the same kind (train or val) at step >= s.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MetricsError(f"{path}: no metrics log; is {run_dir} a training run directory (train.out_dir)?")
    rows: list[dict] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise MetricsError(f"{path}:{number}: not a JSON object ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise MetricsError(f"{path}:{number}: expected a JSON object with an integer 'step'")
        kind = row_kind(row)
        rows = [r for r in rows if row_kind(r) != kind or r["step"] < row["step"]]
        rows.append(row)
    if not rows:
        raise MetricsError(f"{path}: the metrics log is empty; the run has not logged a step yet")
    return rows


def row_kind(row: dict) -> str:
    """'val' for a validation row, 'train' otherwise: the namespace of its scalars."""
    return "val" if any(key.startswith("val/") for key in row) else "train"
