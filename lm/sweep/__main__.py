"""`python -m lm.sweep --config BASE.yaml --grid KEY=V1,V2 ...`: train every combination, then compare them.

Each run is `lm.train` on the base config plus its grid values (one process, or a torchrun job with
--nproc), one after another, into OUT/runs/<values>-<hash>/. The sweep is resumable: a run whose final
checkpoint exists is skipped, and an interrupted run resumes from its newest checkpoint. At the end
OUT/results.md and OUT/results.csv compare the runs (sorted by validation loss) and
OUT/val_loss_vs_time.png plots validation loss against wall time. Other `--section.key=value` arguments
override the base config for every run.
"""

import argparse
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lm.checkpoint.store import checkpoint_root, complete_checkpoints
from lm.cli import Stopped, a_path, in_range, positive_int, prepare_command, run, run_logged, train_command
from lm.config import JobConfig, OneConfig, config_diff, load_config
from lm.config.rules import MAX_SEED
from lm.data.shards import read_manifest
from lm.distributed.layout import check_world
from lm.errors import ConfigError, SweepError
from lm.io import atomic_write_text, output_dir_problem
from lm.plan.counts import num_params
from lm.report.figures import load_run, save_png, val_time_figure
from lm.schema import Entries, Spec, check, table
from lm.sweep.grid import expand, format_value, overrides, parse_grid, run_name
from lm.sweep.results import RunResult, csv_text, markdown, read_result

log = logging.getLogger("lm.sweep")


@dataclass
class Run:
    name: str
    settings: dict[str, object]
    cfg: JobConfig
    dir: Path

    @property
    def label(self) -> str:
        """The grid values without the config hash, for legends."""
        return self.name.rsplit("-", 1)[0]


def resolved(cfg: JobConfig) -> dict:
    """The config a run trains with, less train.out_dir (the one key that differs between equal runs)."""
    values = cfg.to_dict()
    del values["train"]["out_dir"]
    return values


def plan_runs(config: str, fixed: list[str], combos: list[dict], out: Path, nproc: int = 1) -> list[Run]:
    """Each combination's config, checked before anything runs (with the layout and batch split of `nproc`
    processes a run); a bad one names the grid value to blame, and two that train the same config (1 and 1.0 for
    a float) are refused rather than trained twice."""
    runs, planned = [], {}
    for combo in combos:
        try:
            cfg = load_config(config, [*fixed, *overrides(combo)])
        except ConfigError as err:
            message = blame(config, fixed, combo) or f"--grid combination {' '.join(overrides(combo))}: {err}"
            raise SweepError(message) from None
        try:
            check_world(cfg, nproc)
        except ConfigError as err:
            raise SweepError(f"--nproc {nproc} (--grid combination {' '.join(overrides(combo))}): {err}") from None
        if cfg.checkpoint.every == 0:
            raise SweepError("checkpoint.every=0: a sweep tells a finished run by its final checkpoint and resumes an "
                             "unfinished one from its newest; give checkpoint.every > 0 (checkpoint.keep=1 keeps one "
                             "per run)")
        settings = resolved(cfg)
        same = planned.setdefault(json.dumps(settings, sort_keys=True), combo)
        if same is not combo:
            raise SweepError(f"--grid: {' '.join(overrides(same))} and {' '.join(overrides(combo))} train the same "
                             "config; list each value once")
        name = run_name(combo, settings)
        cfg.train.out_dir = str(out / "runs" / name)
        runs.append(Run(name, combo, cfg, out / "runs" / name))
    return runs


def blame(config: str, fixed: list[str], combo: dict) -> str | None:
    """The error of the first grid value that the base config refuses on its own (an unknown key, a wrong
    type), or None when only the combination clashes (n_head=3 with d_model=128, say)."""
    for key, value in combo.items():
        try:
            load_config(config, [*fixed, f"--{key}={format_value(value)}"])
        except ConfigError as err:
            return f"--grid {key}={format_value(value)}: {err}"
    return None


# What lm reads back of OUT/sweep.json, a file one may have edited or replaced: the base config, by section.
RECORD_KEYS: dict[str, Spec] = {"base": Entries(table, "an object of config sections")}


