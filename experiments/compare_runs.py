"""Two training runs of the same data and seed side by side: the largest relative difference of their training
losses over the steps both logged, and their tokens/s, for float8 against bf16 (launch/bench_gpu.sh's float8 part).

    python -m experiments.compare_runs BASELINE_RUN OTHER_RUN [--skip 2]

Each run directory's metrics.jsonl gives `train/loss` and `perf/tokens_per_s` per logged step. The tokens/s of a
run is the median of its logged steps after the first `--skip` of them, which hold the compile and warm-up.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from lm.cli import run
from lm.errors import LMError


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of `run_dir`/metrics.jsonl that logged a training loss, in step order."""
    path = run_dir / "metrics.jsonl"
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as err:
        raise LMError(f"{path}: unreadable ({err})") from None
    return sorted((r for r in rows if "train/loss" in r), key=lambda r: r["step"])


def compare(baseline: list[dict], other: list[dict], skip: int) -> dict:
    """The largest |other - baseline| / baseline of the losses at the steps both logged (and its step), and each
    run's median tokens/s after its first `skip` logged steps, with their ratio."""
    base_loss = {r["step"]: r["train/loss"] for r in baseline}
    shared = [(r["step"], base_loss[r["step"]], r["train/loss"]) for r in other if r["step"] in base_loss]
    if not shared:
        raise LMError("the two runs logged no training loss at a common step")
    step, base, value = max(shared, key=lambda s: abs(s[2] - s[1]) / abs(s[1]))

    def speed(rows: list[dict]) -> float:
        kept = [r["perf/tokens_per_s"] for r in rows[skip:] if r.get("perf/tokens_per_s")]
        return statistics.median(kept) if kept else float("nan")

    base_speed, other_speed = speed(baseline), speed(other)
    return {"steps": len(shared), "max_rel_loss_diff": abs(value - base) / abs(base), "at_step": step,
            "baseline_tokens_per_s": base_speed, "other_tokens_per_s": other_speed,
            "speedup": other_speed / base_speed}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.compare_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=Path)
    parser.add_argument("other", type=Path)
    parser.add_argument("--skip", type=int, default=2, help="logged steps left out of the tokens/s median")
    args = parser.parse_args(argv)
    result = compare(read_metrics(args.baseline), read_metrics(args.other), args.skip)
    print(f"{args.other} against {args.baseline}: losses of {result['steps']} steps, largest relative difference "
          f"{result['max_rel_loss_diff']:.2%} (step {result['at_step']}); tokens/s {result['other_tokens_per_s']:,.0f} "
          f"against {result['baseline_tokens_per_s']:,.0f}: {result['speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
