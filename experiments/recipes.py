"""The recipe comparison's report (docs/experiments.md: The recipe comparison): run by launch/recipes.sh after its
three learning-rate sweeps.

For each preset (one sweep directory each) the run with the lowest final val loss is its best learning rate.
Each best run is scored by lm.eval on the Shakespeare val split and on the King James Bible's val split (a
text of another author, never trained on); the table compares them at equal tokens (the end of every run)
and at equal wall time (each preset's val loss at the moment the fastest of them finished, linearly
interpolated between its evaluations). The figure plots val loss against tokens and against seconds.

    python -m experiments.recipes runs/recipes/demo runs/recipes/llama-tiny runs/recipes/demo-modern

The last sweep is the recipe under test; the baseline is the better (lower final val loss) of the others.
Sweep directories after `--ablations` are listed run by run in a table of their own.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from lm.cli import run as run_tool
from lm.errors import ConfigError
from lm.report.figures import load_run, save_png

HELD_OUT = "data/kjv"
FIGURE = Path("docs/experiments/recipes.png")


def val_curve(rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, seconds, val loss) at each evaluation of a run."""
    val = [row for row in rows if row.get("val/loss") is not None]
    return tuple(np.array([row[key] for row in val], dtype=float) for key in ("tokens", "elapsed_s", "val/loss"))


def final_val(run: Path) -> float:
    return val_curve(load_run(run))[2][-1]


def eval_loss(run: Path, *extra: str) -> float:
    """lm.eval's loss (nats/token) of the run's final checkpoint, windows of 128 scored whole."""
    out = subprocess.run([sys.executable, "-m", "lm.eval", "--checkpoint", str(run), "--stride", "128",
                          "--batch-size", "16", *extra], check=True, capture_output=True, text=True).stdout
    return float(re.search(r"^loss: ([0-9.]+) nats/token", out, re.M).group(1))


def tokens_per_s(rows: list[dict]) -> float:
    """Mean training throughput over the run's log lines after the first (which holds start-up)."""
    values = [row["perf/tokens_per_s"] for row in rows if "perf/tokens_per_s" in row][1:]
    return float(np.mean(values))


def first_reaching(tokens: np.ndarray, loss: np.ndarray, target: float) -> float | None:
    """Tokens at which a val curve first reaches `target`, linearly interpolated; None if it never does."""
    below = np.nonzero(loss <= target)[0]
    if not len(below):
        return None
    i = below[0]
    if i == 0:
        return float(tokens[0])
    frac = (loss[i - 1] - target) / (loss[i - 1] - loss[i])
    return float(tokens[i - 1] + frac * (tokens[i] - tokens[i - 1]))


def sweep_runs(sweep: Path) -> list[Path]:
    """The run directories of a sweep directory, refused with one line when it holds none."""
    if not (sweep / "runs").is_dir() or not any((sweep / "runs").iterdir()):
        raise ConfigError(f"{sweep}: not a sweep directory with runs (python -m lm.sweep --out writes one)")
    return sorted((sweep / "runs").iterdir())


def report(sweeps: list[str], ablations: list[str]) -> None:
    best, sweep_lines = {}, []
    for sweep in map(Path, sweeps):
        runs = sweep_runs(sweep)
        finals = {run: final_val(run) for run in runs}
        best[sweep.name] = min(finals, key=finals.get)
        sweep_lines += [f"| {sweep.name} | {run.name.rsplit('-', 1)[0]} | {loss:.4f} |"
                        for run, loss in sorted(finals.items(), key=lambda item: item[1])]
    rows = {name: load_run(run) for name, run in best.items()}
    curves = {name: val_curve(r) for name, r in rows.items()}
    t_equal = min(seconds[-1] for _, seconds, _ in curves.values())
    new = Path(sweeps[-1]).name  # the last sweep is the recipe under test, the others its baselines
    baseline = min((name for name in best if name != new), key=lambda name: curves[name][2][-1])

    print("| preset | learning rate | final val loss (trainer) |\n|---|---|---|")
    print("\n".join(sweep_lines))
    print(f"\nbest of each; equal wall time = {t_equal:.0f} s of training; baseline = {baseline}\n")
    print("| preset (best lr) | Shakespeare val, lm.eval | KJV val (held out), lm.eval | val loss at "
          f"{t_equal:.0f} s | tokens/s | tokens to reach {baseline}'s final val loss |\n|---|---|---|---|---|---|")
    for name, run in best.items():
        tokens, seconds, loss = curves[name]
        reach = first_reaching(tokens, loss, curves[baseline][2][-1])
        share = "never" if reach is None else f"{reach / curves[baseline][0][-1]:.0%}"
        print(f"| {name} ({run.name.rsplit('-', 1)[0]}) | {eval_loss(run):.4f} | "
              f"{eval_loss(run, '--data-dir', HELD_OUT):.4f} | {np.interp(t_equal, seconds, loss):.4f} | "
              f"{tokens_per_s(rows[name]):,.0f} | {share} |")

    if ablations:
        print("\n| ablation | final val loss (trainer) | Shakespeare val, lm.eval | KJV val, lm.eval | tokens/s |\n"
              "|---|---|---|---|---|")
    for sweep in map(Path, ablations):
        for run in sweep_runs(sweep):
            print(f"| {sweep.name}: {run.name.rsplit('-', 1)[0]} | {final_val(run):.4f} | {eval_loss(run):.4f} | "
                  f"{eval_loss(run, '--data-dir', HELD_OUT):.4f} | {tokens_per_s(load_run(run)):,.0f} |")

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    by_tokens, by_time = fig.subplots(1, 2)
    for i, (name, (tokens, seconds, loss)) in enumerate(curves.items()):
        label = f"{name} ({best[name].name.rsplit('-', 1)[0]})"
        by_tokens.plot(tokens / 1e3, loss, color=f"C{i}", marker="o", markersize=3, label=label)
        by_time.plot(seconds, loss, color=f"C{i}", marker="o", markersize=3, label=label)
    for ax, xlabel in ((by_tokens, "training tokens (thousands)"), (by_time, "wall time of training (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss (nats/token)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    save_png(fig, FIGURE)
    print(f"\nwrote {FIGURE}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.recipes", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", help="sweep directories, one per preset; the last is under test")
    parser.add_argument("--ablations", nargs="*", default=[], help="sweep directories listed run by run")
    args = parser.parse_args(argv)
    if len(args.sweeps) < 2:
        parser.error("give the baselines' sweep directories and then the recipe's: at least two")
    report(args.sweeps, args.ablations)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
