"""The benchmark's pieces on tiny models: they must time the work they claim, on the same model as
transformers' where they compare, and print a table."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from lm.bench import __main__ as bench
from lm.bench.data import bench_loader, bench_prepare
from lm.bench.sampling_speed import bench_sampling
from lm.bench.training import bench_engine, engine_step, profile_step, sdpa_kernel
from lm.cli import run
from lm.config import load_config
from tests.workers import pool

CPU = torch.device("cpu")
TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=64",
        "--data.seq_len=32", "--train.device=cpu"]


def tiny(*extra: str):
    return load_config(None, [*TINY, *extra])


def test_training_rows_time_our_model_and_transformers_in_turns_on_the_same_weights(monkeypatch):
    from lm.bench import training

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
    from lm.models import generate

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


def test_sampling_takes_the_warmup_it_is_given(uncompiled_step, monkeypatch):
    from lm.bench import sampling_speed

    calls, interleaved = [], sampling_speed.median_seconds_interleaved

    def counting(fns, device, warmup, reps):
        counted = {name: (lambda name=name, fn=fn: calls.append(name) or fn()) for name, fn in fns.items()}
        return interleaved(counted, device, warmup, reps)

    monkeypatch.setattr(sampling_speed, "median_seconds_interleaved", counting)
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