def recorded_base(record: Path) -> dict:
    """The base config OUT/sweep.json records; SweepError naming the file, and the key where one is to blame,
    when it is no sweep record."""
    try:
        values = json.loads(record.read_text())
    except (OSError, ValueError):
        values = None
    if not isinstance(values, dict) or "base" not in values:
        raise SweepError(f"{record}: not a sweep record (JSON with a 'base' config); is {record.parent} a sweep "
                         "directory?")
    check(values, RECORD_KEYS, record, SweepError)
    return values["base"]


def refuse_another_sweep(out: Path, base: dict, force: bool) -> None:
    """Refuse (unless `force`) a directory whose sweep.json records another base config; reads only."""
    record = out / "sweep.json"
    if not record.is_file():
        return
    diff = [f"{key}: {old!r} -> {new!r}" for key, (old, new) in config_diff(recorded_base(record), base).items()]
    if diff and not force:
        shown = "; ".join(diff[:4]) + ("; ..." if len(diff) > 4 else "")
        raise SweepError(f"{out}: holds a sweep of another base config ({shown}); use another --out, or "
                         "--force to add these runs beside the others (no run directory is reused)")


def prepared_data(base: JobConfig) -> dict[str, str]:
    """Each data directory of the base config and the content hash of what lm.prepare made there."""
    return {source.dir: read_manifest(source.dir)["content_hash"] for source in base.data.sources}


def refuse_other_data(out: Path, data: dict[str, str]) -> None:
    """Refuse a directory whose runs trained on other data than the base config's is now: lm.prepare rebuilds a
    data directory whose sources changed, and the finished runs, skipped, would be ranked against new ones
    trained and validated on other tokens. Reads only."""
    record = out / "sweep.json"
    if not record.is_file():
        return
    recorded = json.loads(record.read_text()).get("data", {})  # read as a sweep record by refuse_another_sweep
    if not isinstance(recorded, dict):
        raise SweepError(f"{record}: 'data' is {recorded!r}; expected an object of data directories and content "
                         "hashes")
    for where, content in data.items():
        if recorded.get(where, content) != content:
            raise SweepError(f"{out}: its runs trained on other data: {where} held content hash "
                             f"{str(recorded[where])[:12]} and holds {content[:12]} now (lm.prepare rebuilt it from "
                             "changed sources); use another --out")


def claim_sweep_dir(out: Path, base: dict, config: str, grid: dict, data: dict[str, str]) -> None:
    """Record the base config and its data in OUT/sweep.json (once `refuse_another_sweep` and `refuse_other_data`
    have let the directory be used)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "sweep.json", json.dumps({"config": config, "base": base, "grid": grid, "data": data},
                                                     indent=1) + "\n")


def saved_step(run: Run) -> int:
    """The step of the run's newest complete checkpoint (0 without one)."""
    found = complete_checkpoints(checkpoint_root(run.dir))
    return int(found[-1].name.removeprefix("step_")) if found else 0


