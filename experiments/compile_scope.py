"""How much of a training step torch.compile covers, and the micro-batch: tokens/s and MFU of gpt2-124m's
step (forward, backward, clip, AdamW) with the blocks compiled (the trainer before the loss was compiled),
the blocks and the float32 loss (`train.compile` now), and the whole forward with the loss in one graph.

    python -m experiments.compile_scope [--device cuda] [--micro 16 32] [--warmup 3] [--reps 10] [--preset demo]
                                        [--modes default max-autotune-no-cudagraphs]

Prints one row per (what is compiled, torch.compile mode, micro-batch). A mode other than `default` applies to
the blocks and to the whole forward (the loss keeps `lm.models.loss.compiled_loss`'s): `max-autotune-no-cudagraphs`
lets Inductor time Triton matmul templates against cuBLAS, `reduce-overhead` replays CUDA graphs, and
`max-autotune` does both. Meant for a GPU; on a CPU every step is one sequence (of
256 tokens for gpt2-124m, as in lm.bench). --preset times another config of configs/ (the tests use demo).
"""

import argparse
import sys
import time

import torch

from lm.bench.common import (
    CONFIGS,
    WARMUP,
    fmt,
    median_seconds,
    peak_memory_gib,
    preset_config,
    print_table,
    reset_peak_memory,
)
from lm.bench.training import random_batch
from lm.cli import positive_int, run
from lm.distributed.activation import compile_blocks
from lm.distributed.env import init_device
from lm.distributed.optim import build_optimizer
from lm.distributed.precision import autocast_for
from lm.models.loss import compiled_loss
from lm.models.registry import family_of
from lm.plan.counts import flops_per_token
from lm.plan.flops import peak_flops

SCOPES = ["blocks", "blocks+loss", "whole"]
MODES = ["default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"]


def measure(device: torch.device, scope: str, micro: int, warmup: int, reps: int,
            preset: str = "gpt2-124m", mode: str = "default") -> list[str]:
    torch._dynamo.reset()  # each row compiles from nothing and is timed after its own warm-up
    cfg, _ = preset_config(preset, device)
    if device.type == "cpu":
        micro = 1
    family = family_of(cfg.model)
    torch.manual_seed(0)
    model = family.build(cfg.model).to(device)
    optimizer = build_optimizer(model, cfg.optim, family.output_layers(model))
    if scope != "whole" and mode == "default":
        compile_blocks(family.blocks(model))
    elif scope != "whole":
        for block in family.blocks(model):
            block.compile(mode=mode)

    def loss_of(inputs, targets):
        with compiled_loss(scope == "blocks+loss"):
            return family.training.loss(model, model, [inputs, targets]).optimized

    if scope == "whole":
        loss_of = torch.compile(loss_of, mode=mode)
    x = random_batch(cfg, micro, device)
    autocast = autocast_for(cfg.train.dtype, device)

    def step() -> None:
        with autocast:
            loss = loss_of(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    reset_peak_memory(device)
    seconds = median_seconds(step, device, warmup, reps)
    tokens = micro * cfg.data.seq_len / seconds
    flops = flops_per_token(cfg.model, cfg.data.seq_len, cfg.data) * tokens
    peak = peak_flops(device)
    mfu = flops / peak if peak else None
    return [scope, mode, f"{micro} x {cfg.data.seq_len}", fmt(seconds * 1e3, ".1f"), fmt(tokens, ",.0f"),
            fmt(mfu and 100 * mfu, ".1f"), fmt(peak_memory_gib(device), ".1f"), fmt(first, ".1f")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.compile_scope", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--micro", nargs="+", type=positive_int, default=[16, 32], help="micro-batches to time")
    parser.add_argument("--scopes", nargs="+", default=SCOPES, choices=SCOPES)
    parser.add_argument("--modes", nargs="+", default=["default"], choices=MODES, help="torch.compile modes to time")
    parser.add_argument("--warmup", type=WARMUP, default=3, help="untimed steps first")
    parser.add_argument("--reps", type=positive_int, default=10)
    parser.add_argument("--preset", default="gpt2-124m", choices=sorted(p.stem for p in CONFIGS.glob("*.yaml")),
                        metavar="NAME", help="a config of configs/ by name (default gpt2-124m)")
    args = parser.parse_args(argv)
    device = init_device(args.device, "--device")
    rows = [measure(device, scope, micro, args.warmup, args.reps, args.preset, mode)
            for micro in args.micro for mode in args.modes for scope in args.scopes]
    print_table(f"compile scope: {args.preset} training step (forward, backward, clip, AdamW), one process",
                ["compiled", "mode", "batch x seq", "ms/step", "tokens/s", "MFU %", "peak GiB", "first step s"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
