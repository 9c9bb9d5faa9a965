"""`python -m lm.bench`: training, sampling and data throughput on this device, ours beside transformers'.

Every row is the median of several repetitions after untimed warm-up. On a CPU, gpt2-124m is scaled
down (one 256-token sequence per step) so each row takes about a minute at most. The first line says what
the numbers were measured on; the last table gathers the ratios against the baselines (transformers, the
one-process loop) and the shares (MFU, the loader's share of a step), so the output can be pasted whole into
an issue.
"""

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

from lm.bench.common import PRESETS, WARMUP, device_name, fmt, preset_config, print_table
from lm.cli import positive_int, run
from lm.config import JobConfig
from lm.data.prepare import num_threads
from lm.distributed.env import init_device

# sampling first: run after the training sections on the 2-core machine, its per-token times (ours and
# transformers' alike) came out 1.3-2x slower than in a fresh process
SECTIONS = ["sampling", "data", "training", "engines", "hfimport", "corpus"]
# hfimport is asked for by name: it writes gigabytes of random checkpoints; corpus too: it needs --corpus
DEFAULT_SECTIONS = ["sampling", "data", "training", "engines"]
ENGINES = ["ddp", "fsdp", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]
# the flags of some sections (or of --profile), each with its default and what reads it: given where none of
# those runs, a flag is refused rather than silently ignored
TIMED = ("sampling", "data", "training", "engines", "--profile")
SECTION_FLAGS = {
    "warmup": (2, TIMED),
    "reps": (5, TIMED),
    "compile": (True, ("training", "sampling")),
    "presets": (PRESETS, ("training", "engines", "data", "--profile")),
    "engines": (ENGINES, ("engines",)),
    "reps_no_cache": (1, ("sampling",)),
    "new_tokens": (256, ("sampling",)),
    "sampling_preset": ("demo", ("sampling",)),
    "reps_data": (3, ("data",)),
    "import_models": (["gpt2-124m", "llama-1.1b"], ("hfimport",)),
    "import_dir": (None, ("hfimport",)),
    "reps_import": (3, ("hfimport",)),
    "corpus": ([], ("corpus",)),
    "corpus_work": (None, ("corpus",)),
    "num_proc": (num_threads(0), ("corpus",)),  # the cores this process may run on, as lm.prepare counts them
    "reps_corpus": (1, ("corpus",)),
}


def late_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a flag that only its section would find, once the sections before it had run."""
    if "sampling" in args.sections:
        block = preset_config(args.sampling_preset, torch.device("cpu"))[0].model.block_size
        if args.new_tokens > block:  # after a one-token prompt: the last new token is never fed back
            return (f"--new-tokens: {args.new_tokens} do not fit --sampling-preset {args.sampling_preset}'s context "
                    f"of {block} tokens after a one-token prompt; give at most {block}")
    for flag, path in (("--import-dir", args.import_dir), ("--corpus-work", args.corpus_work)):
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            return f"{flag} {path}: is a file; name a directory to write in"
        if path is not None and not Path(path).exists():
            return f"{flag} {path}: no such directory; make it, or leave the flag out"
    return None


def ignored_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with flags that nothing this run does would read (`SECTION_FLAGS`), or None."""
    if args.profile and args.sections is not None:
        return "--sections: --profile runs none of them (it profiles a training step per preset); drop one"
    running = ["--profile"] if args.profile else args.sections or DEFAULT_SECTIONS
    named = lambda what: what if what.startswith("--") else f"--sections {what}"  # noqa: E731
    for name, (_, readers) in SECTION_FLAGS.items():
        if getattr(args, name) is not None and not set(readers) & set(running):
            flag = "--no-compile" if name == "compile" else f"--{name.replace('_', '-')}"
            return (f"{flag}: only {' or '.join(map(named, readers))} reads it, and this run is "
                    f"{'--profile' if args.profile else named(' '.join(running))}")
    return None


def _train_cells(preset: str, mode: str, micro: int, cfg: JobConfig, row: dict, ours: dict | None) -> list[str]:
    ratio = row["tokens/s"] / ours["tokens/s"] if ours else None
    return [preset, mode, f"{micro} x {cfg.data.seq_len}", f"{row['ms/step']:.1f}", f"{row['tokens/s']:,.0f}",
            f"{row['TFLOP/s']:.3f}", fmt(row["MFU"], ".1%"), fmt(row["peak GiB"], ".2f"), fmt(ratio, ".2f")]


