"""`python -m lm.layouts --config CFG --layout 1 --layout 4:tp=2 ...`: train one short job under several layouts
and print their losses side by side.

A layout is `NPROC` or `NPROC:key=value,...` with keys of the `parallel` section: `4:tp=2` is tensor-parallel 2 x
FSDP2 2 on 4 processes, `4:pp=2,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2` an interleaved pipeline, `2:ep=2`
a mixture's experts split over 2 processes, `1` one process. Every layout trains the same config from the same seed
on the same global batches, each into OUT/<layout>/ with its log beside it (engine fsdp unless a layout names
another), one after another on this machine. The table that follows gives each layout's train loss per step and the
largest difference between layouts at that step; the last line the largest of all. Layouts that train the same model
agree to float rounding (about 1e-6 relative in float32); --max-rel turns a larger difference, or a loss that was
not finite (nan in the table), into exit status 1.
Other `--section.key=value` arguments override the config for every layout. Every layout is checked before any
trains (the model's split, the world size, the global batch's split over its data-parallel replicas): a bad one
is one `error:` line naming it, exit status 2, and nothing trained or written.
"""

import argparse
import json
import logging
import math
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lm.cli import a_path, finite_float, positive_int, prepare_command, run, run_logged, train_command
from lm.config import OneConfig, load_config
from lm.distributed.layout import check_world
from lm.errors import ConfigError
from lm.io import output_dir_problem

log = logging.getLogger("lm.layouts")

MAX_NPROC = 1024
"""The most processes a layout starts: they all run on this machine (lm.train's --gpus-per-node bound)."""


@dataclass(frozen=True)
class Layout:
    text: str
    """as given: `4:tp=2`"""
    nproc: int
    settings: tuple[tuple[str, str], ...]
    """parallel.<key> = value pairs"""

    @property
    def overrides(self) -> list[str]:
        keys = dict(self.settings)
        engine = [] if "engine" in keys else ["--parallel.engine=fsdp"]
        return [*engine, *(f"--parallel.{key}={value}" for key, value in self.settings)]

    @property
    def dir_name(self) -> str:
        return self.text.replace(":", "_").replace(",", "_").replace("=", "")


def parse_layout(text: str) -> Layout:
    """`NPROC` or `NPROC:key=value,...`; ConfigError naming the part that is not."""
    nproc_text, _, rest = text.partition(":")
    # isdecimal, not isdigit: int() reads every decimal digit, and no superscript or circled one
    if not nproc_text.isdecimal() or not 1 <= int(nproc_text) <= MAX_NPROC:
        raise ConfigError(f"--layout {text}: expected NPROC or NPROC:key=value,... with a process count from 1 to "
                          f"{MAX_NPROC} first, e.g. 4:tp=2")
    settings = []
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise ConfigError(f"--layout {text}: {item!r} is not key=value (a key of the parallel section)")
        key = key.removeprefix("parallel.")
        if key in dict(settings):  # the later value would silently win
            raise ConfigError(f"--layout {text}: parallel.{key} is given twice")
        settings.append((key, value))
    return Layout(text, int(nproc_text), tuple(settings))


def replaced_override(fixed: list[str], layouts: list[Layout]) -> str | None:
    """Why a `--section.key=value` of the command line would be replaced by what lm.layouts gives each run (its
    steps, directory and logging, a layout's parallel keys, fsdp as the engine), or None: silently, it would
    train something else than asked."""
    run_set = {item.removeprefix("--").partition("=")[0] for item in run_keys(1)}
    for item in fixed:
        key = item.removeprefix("--").partition("=")[0]
        leaf = key.removeprefix("parallel.")
        if key == "train.steps":
            return "--train.steps: lm.layouts trains each layout --steps steps; give --steps"
        if key == "train.out_dir":
            return "--train.out_dir: lm.layouts puts each layout's run in --out; give --out"
        if key in run_set:
            return (f"--{key}: lm.layouts sets {', '.join(sorted(run_set - {'train.steps'}))} for every run (each "
                    "step logged, the last evaluated and saved, no samples or TensorBoard)")
        in_a_layout = key.startswith("parallel.") and any(leaf in dict(lay.settings) for lay in layouts)
        if key == "parallel.engine" or in_a_layout:
            return (f"--{key}: a layout's own key (a layout without engine= runs under fsdp); give it in each "
                    f"--layout, e.g. --layout 2:{leaf}=...")
    return None


def check_layout(config: str | None, fixed: list[str], layout: Layout) -> None:
    """The config each layout trains, checked before anything runs: the model's split (a config's own checks), the
    world size and the global batch's split over the layout's data-parallel replicas (`check_world`)."""
    try:
        cfg = load_config(config, [*fixed, *layout.overrides])
        check_world(cfg, layout.nproc)
    except ConfigError as err:
        raise ConfigError(f"--layout {layout.text}: {err}") from None


def run_keys(steps: int) -> list[str]:
    """The keys every layout's run takes: `steps` optimizer steps, each logged, the evaluation and the checkpoint
    at the last, no samples and no TensorBoard."""
    return [f"--train.steps={steps}", "--log.every=1", f"--train.eval_every={steps}", f"--checkpoint.every={steps}",
            "--log.sample_every=0", "--log.tensorboard=false"]


