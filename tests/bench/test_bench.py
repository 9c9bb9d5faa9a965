"""The benchmark's pieces on tiny models: they must time the work they claim, on the same model as
transformers' where they compare, and print a table."""

import argparse
import contextlib
import glob
import itertools
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from lm.bench import __main__ as bench
from lm.bench import common, corpus, data, datasets_map, hf_import, prepare_speed, sampling_speed, training
from lm.bench.corpus import write_gpt2_tokenizer_json
from lm.bench.data import bench_loader, bench_prepare
from lm.bench.sampling_speed import bench_sampling, exported_hf_model
from lm.bench.training import bench_engine, engine_step, profile_step, sdpa_kernel
from lm.cli import run
from lm.config import load_config
from lm.models import generate
from lm.models.gpt.config import GPTConfig
from lm.models.registry import family_of
from lm.tokenizer import load_tokenizer
from tests.workers import pool

CPU = torch.device("cpu")
TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=64",
        "--data.seq_len=32", "--train.device=cpu"]


def tiny(*extra: str):
    return load_config(None, [*TINY, *extra])


def test_training_rows_time_our_model_and_transformers_in_turns_on_the_same_weights(monkeypatch):
    # the compiled row's path without a compile (tests/models/test_compiled_loss.py compiles for real)
    monkeypatch.setattr(training, "compile_blocks", lambda blocks: None)
    monkeypatch.setattr(training, "compiled_loss", lambda compiled: contextlib.nullcontext())
    calls, interleaved = [], training.median_seconds_interleaved

    def counting(fns, device, warmup, reps):
        counted = {name: (lambda name=name, fn=fn: calls.append(name) or fn()) for name, fn in fns.items()}
        return interleaved(counted, device, warmup, reps)

    monkeypatch.setattr(training, "median_seconds_interleaved", counting)
    rows = training.bench_training(tiny(), CPU, 2, warmup=1, reps=2)
    names = ["transformers", "ours eager", "ours compiled"]
    # one untimed call of each, then the timed ones in turns: one after the other, the ratio followed the drift
    assert list(rows) == names and calls == names * 3
    assert rows["transformers"]["max |logit diff|"] < 1e-4  # the comparison is between equal models
    for row in rows.values():
        assert row["ms/step"] > 0 and row["tokens/s"] == pytest.approx(2 * 32 / (row["ms/step"] / 1e3))
        assert row["TFLOP/s"] > 0 and row["MFU"] is None  # no known peak for a CPU
        assert row["peak GiB"] > 0.05  # the process's resident set on Linux
    assert list(training.bench_training(tiny(), CPU, 2, warmup=0, reps=1, compiled=False)) == names[:2]


def test_profile_names_the_matmuls():
    table = profile_step(tiny(), CPU, 2, warmup=1, reps=1)
    assert "aten::mm" in table and "Self CPU" in table