def finished(run: Run) -> bool:
    """Whether the run's newest complete checkpoint is its last step."""
    return saved_step(run) >= run.cfg.train.steps


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lm.sweep", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="example: python -m lm.sweep --config configs/demo.yaml --grid model.n_layer=2,4 optim.lr=3e-3,7e-3 "
               "--train.steps=200 --out runs/sweep_demo")
    parser.add_argument("--config", action=OneConfig, required=True, help="the base YAML config every run starts from")
    parser.add_argument("--grid", nargs="+", action="extend", default=[], metavar="KEY=V1,V2",
                        help="a config key and the values to try; runs cover every combination of the keys")
    parser.add_argument("--random", type=positive_int, metavar="N",
                        help="train N combinations drawn at random instead of all")
    parser.add_argument("--seed", type=in_range(int, 0, MAX_SEED), default=0,
                        help="--random: seed of the draw (default 0)")
    parser.add_argument("--out", type=a_path, help="sweep directory (default runs/sweep_<config name>)")
    parser.add_argument("--nproc", type=positive_int, default=1,
                        help="processes per run: >1 runs each as a torchrun job")
    parser.add_argument("--force", action="store_true",
                        help="add runs to a directory holding a sweep of another base config")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and exit without training")
    args, fixed = parser.parse_known_args(argv)
    for item in fixed:
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            parser.error(f"unrecognized argument {item!r}; base-config overrides look like --section.key=value")
    grid = parse_grid(args.grid)
    for item in fixed:
        if (key := item.removeprefix("--").split("=", 1)[0]) in grid:
            raise SweepError(f"--{key}: also a --grid key, whose values would replace it in every run; give its "
                             "values in --grid only")
    base = load_config(args.config, fixed)
    out = Path(args.out or f"runs/sweep_{Path(args.config).stem}")
    if problem := output_dir_problem(out):
        raise SweepError(f"--out {problem}")
    runs = plan_runs(args.config, fixed, expand(grid, args.random, args.seed), out, args.nproc)
    refuse_another_sweep(out, resolved(base), args.force)  # a dry run lists only what the real one would train
    if args.dry_run:
        for i, r in enumerate(runs, 1):
            print(f"[{i}/{len(runs)}] {r.dir}  {' '.join(overrides(r.settings))}"
                  + ("  (finished)" if finished(r) else ""))
        return 0

    # every run reads the same shards: prepare them once (lm.prepare reuses data that is already there)
    code = subprocess.run(prepare_command(["--config", args.config], fixed)).returncode
    if code:
        raise SweepError(f"lm.prepare failed for the base config {args.config} (exit {code}; its error is above)")
    data = prepared_data(base)
    refuse_other_data(out, data)
    claim_sweep_dir(out, resolved(base), args.config, grid, data)
    statuses = train_runs(runs, ["--config", args.config, *fixed], args.nproc)
    results = write_results(runs, statuses, out)
    failed = [r for r in results if r.status != "finished"]
    if failed:
        log.warning("%d of %d runs did not finish; run the same command again to resume them", len(failed), len(runs))
    return 1 if failed else 0


def train_runs(runs: list[Run], base_args: list[str], nproc: int) -> dict[str, str]:
    """Train each run not finished before, one after another (`base_args`: the base config and its overrides);
    each run's status by name: finished, or why not."""
    statuses = {}
    for i, r in enumerate(runs, 1):
        if finished(r):
            log.info("[%d/%d] %s: finished before, skipped", i, len(runs), r.name)
            statuses[r.name] = "finished"
            continue
        log.info("[%d/%d] %s: training (log: %s)", i, len(runs), r.name, r.dir / "train.log")
        command = train_command(nproc, [*base_args, *overrides(r.settings), f"--train.out_dir={r.dir}"])
        try:
            statuses[r.name] = run_logged(command, r.dir / "train.log")
        except Stopped as err:
            raise Stopped(err.signum, f"{r.name}: {err}; the same command resumes the sweep from its newest "
                                      "checkpoint") from None
        if statuses[r.name] == "finished" and not finished(r):  # lm.train exits 0 when a signal stops it
            statuses[r.name] = f"stopped at step {saved_step(r)} of {r.cfg.train.steps} by a signal"
        log.info("[%d/%d] %s: %s", i, len(runs), r.name, statuses[r.name])
    return statuses


def write_results(runs: list[Run], statuses: dict[str, str], out: Path) -> list[RunResult]:
    """OUT/results.md, results.csv and val_loss_vs_time.png from the runs' metrics logs; the table printed too."""
    results = [read_result(r.dir, r.settings, num_params(r.cfg.model, non_embedding=True),
                           statuses[r.name]) for r in runs]
    atomic_write_text(out / "results.md", markdown(results))
    atomic_write_text(out / "results.csv", csv_text(results))
    plotted = {r.label: load_run(r.dir) for r, res in zip(runs, results) if res.val_loss is not None}
    save_png(val_time_figure(plotted), out / "val_loss_vs_time.png")
    print(markdown(results))
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'} and {out / 'val_loss_vs_time.png'}")
    return results


if __name__ == "__main__":
    sys.exit(run(main))