def train_losses(out: Path) -> dict[int, float]:
    """The train loss of each logged step of the run in `out`; NaN where the logger wrote null (a loss that was not
    finite: the run diverged there)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: math.nan if row["train/loss"] is None else row["train/loss"] for row in rows
            if "train/loss" in row}


Worst = tuple[float, int, str, str]
"""The largest difference between layouts: (nats, step, layout, layout)."""


def table(layouts: list[Layout], losses: list[dict[int, float]]) -> tuple[str, Worst | None]:
    """The side-by-side table, and the largest difference (None when no layout logged a train loss)."""
    width = max(12, *(len(layout.text) + 2 for layout in layouts))
    lines = ["step".ljust(6) + "".join(layout.text.rjust(width) for layout in layouts) + "max diff".rjust(12)]
    worst: Worst | None = None  # the first step is the reference even when every layout agrees bit for bit
    for step in sorted(set().union(*losses)):
        values = [run.get(step) for run in losses]
        present = [(v, layout.text) for v, layout in zip(values, layouts) if v is not None]
        diverged = [text for v, text in present if math.isnan(v)]
        if diverged:  # no difference is larger; the first such step stays the worst
            finite = [text for v, text in present if not math.isnan(v)]
            spread, low, high = math.nan, (finite or diverged)[0], diverged[0]
        else:
            (low_loss, low), (high_loss, high) = min(present), max(present)
            spread = high_loss - low_loss
        if worst is None or not math.isnan(worst[0]) and (spread > worst[0] or math.isnan(spread)):
            worst = (spread, step, low, high)
        cells = "".join(("-" if v is None else f"{v:.6f}").rjust(width) for v in values)
        lines.append(f"{step:<6}{cells}{spread:>12.2e}")
    return "\n".join(lines), worst


def summary(losses: list[dict[int, float]], worst: Worst) -> tuple[str, float]:
    """The last line, and the largest difference relative to the loss at its step (the first layout's, or of the
    first layout that logged that step)."""
    spread, step, low, high = worst
    reference = abs(next(run[step] for run in losses if step in run)) or 1.0
    relative = spread / reference
    return (f"largest difference: {spread:.3e} nats ({relative:.2e} relative) at step {step}, between {low} and "
            f"{high}"), relative


def runs_dir(out: Path | None) -> Path:
    """Where the runs go: --out, new or empty, or a new temporary directory."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="lm-layouts-"))
    if problem := output_dir_problem(out):
        raise ConfigError(f"--out {problem}")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: exists and is not an empty directory; name a new one (every layout "
                          "trains from step 0)")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lm.layouts", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="example: python -m lm.layouts --config configs/llama-tiny.yaml --layout 1 --layout 4:tp=2 "
               "--layout 4:pp=2 --steps 10")
    parser.add_argument("--config", action=OneConfig,
                        help="the YAML config every layout trains (default: lm's defaults)")
    parser.add_argument("--layout", action="append", required=True, metavar="NPROC[:key=value,...]",
                        help="a layout to train under; give two or more")
    parser.add_argument("--steps", type=positive_int, default=10, help="optimizer steps per layout (default 10)")
    parser.add_argument("--out", type=a_path,
                        help="a new directory for the runs, kept (default: a temporary one, removed at the end)")
    parser.add_argument("--max-rel", type=finite_float, metavar="R",
                        help="exit 1 when two layouts' losses at a step differ by more than R relative")
    args, fixed = parser.parse_known_args(argv)
    for item in fixed:
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            parser.error(f"unrecognized argument {item!r}; config overrides look like --section.key=value")
    if len(args.layout) < 2:
        parser.error("--layout: give two or more layouts to compare")
    if args.max_rel is not None and args.max_rel < 0:  # every comparison would fail, after every layout trained
        parser.error(f"--max-rel: must be >= 0, got {args.max_rel:g}")
    layouts: list[Layout] = []
    for text in args.layout:
        layout = parse_layout(text)
        if any(seen.dir_name == layout.dir_name for seen in layouts):  # one run directory: the second trains nothing
            raise ConfigError(f"--layout {text}: given twice; give each layout once")
        layouts.append(layout)
    if problem := replaced_override(fixed, layouts):
        raise ConfigError(problem)
    fixed = [*fixed, *run_keys(args.steps)]
    for layout in layouts:
        check_layout(args.config, fixed, layout)
    out = runs_dir(args.out)
    base = ["--config", args.config] if args.config else []
    try:
        # every layout reads the same shards: prepare them once (lm.prepare reuses data that is already there)
        code = subprocess.run(prepare_command(base, fixed)).returncode
        if code:
            raise ConfigError(f"lm.prepare failed for the config (exit {code}; its error is above)")
        losses, failed = [], []
        for i, layout in enumerate(layouts, 1):
            run_dir = out / layout.dir_name
            log.info("[%d/%d] %s: training (log: %s.log)", i, len(layouts), layout.text, run_dir)
            command = train_command(layout.nproc, [*base, *fixed, *layout.overrides, f"--train.out_dir={run_dir}"])
            status = run_logged(command, run_dir.with_suffix(".log"))
            if status != "finished":
                failed.append(f"{layout.text}: {status}")
            losses.append(train_losses(run_dir) if (run_dir / "metrics.jsonl").is_file() else {})
    except BaseException:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
        raise
    if failed:  # the logs the lines point to are kept, in the temporary directory too
        for line in failed:
            print(f"error: --layout {line}", file=sys.stderr)
        return 1
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    text, worst = table(layouts, losses)
    print(text)
    if worst is None:
        print("error: no layout logged a train loss", file=sys.stderr)
        return 1
    line, relative = summary(losses, worst)
    print(line)
    if args.max_rel is not None and not relative <= args.max_rel:  # NaN: a layout diverged
        print(f"error: the layouts differ by more than --max-rel {args.max_rel}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(run(main))
