"""Loss and perplexity curves of runs, from each run's own metrics.jsonl, as matplotlib figures and PNGs.

Runs logged before rows carried `tokens` get it from their config.yaml (train.batch_size * data.seq_len
tokens per step, the trainer's own count); such runs have no `elapsed_s`, so `val_time_figure` refuses
them. Figures are built with matplotlib's object-oriented API on the Agg canvas: no display is needed
and no pyplot global state is touched.
"""

from pathlib import Path

import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lm.errors import PlotError
from lm.io import atomic_path
from lm.report.metrics import METRICS_FILE, read_metrics, row_kind

__all__ = ["curves_figure", "load_run", "run_labels", "save_png", "val_time_figure"]

KINDS = ("train", "val")


def run_labels(run_dirs: list[str | Path]) -> list[str]:
    """Each run's directory name; a name met before gets " (2)", " (3)", ... so legends stay apart."""
    labels: list[str] = []
    for run_dir in run_dirs:
        name = Path(run_dir).resolve().name
        label, n = name, 1
        while label in labels:
            n += 1
            label = f"{name} ({n})"
        labels.append(label)
    return labels


def load_run(run_dir: str | Path) -> list[dict]:
    """The rows of a run's metrics log (see `read_metrics`), every one with a `tokens` count."""
    rows = read_metrics(run_dir)
    if all("tokens" in row for row in rows):
        return rows
    per_step = _tokens_per_step(Path(run_dir))
    return [row if "tokens" in row else {**row, "tokens": row["step"] * per_step} for row in rows]


def _tokens_per_step(run_dir: Path) -> int:
    """train.batch_size * data.seq_len from the run's resolved config, for rows logged without `tokens`."""
    path = run_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text())
        per_step = cfg["train"]["batch_size"] * cfg["data"]["seq_len"]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError) as err:
        raise PlotError(f"{run_dir / METRICS_FILE} has rows without 'tokens' and {path} cannot supply "
                        f"train.batch_size * data.seq_len ({type(err).__name__}: {err})") from None
    if not isinstance(per_step, int) or isinstance(per_step, bool) or per_step <= 0:
        raise PlotError(f"{path}: train.batch_size * data.seq_len should be a positive integer, got {per_step!r}")
    return per_step


def _series(rows: list[dict], kind: str, x_key: str, y_key: str) -> tuple[list, list]:
    """x and y of the rows of `kind` (train or val) that carry `y_key`, in logged order."""
    points = [(row[x_key], row[y_key]) for row in rows if row_kind(row) == kind and row.get(y_key) is not None]
    return [x for x, _ in points], [y for _, y in points]


_SOURCE_MARKERS = ("s", "^", "v", "D")


def mixture_sources(rows: list[dict]) -> list[str]:
    """The sources of a mixture run, in logged order: the <name> of its val/<name>/loss keys."""
    names: dict[str, None] = {}
    for row in rows:
        names |= {key[4:-5]: None for key in row if key.startswith("val/") and key.endswith("/loss")
                  and key.count("/") == 2}
    return list(names)


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def curves_figure(runs: dict[str, list[dict]]) -> Figure:
    """Loss and perplexity by step and by tokens (2x2 axes) for `runs` ({label: rows}).

    Each run draws one colour: a `"<label> train"` line and a `"<label> val"` line with markers, each only
    where the run has rows of that kind, and for a mixture a dotted `"<label> val <source>"` line per source.
    Rows need `step` and `tokens` (see `load_run`). Perplexity is the logged `*/ppl`, on a log scale since
    it spans orders of magnitude early in training.
    """
    fig = _new_figure(12, 8)
    axes = fig.subplots(2, 2)
    panels = [  # (axes, x key, metric, y label)
        (axes[0, 0], "step", "loss", "loss (nats/token)"), (axes[0, 1], "tokens", "loss", "loss (nats/token)"),
        (axes[1, 0], "step", "ppl", "perplexity"), (axes[1, 1], "tokens", "ppl", "perplexity"),
    ]
    for ax, x_key, metric, y_label in panels:
        for i, (label, rows) in enumerate(runs.items()):
            for kind in KINDS:
                x, y = _series(rows, kind, x_key, f"{kind}/{metric}")
                if x:
                    ax.plot(x, y, color=f"C{i % 10}", label=f"{label} {kind}",
                            **({"marker": "o", "linestyle": "--", "markersize": 4} if kind == "val" else {}))
            for j, name in enumerate(mixture_sources(rows)):  # a mixture's val split of each source
                x, y = _series(rows, "val", x_key, f"val/{name}/{metric}")
                ax.plot(x, y, color=f"C{i % 10}", label=f"{label} val {name}", marker=_SOURCE_MARKERS[j % 4],
                        linestyle=":", markersize=4)
        ax.set_xlabel("tokens trained" if x_key == "tokens" else "step")
        ax.set_ylabel(y_label)
        ax.set_title(f"{y_label.split(' ')[0]} by {x_key}")
        ax.grid(True, alpha=0.3)
        if metric == "ppl":
            ax.set_yscale("log")
    if axes[0, 0].lines:
        axes[0, 0].legend(fontsize="small")
    return fig


def val_time_figure(runs: dict[str, list[dict]]) -> Figure:
    """Validation loss against wall seconds of training (`elapsed_s`), one curve per run with val rows.

    PlotError names a run whose val rows lack `elapsed_s` (logged before the trainer recorded it).
    """
    fig = _new_figure(8, 5)
    ax = fig.subplots()
    for i, (label, rows) in enumerate(runs.items()):
        val_rows = [row for row in rows if row_kind(row) == "val" and row.get("val/loss") is not None]
        if any("elapsed_s" not in row for row in val_rows):
            raise PlotError(f"run {label!r}: val rows without 'elapsed_s' (logged by an older trainer)")
        x, y = _series(val_rows, "val", "elapsed_s", "val/loss")
        if x:
            ax.plot(x, y, color=f"C{i % 10}", marker="o", markersize=4, label=label)
    ax.set_xlabel("wall time of training (s)")
    ax.set_ylabel("val loss (nats/token)")
    ax.set_title("val loss by wall time")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    return fig


def save_png(fig: Figure, path: str | Path) -> None:
    """Write `fig` to `path` as a PNG of the figure's own size (creating parent directories).

    The PNG goes to a temporary file beside `path` and replaces it only once complete, so a failed
    save never leaves half a PNG over a good one. The figure is not registered with pyplot, so once
    the caller drops it there is nothing left to close.
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        fig.savefig(f, format="png", dpi=fig.dpi)
