"""Chunked cross-entropy (`model.loss_chunk`): peak memory and step time of a training step with the head and
loss computed whole and chunk by chunk.

    python -m experiments.losschunk [--device cuda] [--warmup 2] [--reps 5]

Each setting runs in a fresh spawned process, so one setting's freed memory (which the C allocator may keep)
cannot raise the next one's peak: on a CPU the peak is the process's resident set (VmHWM), on CUDA
`torch.cuda.max_memory_allocated`.
"""

import argparse
import multiprocessing
import sys
from dataclasses import replace

import torch

from lm.bench.common import WARMUP, fmt, median_seconds, peak_memory_gib, preset_config, print_table, reset_peak_memory
from lm.cli import positive_int, run
from lm.config import JobConfig
from lm.distributed.env import init_device

SHAPES = [(4, 128), (8, 512)]
"""(batch, seq_len) of the rows: the demo's micro-batch, and one where the logits dominate memory"""
SIZES = [0, 256, 1024]
"""The model.loss_chunk sizes timed at each shape (0: off)"""
ROUNDS = 2
"""Each setting is timed in this many fresh processes, taken in turns, and shown as the range of their medians"""


def resident_gib(device: torch.device) -> float | None:
    """Memory held now, on the scale `peak_memory_gib` reports: allocated tensors on CUDA, the resident set
    on a CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    reset_peak_memory(device)  # VmHWM restarts from the current resident set
    return peak_memory_gib(device)


def measure(cfg: JobConfig, device_name: str, batch: int, seq_len: int, chunk: int, warmup: int, reps: int) -> dict:
    """ms per training step (forward, backward, clip, AdamW) at `batch` x `seq_len` with model.loss_chunk
    `chunk`, its peak memory in GiB, and the peak above what model and inputs held before the first step.
    Run it in a fresh process (`measure_fresh`)."""
    from lm.bench.training import training_step

    device = torch.device(device_name)
    cfg = replace(cfg, model=replace(cfg.model, loss_chunk=chunk, block_size=max(cfg.model.block_size, seq_len)),
                  data=replace(cfg.data, seq_len=seq_len))
    step, _ = training_step(cfg, device, batch)
    before = resident_gib(device)
    reset_peak_memory(device)
    seconds = median_seconds(step, device, warmup, reps)
    peak = peak_memory_gib(device)
    return {"ms/step": seconds * 1e3, "peak GiB": peak,
            "step GiB": None if peak is None or before is None else peak - before}


def measure_fresh(*args) -> dict:
    """`measure(*args)` in a newly spawned process."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, args)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.losschunk", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--warmup", type=WARMUP, default=2, help="untimed repetitions first")
    parser.add_argument("--reps", type=positive_int, default=5, help="timed repetitions (the median is reported)")
    args = parser.parse_args(argv)
    device = init_device(args.device, "--device")
    cfg, _ = preset_config("demo", device)
    rows = []
    for batch, seq_len in SHAPES:
        found: dict[int, list[dict]] = {chunk: [] for chunk in SIZES}
        for _ in range(ROUNDS):
            for chunk in SIZES:
                found[chunk].append(measure_fresh(cfg, str(device), batch, seq_len, chunk, args.warmup, args.reps))
        plain_peak = max(r["peak GiB"] or 0 for r in found[0]) or None
        for chunk, runs in found.items():
            ms = sorted(r["ms/step"] for r in runs)
            peak = max(r["peak GiB"] or 0 for r in runs) or None
            step = max(r["step GiB"] or 0 for r in runs) or None
            ratio = peak / plain_peak if peak and plain_peak else None
            rows.append([f"{batch} x {seq_len}", str(chunk) if chunk else "0 (off)", f"{ms[0]:.0f}-{ms[-1]:.0f}",
                         fmt(peak, ".3f"), fmt(step, ".3f"), fmt(ratio, ".2f")])
    what = "resident set (VmHWM)" if device.type == "cpu" else "max_memory_allocated"
    print_table(f"losschunk: demo model training step (forward, backward, clip, AdamW), model.loss_chunk; peak "
                f"memory is the {what}, step GiB its rise above model and inputs; ms: range of {ROUNDS} fresh "
                "processes' medians", ["batch x seq", "loss_chunk", "ms/step", "peak GiB", "step GiB", "peak / off"],
                rows)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