def test_sdpa_kernel_names_the_backend_that_runs():
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as allow_only

    assert sdpa_kernel(tiny(), CPU, 2) == "flash_attention_for_cpu"
    with allow_only(SDPBackend.MATH):
        assert sdpa_kernel(tiny(), CPU, 2) == "math"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_engine_rows_run_the_trainer_interface(engine):
    extra = ["--parallel.zero_stage=2"] if engine == "deepspeed" else []
    try:
        row = bench_engine(tiny(f"--parallel.engine={engine}", *extra), CPU, 2, warmup=1, reps=2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert row["ms/step"] > 0 and row["tokens/s"] > 0


def _weights_changed_by_each_call(engine: str, calls: int) -> tuple[list[bool], int | None]:
    """A pool's job: `calls` of the engines table's step under `engine`, whether each changed the weights, and
    DeepSpeed's count of the optimizer steps it took (None under the other engines)."""
    name, _, stage = engine.partition("-zero")
    # a batch of 4 micro-batches: DeepSpeed, built with it, stepped in every 4th call (the table timed its
    # forward and backward alone) while ddp and fsdp stepped in each
    cfg = tiny(f"--parallel.engine={name}", f"--parallel.zero_stage={stage or 0}", "--train.batch_size=8",
               "--train.micro_batch_size=2")
    step, built = engine_step(cfg, CPU, 2)

    def weights() -> torch.Tensor:
        with built.full_weights():
            return torch.cat([p.detach().flatten().clone() for p in built.model.parameters()])

    changed = []
    for _ in range(calls):
        before = weights()
        step()
        changed.append(not torch.equal(before, weights()))
    return changed, built.engine.global_steps if name == "deepspeed" else None


@pytest.mark.process  # in a pool's rank: DeepSpeed keeps its groups module-wide, so its group must outlive it
@pytest.mark.parametrize("engine", bench.ENGINES)
def test_each_engine_call_is_one_optimizer_step(engine):
    changed, deepspeed_steps = pool(1).run(_weights_changed_by_each_call, engine, 3)[0]["value"]
    assert changed == [True, True, True]
    assert deepspeed_steps == (3 if engine.startswith("deepspeed") else None)


@pytest.fixture
def uncompiled_step(monkeypatch):
    """The compiled sampling row with its step run eager: its path without a compile (tests/models/test_generate.py
    compiles it for real)."""

    monkeypatch.setattr(generate, "compiled_step", lambda device_type: generate.next_logits)


@pytest.mark.slow
def test_sampling_rows_decode_the_same_tokens(uncompiled_step):
    rows = bench_sampling(tiny(), CPU, batch=3, new_tokens=12, warmup=1, reps=2, reps_no_cache=1, compiled=True)
    assert [r["method"] for r in rows] == ["ours, KV cache", "ours, no cache", "ours, static cache, compiled",
                                           "transformers generate"]
    assert all(r["batch"] == 3 and r["tokens/s"] > 0 for r in rows)
    # a step decodes one token of each of the 3 sequences
    assert all(r["tokens/s"] * r["ms/step"] / 1e3 == pytest.approx(3) for r in rows)
    assert rows[0]["same tokens"] == rows[1]["same tokens"] == rows[2]["same tokens"] == 1.0
    assert rows[3]["same tokens"] >= 0.9  # transformers runs the exported copy; a near-tie may flip


def _counting(monkeypatch, module) -> list[str]:
    """Record the name of each method `module`'s timing calls, in order."""
    calls, interleaved = [], module.median_seconds_interleaved

    def counting(fns, device, warmup, reps):
        counted = {name: (lambda name=name, fn=fn: calls.append(name) or fn()) for name, fn in fns.items()}
        return interleaved(counted, device, warmup, reps)

    monkeypatch.setattr(module, "median_seconds_interleaved", counting)
    return calls


def test_sampling_takes_the_warmup_it_is_given(uncompiled_step, monkeypatch):
    calls = _counting(monkeypatch, sampling_speed)
    bench_sampling(tiny(), CPU, batch=1, new_tokens=2, warmup=3, reps=1, reps_no_cache=1, compiled=False)
    # 3 untimed calls of each method (it was held to 1), then the timed one
    assert {name: calls.count(name) for name in calls} == {"ours, KV cache": 4, "ours, no cache": 4,
                                                           "transformers generate": 4}


@pytest.mark.process
def test_prepare_and_loader_rows():
    prep = bench_prepare(tiny(), reps=1, repeat=1)
    assert prep["documents"] == 38 and prep["tokens"] > 1_000_000  # the built-in plays, each with its EOT
    assert prep["prepare tokens/s"] > 0 and prep["speedup"] == pytest.approx(
        prep["prepare tokens/s"] / prep["loop tokens/s"])
    loader = bench_loader(tiny(), 4, steps=20)
    # each micro-batch is (x, y) of 4 x 32 int64 tokens
    assert loader["GB/s"] * 1e9 / loader["batches/s"] == pytest.approx(2 * 4 * 32 * 8)


def test_the_command_prints_what_it_ran_on_its_tables_and_a_summary_of_the_ratios(capsys, uncompiled_step):
    assert run(bench.main, ["--sections", "sampling", "--new-tokens", "4", "--reps", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("device: CPU, ") and " | torch 2." in first and " | transformers " in first
    assert "sampling: 4 new tokens per sequence" in out and "transformers generate" in out
    header = next(line for line in out.splitlines() if line.startswith("preset") and "sampler" in line)
    assert header.split()[3:5] == ["tokens/s", "ms/step"]  # a step of the whole batch, not one token
    summary = out[out.index("summary: ours against the baselines above"):]
    assert "sampling tokens/s vs transformers generate, batch 8, KV cache" in summary
    assert "sampling tokens/s vs transformers generate, batch 1, compiled" in summary
    assert "sampling tokens/s compiled vs no cache, batch 1" in summary
    # measurements only: no internal targets, nothing "met" or not
    assert "target" not in out.lower() and "met" not in out.lower()


def test_the_summary_shows_ratios_and_shares():
    results = {"training tokens/s vs transformers, demo, eager": 1.25, "loader share of a demo training step": 0.02}
    assert bench.summary_rows(results) == [["training tokens/s vs transformers, demo, eager", "1.25x"],
                                           ["loader share of a demo training step", "2.00%"]]


def test_bad_flags():
    with pytest.raises(SystemExit):
        bench.main(["--reps", "0"])


@pytest.mark.parametrize("argv, message", [
    (["--sections", "data", "--import-models", "gpt2-124m"],
     "--import-models: only --sections hfimport reads it, and this run is --sections data"),
    (["--new-tokens", "4", "--sections", "training", "engines"],
     "--new-tokens: only --sections sampling reads it, and this run is --sections training engines"),
    (["--profile", "--engines", "ddp"], "--engines: only --sections engines reads it, and this run is --profile"),
    (["--profile", "--sections", "training"], "--sections: --profile runs none of them"),
    (["--sections", "hfimport", "--no-compile"], "--no-compile: only --sections training or --sections sampling reads "
     "it, and this run is --sections hfimport"),
    # found at once, not when the section starts after the ones before it
    (["--sections", "training", "sampling", "--new-tokens", "257"], "--new-tokens: 257 do not fit --sampling-preset "
     "demo's context of 256 tokens after a one-token prompt; give at most 256"),
    (["--sections", "hfimport", "--import-dir", "README.md"], "--import-dir README.md: is a file"),
    (["--warmup", "-1"], "argument --warmup: expected an integer in [0, 10000], got '-1'"),
])
def test_flags_no_chosen_section_reads_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_each_time_is_the_median_of_its_own_timed_calls_after_the_untimed_warmup(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    durations = {"a": iter([100.0, 1.0, 2.0, 9.0]), "b": iter([50.0, 3.0])}  # the first call of each: warm-up

    def timed(name):
        def fn():
            clock[0] += next(durations[name])
        return fn

    seconds = common.median_seconds_interleaved({"a": timed("a"), "b": timed("b")}, CPU, 1, {"a": 3, "b": 1})
    # a: the median of 1, 2 and 9 (not their mean, 4, nor a warm-up's 100); b: its one timed call
    assert seconds == {"a": 2.0, "b": 3.0}


def test_a_row_derives_tokens_per_second_tflops_and_mfu_from_the_step_time(monkeypatch):
    monkeypatch.setattr(training, "flops_per_token", lambda model, seq_len, data: 1e9)
    monkeypatch.setattr(training, "peak_flops", lambda device: 1e12)
    row = training._row(tiny(), CPU, 0.5, 4, 1.5, {})
    # 4 sequences of 32 tokens in 0.5 s: 256 tokens/s, each 1e9 FLOPs: 2.56e11 FLOP/s of a 1e12 peak
    assert row == {"ms/step": 500.0, "tokens/s": 256.0, "TFLOP/s": pytest.approx(0.256),
                   "MFU": pytest.approx(0.256), "peak GiB": 1.5}


def test_the_compiled_training_row_is_warmed_up_once_even_with_no_warmup(monkeypatch):
    monkeypatch.setattr(training, "compile_blocks", lambda blocks: None)
    monkeypatch.setattr(training, "compiled_loss", lambda compiled: contextlib.nullcontext())
    calls = _counting(monkeypatch, training)
    training.bench_training(tiny(), CPU, 2, warmup=0, reps=1)
    # one untimed call of each (the compile's, which would otherwise be timed) and the timed one
    assert calls == ["transformers", "ours eager", "ours compiled"] * 2


def test_a_transformers_twin_with_other_weights_is_refused(monkeypatch):
    real = training.hf_twin

    def other_weights(model):
        hf = real(model)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
        return hf

    monkeypatch.setattr(training, "hf_twin", other_weights)
    with pytest.raises(RuntimeError, match="transformers' copy of the model gives other logits"):
        training.training_step(tiny(), CPU, 2, hf=True)


def test_sampling_times_each_method_its_own_reps_and_warms_the_compiled_one_up(uncompiled_step, monkeypatch):
    calls = _counting(monkeypatch, sampling_speed)
    sampling_speed.bench_sampling(tiny(), CPU, batch=1, new_tokens=2, warmup=0, reps=2, reps_no_cache=1,
                                  compiled=True)
    # one warm-up call each (the compiled row compiles in it), then 2 timed calls, 1 for the no-cache row
    assert {name: calls.count(name) for name in calls} == {
        "ours, KV cache": 3, "ours, no cache": 2, "ours, static cache, compiled": 3, "transformers generate": 3}


def test_same_tokens_is_the_share_equal_to_the_kv_cache_rows(uncompiled_step, monkeypatch):
    real = sampling_speed.generate_batch

    def one_token_off_without_cache(model, prompt, new_tokens, use_cache, **kwargs):
        out = real(model, prompt, new_tokens, use_cache=use_cache, **kwargs)
        if not use_cache:
            out = out.clone()
            out[:, -1] = (out[:, -1] + 1) % 50
        return out

    monkeypatch.setattr(sampling_speed, "generate_batch", one_token_off_without_cache)
    rows = sampling_speed.bench_sampling(tiny(), CPU, batch=2, new_tokens=4, warmup=0, reps=1, reps_no_cache=1)
    same = {row["method"]: row["same tokens"] for row in rows}
    assert same["ours, KV cache"] == 1.0 and same["ours, no cache"] == 0.75  # 3 of each sequence's 4 tokens


def test_the_training_table_and_summary_give_ours_over_transformers(monkeypatch, capsys):
    def row(tok_s, mfu=None):
        return {"ms/step": 10.0, "tokens/s": tok_s, "TFLOP/s": 0.5, "MFU": mfu, "peak GiB": 1.0}

    rows = {"transformers": {**row(200.0), "max |logit diff|": 1e-6}, "ours eager": row(300.0, 0.25),
            "ours compiled": row(100.0, 0.125)}
    monkeypatch.setattr(training, "bench_training", lambda *args, **kwargs: rows)
    monkeypatch.setattr(training, "sdpa_kernel", lambda *args: "math")
    results = {}
    bench.training(argparse.Namespace(presets=["demo"], warmup=0, reps=1, compile=True), CPU, results)
    assert results == {"training tokens/s vs transformers, demo, eager": 1.5, "MFU share, demo, eager": 0.25,
                       "training tokens/s vs transformers, demo, compiled": 0.5, "MFU share, demo, compiled": 0.125}
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in table[-3:]] == ["1.00", "1.50", "0.50"]  # the x transformers column


def test_the_sampling_table_and_summary_ratios(monkeypatch, capsys):
    speeds = {"ours, KV cache": 400.0, "ours, no cache": 100.0, sampling_speed.COMPILED: 800.0,
              "transformers generate": 200.0}
    monkeypatch.setattr(sampling_speed, "bench_sampling", lambda cfg, device, batch, *args, **kwargs: [
        {"method": m, "batch": batch, "tokens/s": s, "ms/step": 1.0, "same tokens": 1.0} for m, s in speeds.items()])
    results = {}
    args = argparse.Namespace(sampling_preset="demo", new_tokens=4, warmup=0, reps=1, reps_no_cache=1, compile=True)
    bench.sampling(args, CPU, results)
    for batch in (1, 8):
        assert results[f"sampling tokens/s vs transformers generate, batch {batch}, KV cache"] == 2.0
        assert results[f"sampling tokens/s vs transformers generate, batch {batch}, compiled"] == 4.0
        assert results[f"sampling tokens/s compiled vs no cache, batch {batch}"] == 8.0
    lines = capsys.readouterr().out.splitlines()
    # "ours KV cache x": how many times the row's tokens/s ours with the cache makes
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines if line.startswith("demo")]
    column = {row[1]: row[5] for row in cells if row[2] == "1"}
    assert column == {"ours, KV cache": "1.00", "ours, no cache": "4.00", "ours, static cache, compiled": "0.50",
                      "transformers generate": "2.00"}


def test_the_loaders_share_of_a_step_is_of_loader_plus_model_time(monkeypatch):
    monkeypatch.setattr(data, "bench_prepare", lambda cfg, reps: {
        "speedup": 3.0, "documents": 2, "tokens": 100, "workers": 2, "prepare tokens/s": 30.0, "loop tokens/s": 10.0})
    monkeypatch.setattr(data, "bench_loader", lambda cfg, micro, steps: {
        "seconds/step": 0.01, "batches/s": 100.0, "GB/s": 0.1})
    monkeypatch.setattr(training, "bench_model", lambda *args: {"ms/step": 30.0})
    results = {}
    bench.data(argparse.Namespace(presets=["demo"], reps_data=1, warmup=0, reps=1), CPU, results)
    # 10 ms of loading in a step of 10 + 30 ms
    assert results == {"prepare tokens/s vs a one-process loop": 3.0,
                       "loader share of a demo training step": pytest.approx(0.25)}


def test_the_summary_shows_mfu_as_a_share():
    assert bench.summary_rows({"MFU share, demo, eager": 0.4}) == [["MFU share, demo, eager", "40.00%"]]


def test_the_corpus_tables_compare_wall_times_and_peaks_against_a_quarter(monkeypatch, capsys):
    def run(wall, rss, **extra):
        return {"tokens": 1000, "wall s": wall, "max RSS MiB": rss, "tree MiB": rss, **extra}

    found = {"files": 4, "MB": 1.0, "documents": 10, "same shards": True,
             "tokenizers": {"gpt2": {"ours": run(10.0, 100.0), "datasets": run(30.0, 500.0, **{"load s": 5.0,
                                                                                               "map s": 20.0})}},
             "scales": {"gpt2": {label: run(1.0, rss, files=1, documents=1)
                                 for label, rss in (("1/4", 100.0), ("1/2", 150.0), ("all", 300.0), ("3 x", 800.0))}}}
    monkeypatch.setattr(corpus, "bench_corpus", lambda *args: found)
    results = {}
    args = argparse.Namespace(corpus=["x"], num_proc=2, reps_corpus=1, corpus_work=None)
    bench.corpus(args, CPU, results)
    assert results == {"prepare tokens/s vs datasets map num_proc=2, gpt2": 3.0,  # the same tokens in a third
                       "prepare peak memory, all vs a quarter of the corpus, gpt2": 3.0}
    out = capsys.readouterr().out
    assert [line.split()[-1] for line in out.splitlines()[-4:]] == ["1.000", "1.500", "3.000", "8.000"]


def test_the_import_table_shows_the_median_run(monkeypatch, tmp_path, capsys):

    monkeypatch.setattr(hf_import, "write_random_checkpoint", lambda cfg, path, dtype, shard: 1e9)
    loads = itertools.cycle([5.0, 1.0, 3.0])
    monkeypatch.setattr(hf_import, "measure_import", lambda path, who: {
        "load s": next(loads), "forward s": 0.5, "params": 1e6, "base GiB": 0.1, "peak GiB": 0.2})
    args = argparse.Namespace(import_models=["gpt2-124m"], import_dir=str(tmp_path), reps_import=3)
    bench.hfimport(args, CPU, {})
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("gpt2-124m")]
    assert [row[5] for row in rows] == ["3.00", "3.00"]  # load s of the median run of 5, 1 and 3 s, each loader


def test_new_tokens_may_fill_the_whole_context():
    args = argparse.Namespace(sections=["sampling"], sampling_preset="demo", new_tokens=256, import_dir=None,
                              corpus_work=None)
    assert bench.late_problem(args) is None  # demo's 256-token context: the last new token is never fed back
    args.new_tokens = 257
    assert "give at most 256" in bench.late_problem(args)


def test_gpt2_124m_on_a_cpu_is_timed_on_one_short_sequence():
    cfg, micro = common.preset_config("gpt2-124m", CPU)
    assert (micro, cfg.data.seq_len, cfg.train.dtype) == (1, 256, "float32")


def test_prepare_speed_compares_the_median_reps_of_each_side(monkeypatch):

    clock = [0.0]
    monkeypatch.setattr(prepare_speed, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    prepare_s, loop_s = iter([100.0, 1.0, 2.0, 9.0]), iter([3.0, 5.0, 4.0])  # prepare's first call: the warm-up

    def prepare(data, force):
        clock[0] += next(prepare_s)
        return {"splits": {"train": {"tokens": 90}, "val": {"tokens": 10}}}

    def encode_ordinary(text):
        clock[0] += next(loop_s)

    monkeypatch.setattr(prepare_speed, "prepare", prepare)
    monkeypatch.setattr(prepare_speed, "load_tokenizer", lambda name: types.SimpleNamespace(
        encode_ordinary=encode_ordinary))
    monkeypatch.setattr(prepare_speed, "find_corpus", lambda name: types.SimpleNamespace(
        documents=lambda field: ["one document"]))
    found = prepare_speed.measure("gpt2", reps=3, repeat=1)
    # 100 tokens; medians of 2 s (of 1, 2, 9) and 4 s (of 3, 5, 4): the loop takes twice as long
    assert found["documents"] == 1 and found["tokens"] == 100
    assert found["prepare tokens/s"] == 50.0 and found["loop tokens/s"] == 25.0 and found["speedup"] == 2.0


def test_a_cell_of_zero_is_a_number_and_only_a_missing_value_is_a_dash():
    assert common.fmt(0.0, ".1%") == "0.0%" and common.fmt(0, ".2f") == "0.00" and common.fmt(None, ".2f") == "-"


def test_bench_prepare_passes_reps_and_repeat_apart(monkeypatch):
    ran = []

    def run(argv, **kwargs):
        ran.append(argv)
        return types.SimpleNamespace(stdout='{"speedup": 2.0}')

    monkeypatch.setattr(data.subprocess, "run", run)
    assert data.bench_prepare(tiny(), reps=5, repeat=2) == {"speedup": 2.0}
    assert ran[0][ran[0].index("--reps") + 1] == "5" and ran[0][ran[0].index("--repeat") + 1] == "2"


def test_the_loader_row_is_per_step(monkeypatch):
    clock = iter([0.0, 10.0])
    monkeypatch.setattr(data, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    row = data.bench_loader(tiny(), 4, steps=5)
    # 5 steps in 10 s; each step is (x, y) of 4 x 32 int64 tokens
    assert row["seconds/step"] == 2.0 and row["batches/s"] == 0.5
    assert row["GB/s"] == pytest.approx(2 * 4 * 32 * 8 / 2.0 / 1e9)


def test_prepare_speed_writes_each_copy_of_the_corpus_and_prepares_on_every_core(monkeypatch):
    seen = []

    def prepare(cfg, force):
        seen.append((len(glob.glob(cfg.source)), cfg.num_workers))
        return {"splits": {"train": {"tokens": 10}}}

    monkeypatch.setattr(prepare_speed, "prepare", prepare)
    monkeypatch.setattr(prepare_speed, "load_tokenizer", lambda name: types.SimpleNamespace(
        encode_ordinary=lambda text: None))
    monkeypatch.setattr(prepare_speed, "find_corpus", lambda name: types.SimpleNamespace(
        documents=lambda field: ["one", "two", "three"]))
    found = prepare_speed.measure("gpt2", reps=1, repeat=2)
    assert found["documents"] == 6 and found["workers"] == (os.cpu_count() or 1)
    assert seen == [(6, os.cpu_count() or 1)] * 2  # the warm-up and the one rep, each over the 6 files


MAP_DOCS = ["First document.\n", "Zweites Dokument, größer\n", "4th 😀\n\n"]


@pytest.mark.parametrize("through_json", [False, True])
def test_datasets_map_appends_the_end_of_text_token_and_times_each_step(tmp_path, monkeypatch, capsys,
                                                                       through_json):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in MAP_DOCS))
    tokenizer = str(write_gpt2_tokenizer_json(tmp_path / "tok" / "tokenizer.json")) if through_json else "gpt2"
    clock = iter([1.0, 3.0, 8.0])
    monkeypatch.setattr(datasets_map, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(sys, "argv", ["datasets_map", "--tokenizer", tokenizer, "--num-proc", "1", "--cache",
                                      str(tmp_path / "cache"), str(tmp_path / "a.jsonl")])
    assert datasets_map.main() == 0
    gpt2 = load_tokenizer("gpt2")
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {
        "documents": 3, "tokens": sum(len(gpt2.encode_ordinary(d)) + 1 for d in MAP_DOCS), "load s": 2.0, "map s": 5.0}


def _tiny_gpt():
    return GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=16)


def _shards(directory):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    return index, files, {f: load_file(directory / f) for f in files}


def test_a_random_checkpoint_has_unit_gains_small_weights_and_its_byte_count(tmp_path):
    total = hf_import.write_random_checkpoint(_tiny_gpt(), tmp_path / "one", torch.float32, 10**9)
    index, files, tensors = _shards(tmp_path / "one")
    assert files == ["model-00001-of-00001.safetensors"]
    stored = tensors[files[0]]
    assert total == index["metadata"]["total_size"] == sum(t.numel() * 4 for t in stored.values())
    gains = [n for n, t in stored.items() if t.dim() == 1 and "bias" not in n]
    biases = [n for n, t in stored.items() if "bias" in n]
    assert gains and biases
    assert all(torch.equal(stored[n], torch.ones_like(stored[n])) for n in gains)
    assert all(not torch.equal(stored[n], torch.ones_like(stored[n])) for n in biases)
    weights = torch.cat([t.flatten() for n, t in stored.items() if t.dim() > 1])
    assert 0.015 < weights.std().item() < 0.025


def _on_disk(directory):
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    return files, {f: load_file(directory / f) for f in files}


def test_a_random_checkpoints_shards_fill_up_to_the_limit_and_none_is_empty(tmp_path):
    hf_import.write_random_checkpoint(_tiny_gpt(), tmp_path / "one", torch.float32, 10**9)
    index, _, _ = _shards(tmp_path / "one")
    names = list(index["weight_map"])  # wte, then wpe, ...
    sizes = {n: t.numel() * 4 for n, t in load_file(tmp_path / "one" / "model-00001-of-00001.safetensors").items()}
    # a limit the first two tensors fill exactly: they share the first shard
    hf_import.write_random_checkpoint(_tiny_gpt(), tmp_path / "two", torch.float32, sizes[names[0]] + sizes[names[1]])
    files, tensors = _on_disk(tmp_path / "two")
    assert sorted(tensors[files[0]]) == sorted(names[:2])
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    # a limit below every tensor: one tensor a shard, none empty
    hf_import.write_random_checkpoint(_tiny_gpt(), tmp_path / "each", torch.float32, 1)
    files, tensors = _on_disk(tmp_path / "each")
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert [len(t) for t in tensors.values()] == [1] * len(files)


def test_an_import_that_fails_raises_with_its_output(tmp_path):
    with pytest.raises(subprocess.CalledProcessError):
        hf_import.measure_import(tmp_path / "missing", "ours")


def test_a_fused_tensor_is_written_once_whatever_the_shards(tmp_path):
    # GPT-2's c_attn holds q, k and v: three parts of our weights, one tensor of the checkpoint's
    one = hf_import.write_random_checkpoint(_tiny_gpt(), tmp_path / "one", torch.float32, 10**9)
    each = hf_import.write_random_checkpoint(_tiny_gpt(), tmp_path / "each", torch.float32, 1)
    index, files, tensors = _shards(tmp_path / "each")
    assert one == each == index["metadata"]["total_size"]
    assert files == sorted(p.name for p in (tmp_path / "each").glob("*.safetensors"))  # every file is in the index
    names = [name for stored in tensors.values() for name in stored]
    assert len(names) == len(set(names)) and "transformer.h.0.attn.c_attn.weight" in names


def test_each_timed_call_is_fenced_by_a_device_sync_on_both_sides(monkeypatch):
    events = []
    monkeypatch.setattr(common, "sync", lambda device: events.append("sync"))
    common.median_seconds_interleaved({"a": lambda: events.append("call")}, torch.device("cpu"), 1, {"a": 2})
    # the warm-up call untimed; each timed call waits for the queued work before and after it
    assert events == ["call", "sync", "call", "sync", "sync", "call", "sync"]


# In a fresh interpreter, as the benchmark measures: this one's pages, kept or freed by earlier tests, would blur it
_PEAK_CHILD = """
import gc, json, torch
from pathlib import Path
from lm.bench.common import peak_memory_gib, reset_peak_memory
def hwm():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024 / 2**30
cpu = torch.device("cpu")
big = b"1" * (512 * 2**20)  # 512 MiB, every page written
held = (peak_memory_gib(cpu), hwm())
del big
gc.collect()
before = peak_memory_gib(cpu)
reset_peak_memory(cpu)
print(json.dumps({"held": held, "before": before, "after": peak_memory_gib(cpu), "hwm": hwm()}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only")
def test_a_cpu_peak_is_the_resident_high_water_mark_in_gib_and_a_reset_starts_it_anew():
    found = json.loads(subprocess.run([sys.executable, "-c", _PEAK_CHILD], capture_output=True, text=True,
                                      check=True).stdout)
    assert found["held"][0] == pytest.approx(found["held"][1]) and found["held"][0] > 0.5
    assert found["after"] < found["before"] - 0.4  # the freed half GiB is no longer the peak
    assert found["after"] == pytest.approx(found["hwm"])


def test_a_table_left_aligns_its_first_column_right_aligns_the_rest_two_spaces_apart(capsys):
    common.print_table("title", ["method", "tokens/s"], [["ours", "12.5"], ["transformers generate", "3.0"]])
    assert capsys.readouterr().out == ("\ntitle\n"
                                       "method                 tokens/s\n"
                                       "ours                       12.5\n"
                                       "transformers generate       3.0\n")


def test_the_cpu_device_is_named_with_its_thread_count():
    assert common.device_name(torch.device("cpu")) == f"CPU, {torch.get_num_threads()} threads"


def test_the_exported_twin_never_stops_early_at_an_end_of_text_token():
    cfg = tiny()
    model = family_of(cfg.model).build(cfg.model).eval()
    hf = exported_hf_model(model, cfg, torch.device("cpu"))
    assert hf.generation_config.eos_token_id is None


def test_every_sampling_row_starts_from_one_end_of_text_token_per_sequence(monkeypatch):
    monkeypatch.setattr(generate, "compiled_step", lambda device_type: generate.next_logits)
    prompts, real = [], sampling_speed.generate_batch

    def recording(model, prompt, new_tokens, **kwargs):
        prompts.append(prompt.clone())
        return real(model, prompt, new_tokens, **kwargs)

    monkeypatch.setattr(sampling_speed, "generate_batch", recording)
    cfg = tiny()
    sampling_speed.bench_sampling(cfg, torch.device("cpu"), batch=2, new_tokens=2, warmup=0, reps=1, reps_no_cache=1)
    eot = load_tokenizer(cfg.data.tokenizer).eot_token
    assert prompts and all(p.tolist() == [[eot], [eot]] for p in prompts)


def test_a_cuda_peak_is_the_allocators_peak_in_gib(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2**30)
    assert common.peak_memory_gib(torch.device("cuda")) == 3.0
