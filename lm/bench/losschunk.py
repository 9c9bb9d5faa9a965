"""Chunked cross-entropy (`model.loss_chunk`): peak memory and step time of a training step with the head and
loss computed whole and chunk by chunk.

Each setting runs in a fresh spawned process, so one setting's freed memory (which the C allocator may keep)
cannot raise the next one's peak: on a CPU the peak is the process's resident set (VmHWM), on CUDA
`torch.cuda.max_memory_allocated`.
"""

import multiprocessing
from dataclasses import replace

import torch

from lm.bench.common import median_seconds, peak_memory_gib, reset_peak_memory
from lm.config import JobConfig


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
