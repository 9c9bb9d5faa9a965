"""`python -m lm.plot RUN_DIR [RUN_DIR ...] [--out PNG]`: loss and perplexity curves of runs, as a PNG.

Curves come from each run's own metrics.jsonl (`lm.report.figures`), so they can be looked at without a
TensorBoard server.
"""

import argparse
import sys
from pathlib import Path

from lm.cli import a_path, run
from lm.errors import PlotError
from lm.io import output_file_problem
from lm.report.figures import curves_figure, load_run, run_labels, save_png


def _output_path(run_dirs: list[Path], out: Path | None) -> Path:
    if out is None:
        if len(run_dirs) > 1:
            raise PlotError(f"--out is required with several run directories ({len(run_dirs)} given)")
        out = run_dirs[0] / "curves.png"
    elif out.suffix.lower() != ".png":
        raise PlotError(f"--out {out}: the figure is written as PNG; name the file *.png")
    if problem := output_file_problem(out):
        raise PlotError(f"--out {problem}")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lm.plot",
        description="Draw train/val loss and perplexity curves, by step and by tokens trained, of one or "
                    "more runs into one PNG, from each run's metrics.jsonl (no TensorBoard needed).",
    )
    parser.add_argument("run_dirs", nargs="+", type=a_path, metavar="RUN_DIR",
                        help="a training run directory (train.out_dir) holding metrics.jsonl")
    parser.add_argument("--out", type=a_path, default=None,
                        help="the PNG to write (default: RUN_DIR/curves.png; required with several runs)")
    args = parser.parse_args(argv)
    out = _output_path(args.run_dirs, args.out)
    # every run is read and checked before anything is written
    runs = {label: load_run(d) for label, d in zip(run_labels(args.run_dirs), args.run_dirs)}
    if not any(row.get(key) is not None for rows in runs.values() for row in rows for key in row
               if key.endswith(("/loss", "/ppl"))):
        raise PlotError(f"{', '.join(map(str, args.run_dirs))}: no loss or perplexity logged yet; nothing to draw")
    save_png(curves_figure(runs), out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