def training(args, device, results: dict) -> None:
    from lm.bench.training import bench_training, sdpa_kernel

    rows = []
    for preset in args.presets:
        cfg, micro = preset_config(preset, device)
        print(f"  {preset}: scaled_dot_product_attention runs {sdpa_kernel(cfg, device, micro)}", file=sys.stderr)
        found = bench_training(cfg, device, micro, args.warmup, args.reps, compiled=args.compile)
        hf = found["transformers"]
        for name, row in found.items():
            rows.append(_train_cells(preset, name, micro, cfg, row, hf))
            if name == "transformers":
                continue
            mode = name.removeprefix("ours ")
            results[f"training tokens/s vs transformers, {preset}, {mode}"] = row["tokens/s"] / hf["tokens/s"]
            if row["MFU"] is not None:
                results[f"MFU share, {preset}, {mode}"] = row["MFU"]
        print(f"  {preset}: max |logit diff| ours vs transformers at the same weights {hf['max |logit diff|']:.1e}",
              file=sys.stderr)
    print_table("training: forward + backward + clip + AdamW, one process (x transformers = tokens/s ratio)",
                ["preset", "model", "batch x seq", "ms/step", "tokens/s", "TFLOP/s", "MFU", "peak GiB",
                 "x transformers"], rows)


def engines(args, device, results: dict) -> None:
    import torch.distributed as dist

    from lm.bench.training import bench_engine

    rows = []
    for preset in args.presets:
        for engine in args.engines:
            cfg, micro = preset_config(preset, device)
            name, _, stage = engine.partition("-zero")
            cfg.parallel.engine = name
            cfg.parallel.zero_stage = int(stage or 0)
            row = bench_engine(cfg, device, micro, args.warmup, args.reps)
            rows.append([preset, engine, f"{micro} x {cfg.data.seq_len}", f"{row['ms/step']:.1f}",
                         f"{row['tokens/s']:,.0f}", f"{row['TFLOP/s']:.3f}", fmt(row["MFU"], ".1%"),
                         fmt(row["peak GiB"], ".2f")])
    if dist.is_initialized():
        dist.destroy_process_group()
    print_table("engines: the trainer's engine interface, one process (world size 1)",
                ["preset", "engine", "batch x seq", "ms/step", "tokens/s", "TFLOP/s", "MFU", "peak GiB"], rows)


def sampling(args, device, results: dict) -> None:
    from lm.bench.sampling_speed import COMPILED, bench_sampling

    cfg, _ = preset_config(args.sampling_preset, device)
    rows = []
    for batch in (1, 8):
        found = bench_sampling(cfg, device, batch, args.new_tokens, args.warmup, args.reps, args.reps_no_cache,
                               compiled=args.compile)
        speed = {row["method"]: row["tokens/s"] for row in found}
        ours = speed["ours, KV cache"]
        for row in found:
            rows.append([args.sampling_preset, row["method"], str(batch), f"{row['tokens/s']:,.0f}",
                         f"{row['ms/step']:.2f}", f"{ours / row['tokens/s']:.2f}", f"{row['same tokens']:.0%}"])
        results[f"sampling tokens/s vs transformers generate, batch {batch}, KV cache"] = (
            ours / speed["transformers generate"])
        if COMPILED in speed:
            results[f"sampling tokens/s vs transformers generate, batch {batch}, compiled"] = (
                speed[COMPILED] / speed["transformers generate"])
            results[f"sampling tokens/s compiled vs no cache, batch {batch}"] = (
                speed[COMPILED] / speed["ours, no cache"])
    print_table(f"sampling: {args.new_tokens} new tokens per sequence, greedy, from one token",
                ["preset", "sampler", "batch", "tokens/s", "ms/step", "ours KV cache x", "same tokens"], rows)


