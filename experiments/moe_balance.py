"""A mixture of experts at the demo's size (docs/experiments.md): configs/moe-tiny.yaml against configs/demo-modern.yaml
at equal tokens, and the routers' load with and without auxiliary-loss-free balancing.

Trains, one after another on --nproc processes (torchrun), demo-modern and four runs of moe-tiny: as the preset
(balanced by its bias at rate 0.01 with the error rule, no balance loss), with DeepSeek-V3's sign rule instead, with
neither bias nor balance loss, and with the Switch Transformer's balance loss instead of the bias
(model.aux_loss_coef 0.01, lm's default). Each saves a checkpoint every tenth of its steps; a run whose last
checkpoint is there already is not trained again. Then each checkpoint of a mixture routes the first WINDOWS x 128
tokens of the val split, in eval mode (the bias is part of the model), and the load of each block is its most loaded
expert's tokens over the mean (1: even). Prints a markdown table (val loss, tokens/s, load at the end) and draws the
load over training into docs/experiments/moe_balance.png.

    python -m experiments.moe_balance --out runs/moe_balance
"""

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from experiments.recipes import final_val, tokens_per_s
from lm.checkpoint.model_weights import load_checkpoint_weights
from lm.checkpoint.store import read_config
from lm.cli import train_command
from lm.inference.scoring import first_tokens, stream_windows, val_streams
from lm.models.gpt.moe import router_stats
from lm.models.registry import family_of
from lm.report.figures import load_run, save_png

FIGURE = Path("docs/experiments/moe_balance.png")
WINDOWS, SEQ = 64, 128
RUNS = {
    "demo-modern": ["--config", "configs/demo-modern.yaml"],
    "moe-tiny (bias, error rule)": ["--config", "configs/moe-tiny.yaml"],
    "moe-tiny, bias, sign rule": ["--config", "configs/moe-tiny.yaml", "--model.router_bias_update=sign"],
    "moe-tiny, no balancing": ["--config", "configs/moe-tiny.yaml", "--model.router_bias_rate=0"],
    "moe-tiny, balance loss 0.01": ["--config", "configs/moe-tiny.yaml", "--model.router_bias_rate=0",
                                    "--model.aux_loss_coef=0.01"],
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def train(name: str, flags: list[str], steps: int, out: Path, nproc: int) -> Path:
    run = out / slug(name)
    every = max(steps // 10, 1)
    args = [*flags, f"--train.steps={steps}", f"--train.eval_every={steps // 2}", f"--checkpoint.every={every}",
            "--checkpoint.keep=20", "--log.every=20", "--log.sample_every=0", f"--train.out_dir={run}"]
    if not (run / "checkpoints" / f"step_{steps:08d}").is_dir():
        subprocess.run(train_command(nproc, args), check=True)
    return run


@torch.no_grad()
def loads(step_dir: Path, windows: torch.Tensor) -> list[float]:
    """Each mixture block's most loaded expert over the mean, routing `windows` (B, T) in eval mode."""
    cfg = read_config(step_dir).model
    model = family_of(cfg).build(cfg)
    load_checkpoint_weights(step_dir, model)
    model.eval()(windows)
    return [s.load.item() for s in router_stats(model)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.moe_balance", description=__doc__)
    parser.add_argument("--steps", type=int, default=760, help="each run's steps (default: the presets' budget)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (torchrun)")
    parser.add_argument("--out", type=Path, default=Path("runs/moe_balance"))
    args = parser.parse_args(argv)
    runs = {name: train(name, flags, args.steps, args.out, args.nproc) for name, flags in RUNS.items()}
    cfg = read_config(next((runs["moe-tiny (bias, error rule)"] / "checkpoints").iterdir()))
    streams = first_tokens(val_streams(Path(cfg.data.sources[0].dir), cfg.data.tokenizer, cfg.model.vocab_size),
                           WINDOWS * SEQ + 1)
    windows = torch.from_numpy(np.stack(stream_windows(streams, SEQ)[:WINDOWS])[:, :SEQ].astype(np.int64))  # (B, T)
    curves = {}
    print(f"| run | val loss | tokens/s | load at the end, blocks 0-3 (max / mean; {windows.numel():,} val tokens) |")
    print("|---|---|---|---|")
    for name, run in runs.items():
        rows = load_run(run)
        end = ""
        if name != "demo-modern":
            steps = sorted((run / "checkpoints").iterdir())
            curves[name] = (np.array([int(s.name.split("_")[1]) for s in steps]),
                            np.array([loads(s, windows) for s in steps]))  # (checkpoints,), (checkpoints, blocks)
            end = ", ".join(f"{v:.2f}" for v in curves[name][1][-1])
        print(f"| {name} | {final_val(run):.4f} | {tokens_per_s(rows):,.0f} | {end} |")
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.add_subplot()
    for (name, (steps, load)), color in zip(curves.items(), ("C0", "C1", "C2", "C3")):
        ax.plot(steps, load.max(1), color=color, label=f"{name}: most loaded block")
        ax.plot(steps, load.mean(1), color=color, linestyle="--", label=f"{name}: mean over blocks")
    ax.axhline(1.5, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("step")
    ax.set_ylabel("most loaded expert / mean (1: even)")
    ax.set_ylim(1, None)
    ax.set_title(f"moe-tiny: expert load on {windows.numel():,} val tokens")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    save_png(fig, FIGURE)
    print(f"wrote {FIGURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
