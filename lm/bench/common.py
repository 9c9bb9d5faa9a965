"""What every benchmark section shares: timing with warm-up and median, peak memory, and table printing."""

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lm.cli import in_range
from lm.config import JobConfig, load_config

PRESETS = ["demo", "gpt2-124m"]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


WARMUP = in_range(int, 0, 10_000)
"""argparse type of --warmup, the untimed calls before the timed ones: 0 is none, and a negative count is
refused, where it would also mean none and leave a compile or a cold cache in the timed median unsaid."""


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures it and not only its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of `reps` calls of `fn`, after `warmup` untimed calls (compilation, caches, allocator)."""
    return median_seconds_interleaved({"fn": fn}, device, warmup, {"fn": reps})["fn"]


def median_seconds_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int,
                               reps: dict[str, int]) -> dict[str, float]:
    """Median wall time of each of `fns`, their timed calls taken in turns (A B C A B C ...) after `warmup`
    untimed calls of each, so that a slow spell of a shared machine touches all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(max(reps.values())):
        for name, fn in fns.items():
            if rep < reps[name]:
                sync(device)
                start = time.perf_counter()
                fn()
                sync(device)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator statistics, or on Linux the process's peak resident set
    (writing 5 to /proc/self/clear_refs resets VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux: the peak then covers the whole process so far


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak since `reset_peak_memory`: allocated tensor memory on CUDA; the process's resident set on a
    CPU (tensors plus Python and torch themselves); None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


def fmt(value: object, spec: str = "") -> str:
    """A table cell: '-' for a missing value, else `format(value, spec)`."""
    return "-" if value is None else format(value, spec)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """Print rows of cells under a title, the first column left-aligned and the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, *rows]:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip())


def preset_config(preset: str, device: torch.device) -> tuple[JobConfig, int]:
    """The preset's config for this device and the micro-batch to time."""
    overrides = [f"--train.device={device.type}", "--train.compile=false"]
    if device.type == "cpu" and preset == "gpt2-124m":
        overrides += ["--data.seq_len=256", "--train.dtype=float32"]
    cfg = load_config(CONFIGS / f"{preset}.yaml", overrides)
    micro = 1 if device.type == "cpu" and preset == "gpt2-124m" else cfg.train.micro_batch_size
    return cfg, micro
