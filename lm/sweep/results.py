"""A sweep's comparison table: one row per run from its metrics log, sorted by validation loss."""

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from lm.errors import MetricsError, PlotError
from lm.report.figures import load_run
from lm.report.metrics import METRICS_FILE, perplexity, row_kind


@dataclass
class RunResult:
    name: str
    settings: dict[str, object]
    """The run's grid values."""
    params: int
    status: str
    """finished, or why not (failed with exit 2, ...)."""
    tokens: int | None = None
    wall_s: float | None = None
    """Wall seconds of training, evaluations included, over every process that resumed the run."""
    train_loss: float | None = None
    val_loss: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.wall_s if self.tokens and self.wall_s else None

    @property
    def sort_key(self) -> tuple[bool, bool, float]:
        """Finished runs by val loss, then the rest by theirs; in each, a run without one (or with a non-finite
        one, which compares with nothing) last."""
        known = self.val_loss is not None and math.isfinite(self.val_loss)
        return self.status != "finished", not known, self.val_loss if known else math.inf


def read_result(run_dir: Path, settings: dict[str, object], params: int, status: str) -> RunResult:
    """The last train and val rows of a run's metrics log (what it trained to). A run with no rows (one that
    failed before its first log step) has no numbers; a log that cannot be read is named in the status, and the
    other runs are still compared."""
    result = RunResult(run_dir.name, settings, params, status)
    if not (run_dir / METRICS_FILE).is_file() or not (run_dir / METRICS_FILE).read_bytes().strip():
        return result
    try:
        rows = load_run(run_dir)
    except (MetricsError, PlotError) as err:
        result.status = f"{status}; its metrics are unreadable: {err}"
        return result
    # a train row without a loss: every step of its window was skipped
    last = {kind: [r for r in rows if row_kind(r) == kind and f"{kind}/loss" in r][-1:] for kind in ("train", "val")}
    if last["train"]:
        result.train_loss = last["train"][0]["train/loss"]
    if last["val"]:
        result.val_loss = last["val"][0]["val/loss"]
    result.tokens, result.wall_s = rows[-1]["tokens"], rows[-1].get("elapsed_s")
    return result


COLUMNS = ["params", "tokens", "wall time (s)", "tokens/s", "train loss", "train ppl", "val loss", "val ppl"]


def table_rows(results: list[RunResult], separators: bool = True) -> tuple[list[str], list[list[str]]]:
    """Header and rows (as text) of the comparison, best val loss first; `separators` groups thousands."""
    keys = list(results[0].settings) if results else []
    header = ["rank", "run", *keys, *COLUMNS, "status"]
    whole = "{:,.0f}" if separators else "{:.0f}"
    rows = []
    for rank, r in enumerate(sorted(results, key=lambda r: r.sort_key), 1):
        rows.append([
            str(rank), r.name, *(str(r.settings[k]) for k in keys), whole.format(r.params), _num(r.tokens, whole),
            _num(r.wall_s, "{:.1f}"), _num(r.tokens_per_s, whole), _num(r.train_loss, "{:.4f}"),
            _num(_ppl(r.train_loss), "{:.2f}"), _num(r.val_loss, "{:.4f}"), _num(_ppl(r.val_loss), "{:.2f}"),
            r.status,
        ])
    return header, rows


def _ppl(loss: float | None) -> float | None:
    return None if loss is None else perplexity(loss)


def _num(value: float | None, fmt: str) -> str:
    return "" if value is None else fmt.format(value)


def markdown(results: list[RunResult]) -> str:
    header, rows = table_rows(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def csv_text(results: list[RunResult]) -> str:
    """The same table with plain numbers, for spreadsheets and pandas."""
    header, rows = table_rows(results, separators=False)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()