def data(args, device, results: dict) -> None:
    from lm.bench.data import bench_loader, bench_prepare
    from lm.bench.training import bench_model

    cfg, _ = preset_config("demo", torch.device("cpu"))
    prep = bench_prepare(cfg, args.reps_data)
    results["prepare tokens/s vs a one-process loop"] = prep["speedup"]
    print_table(f"data preparation: {prep['documents']} text files, {prep['tokens']:,} tokens",
                ["how", "tokens/s", "x loop"], [
        [f"lm.prepare, {prep['workers']} threads", f"{prep['prepare tokens/s']:,.0f}", f"{prep['speedup']:.2f}"],
        ["encode_ordinary loop, 1 process", f"{prep['loop tokens/s']:,.0f}", "1.00"],
    ])
    rows = []
    for preset in args.presets:
        cfg, micro = preset_config(preset, device)
        loader = bench_loader(cfg, micro, steps=200)
        step = bench_model(cfg, device, micro, args.warmup, args.reps)["ms/step"] / 1e3
        share = loader["seconds/step"] / (loader["seconds/step"] + step)
        results[f"loader share of a {preset} training step"] = share
        rows.append([preset, f"{micro} x {cfg.data.seq_len}", f"{loader['batches/s']:,.0f}", f"{loader['GB/s']:.3f}",
                     f"{loader['seconds/step'] * 1e3:.3f}", f"{step * 1e3:.1f}", f"{share:.3%}"])
    print_table("loader: next_batch over memory-mapped shards, one rank",
                ["preset", "batch x seq", "batches/s", "GB/s", "ms/batch", "train ms/step", "share of step"], rows)


