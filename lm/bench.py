"""`python -m lm.bench`: training and loader throughput of the presets on this device.

Training rows time forward + backward + AdamW step on random tokens (one process, no loader) and
report the median over the timed steps, after warm-up steps that are not timed. Loader rows time
`TokenLoader.next_batch` over synthetic shards. On a CPU, gpt2-124m is scaled down (shorter
sequences, one sequence per step) so that it finishes in about a minute.
"""

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lm.cli import run
from lm.config import JobConfig, load_config
from lm.data.loader import TokenLoader
from lm.data.objectives import build_objective
from lm.data.shards import ShardWriter, dtype_for_vocab, new_manifest, write_manifest
from lm.models.gpt import GPT
from lm.runtime import tune_cpu
from lm.train.metrics import flops_per_token, peak_flops
from lm.distributed.engine import autocast_for, build_optimizer

PRESETS = ["demo", "gpt2-124m"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_training(cfg: JobConfig, device: torch.device, micro_batch: int, warmup: int, steps: int) -> dict:
    """Median ms/step, tokens/s, achieved FLOP/s (and MFU on a known GPU), peak memory."""
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    optimizer = build_optimizer(model, cfg, device)
    step_model = torch.compile(model) if cfg.train.compile else model
    autocast = autocast_for(cfg, device)
    T = cfg.data.seq_len
    x = torch.randint(0, cfg.model.vocab_size, (micro_batch, T + 1), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        with autocast:
            _, loss = step_model(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tok_s = micro_batch * T / step_s
    flops = flops_per_token(cfg.model, model.num_params(), T) * tok_s
    peak = peak_flops(device)
    if device.type == "cuda":
        memory = torch.cuda.max_memory_allocated(device)
    else:  # the whole process's peak resident set, in KiB on Linux
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"ms/step": step_s * 1e3, "tokens/s": tok_s, "TFLOP/s": flops / 1e12,
            "MFU": f"{flops / peak:.1%}" if peak else "-", "peak mem GiB": memory / 2**30}


def bench_loader(cfg: JobConfig, micro_batch: int, steps: int) -> dict:
    """Tokens/s that the training loader delivers from memory-mapped shards (one rank)."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        dtype = dtype_for_vocab(cfg.model.vocab_size)
        writer = ShardWriter(tmp, "train", 4_000_000, dtype)
        writer.add(rng.integers(0, cfg.model.vocab_size, 8_000_000, dtype=np.int64).astype(dtype))
        train = writer.close()
        val = ShardWriter(tmp, "val", 4_000_000, dtype)
        val.add(rng.integers(0, cfg.model.vocab_size, 100_000, dtype=np.int64).astype(dtype))
        splits = {name: {"documents": 1, "tokens": sum(s["tokens"] for s in shards), "shards": shards}
                  for name, shards in (("train", train), ("val", val.close()))}
        write_manifest(tmp, new_manifest(cfg.data.tokenizer, cfg.model.vocab_size, 0, "synthetic", "", splits))
        objective = build_objective(cfg.model, cfg.data.seq_len, 0)  # its cost is part of the loader's
        loader = TokenLoader(tmp, "train", cfg.data.seq_len, 0, 0, 1, micro_batch * 4, micro_batch, objective)
        loader.next_batch()  # first touch of the permutation and page cache
        start = time.perf_counter()
        for _ in range(steps):
            loader.next_batch()
        elapsed = time.perf_counter() - start
    return {"tokens/s": steps * micro_batch * 4 * cfg.data.seq_len / elapsed}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Print training and loader throughput for the presets on this device.")
    parser.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        tune_cpu()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name} | torch {torch.__version__}")
    print(f"{'preset':<11} {'mode':<8} {'batch x seq':>11} {'ms/step':>9} {'tokens/s':>10} "
          f"{'TFLOP/s':>8} {'MFU':>6} {'peak mem GiB':>12} {'loader tokens/s':>16}")
    for preset in args.presets:
        overrides = ["--train.device=" + device.type, "--train.compile=false"]
        micro = None
        if device.type == "cpu" and preset == "gpt2-124m":
            overrides += ["--data.seq_len=256", "--train.dtype=float32"]
            micro = 1
        cfg = load_config(Path(__file__).parent.parent / "configs" / f"{preset}.yaml", overrides)
        micro = micro or cfg.train.micro_batch_size
        loader = bench_loader(cfg, micro, steps=200)
        for compiled in ([False, True] if args.compile else [False]):
            cfg.train.compile = compiled
            row = bench_training(cfg, device, micro, args.warmup, args.steps)
            print(f"{preset:<11} {'compile' if compiled else 'eager':<8} {f'{micro} x {cfg.data.seq_len}':>11} "
                  f"{row['ms/step']:>9.1f} {row['tokens/s']:>10,.0f} {row['TFLOP/s']:>8.3f} {row['MFU']:>6} "
                  f"{row['peak mem GiB']:>12.2f} {loader['tokens/s']:>16,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