def hfimport(args, device, results: dict) -> None:
    import tempfile

    from lm.bench.hf_import import MODELS, SHARD_BYTES, measure_import, write_random_checkpoint

    rows = []
    for name in args.import_models:
        cfg, dtype = MODELS[name]
        with tempfile.TemporaryDirectory(dir=args.import_dir) as tmp:
            size = write_random_checkpoint(cfg, Path(tmp), dtype, SHARD_BYTES)
            for who in ("ours", "transformers"):
                runs = [measure_import(Path(tmp), who) for _ in range(args.reps_import)]
                row = sorted(runs, key=lambda r: r["load s"] + r["forward s"])[len(runs) // 2]  # the median run
                rows.append([name, str(dtype).removeprefix("torch."), f"{size / 1e9:.2f}", who,
                             f"{row['params'] / 1e6:,.0f}", f"{row['load s']:.2f}", f"{row['forward s']:.2f}",
                             f"{row['base GiB']:.2f}", f"{row['peak GiB']:.2f}"])
    print_table("import of a random Hugging Face checkpoint (safetensors shards) into float32 on the CPU, then one "
                "forward of 8 tokens; a fresh process each (median run)",
                ["model", "stored", "file GB", "loader", "M params", "load s", "forward s", "RSS before GiB",
                 "peak RSS GiB"], rows)


def corpus(args, device, results: dict) -> None:
    from lm.bench.corpus import bench_corpus

    found = bench_corpus(args.corpus, args.num_proc, args.reps_corpus, args.corpus_work)
    rows = []
    for name, sides in found["tokenizers"].items():
        ours, theirs = sides["ours"], sides["datasets"]
        speedup = theirs["wall s"] / ours["wall s"]  # the same tokens on both sides
        results[f"prepare tokens/s vs datasets map num_proc={args.num_proc}, {name}"] = speedup
        for how, row in ((f"lm.prepare, {args.num_proc} threads", ours),
                         (f"load_dataset + map, num_proc={args.num_proc}", theirs)):
            steps = f"load {row['load s']:.1f} + map {row['map s']:.1f}" if "load s" in row else ""
            rows.append([name, how, f"{row['tokens']:,}", f"{row['wall s']:.1f}", steps,
                         f"{row['tokens'] / row['wall s'] / 1e6:.2f}", f"{row['max RSS MiB']:,.0f}",
                         f"{row['tree MiB']:,.0f}"])
    print_table(f"corpus: {found['files']} files, {found['MB']:.1f} MB, {found['documents']:,} documents; each run a "
                f"fresh process, start to exit (median of {args.reps_corpus}); the GPT-2 tokenizer.json's shards "
                f"{'equal' if found['same shards'] else 'DIFFER FROM'} tiktoken's byte for byte",
                ["tokenizer", "how", "tokens", "wall s", "of which s", "M tokens/s", "max RSS MiB", "tree MiB"], rows)
    rows = []
    for name, scales in found["scales"].items():
        quarter = scales["1/4"]["max RSS MiB"]
        results[f"prepare peak memory, all vs a quarter of the corpus, {name}"] = scales["all"]["max RSS MiB"] / quarter
        rows += [[name, label, str(row["files"]), f"{row['documents']:,}", f"{row['tokens']:,}", f"{row['wall s']:.1f}",
                  f"{row['tokens'] / row['wall s'] / 1e6:.2f}", f"{row['max RSS MiB']:,.0f}",
                  f"{row['max RSS MiB'] / quarter:.3f}"] for label, row in scales.items()]
    print_table("lm.prepare on part of the corpus and on three copies of it: peak memory",
                ["tokenizer", "share", "files", "documents", "tokens", "wall s", "M tokens/s", "max RSS MiB", "x 1/4"],
                rows)


def summary_rows(results: dict[str, float]) -> list[list[str]]:
    """The ratios and shares the sections measured, one row each, as a ratio (x) or a share (%)."""
    return [[what, f"{value:.2%}" if "share" in what else f"{value:.2f}x"] for what, value in results.items()]


def header(device: torch.device) -> str:
    """What the numbers were measured on: the device, the CPU, the versions and the date, in one line."""
    import datetime

    import transformers

    return (f"device: {device_name(device)} | {platform.processor() or platform.machine()}, {os.cpu_count()} cores | "
            f"python {platform.python_version()} | torch {torch.__version__} | transformers {transformers.__version__}"
            f" | {datetime.date.today().isoformat()}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lm.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, help=f"default: {' '.join(DEFAULT_SECTIONS)}")
    parser.add_argument("--presets", nargs="+", choices=PRESETS)
    parser.add_argument("--engines", nargs="+", choices=ENGINES)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--warmup", type=WARMUP, help="untimed repetitions first (default 2)")
    parser.add_argument("--reps", type=positive_int, help="timed repetitions, the median reported (default 5)")
    parser.add_argument("--reps-no-cache", type=positive_int,
                        help="timed repetitions of sampling without cache")
    parser.add_argument("--reps-data", type=positive_int, help="timed repetitions of data preparation")
    parser.add_argument("--no-compile", dest="compile", action="store_const", const=False,
                        help="skip the torch.compile rows")
    parser.add_argument("--new-tokens", type=positive_int, help="tokens per sequence in the sampling rows")
    parser.add_argument("--sampling-preset", choices=PRESETS)
    parser.add_argument("--import-models", nargs="+", choices=["gpt2-124m", "llama-1.1b"],
                        help="hfimport: the checkpoints to write and import")
    parser.add_argument("--import-dir", help="hfimport: where to write them (default: the temp dir)")
    parser.add_argument("--reps-import", type=positive_int, help="hfimport: fresh processes per loader")
    parser.add_argument("--corpus", nargs="+",
                        help="corpus: globs of the JSON-lines files (text in `text`) to prepare, e.g. the Debian mix "
                             "of launch/debian_corpus.sh")
    parser.add_argument("--corpus-work",
                        help="corpus: where to write shards and datasets' cache (default: the temp dir)")
    parser.add_argument("--num-proc", type=positive_int,
                        help="corpus: workers of each side, datasets.map's num_proc and lm.prepare's "
                             "data.num_workers threads (default: the cores)")
    parser.add_argument("--reps-corpus", type=positive_int, help="corpus: runs of each side, in turns")
    parser.add_argument("--profile", action="store_true",
                        help="instead: torch.profiler's top ops of a training step, ours and transformers', per preset")
    args = parser.parse_args(argv)
    if problem := ignored_flags(args):
        parser.error(problem)
    args.sections = args.sections or DEFAULT_SECTIONS
    for name, (default, _) in SECTION_FLAGS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if problem := late_problem(args):  # found now, not after minutes of the sections before the one that reads it
        parser.error(problem)
    if "corpus" in args.sections and not args.corpus:
        parser.error("--sections corpus needs --corpus GLOB ...")
    device = init_device(args.device, "--device")
    print(header(device))
    if args.profile:
        from lm.bench.training import profile_step

        for preset in args.presets:
            cfg, micro = preset_config(preset, device)
            for hf in (False, True):
                who = "transformers" if hf else "ours"
                print(f"\n{preset}, {who}: {args.reps} steps of {micro} x {cfg.data.seq_len}")
                print(profile_step(cfg, device, micro, args.warmup, args.reps, hf=hf))
        return 0
    results: dict[str, float] = {}
    for section in SECTIONS:
        if section in args.sections:
            globals()[section](args, device, results)
    if results:
        print_table(f"summary: ours against the baselines above ({device_name(device)})", ["measure", "value"],
                    summary_rows(results))
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
