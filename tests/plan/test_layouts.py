"""The layout planner (`lm.plan.layouts`, `lm.train --dry-run --nodes`): its per-GPU memory against the measured
peak of small runs of each layout on 4 CPU processes, against published figures, and the layouts it picks."""

import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lm.cli import run
from lm.config import load_config
from lm.plan.counts import num_params
from lm.plan.layout_table import _rows_text, configured_table, layout_table
from lm.plan.layouts import LayoutEstimate, _ruled_out, estimate_layout, in_flight, layout_rows, pick_layout
from lm.plan.memory import GIB, estimate_memory
from lm.plan.memory_table import plan_table
from lm.train import dry_run
from lm.train import main as train_main
from tests.plan import peak_worker
from tests.workers import job_env, pool, torchrun_forced

WORKER = Path(__file__).with_name("peak_worker.py")
# big enough that the model's tensors, not the process's own allocations, make the peak: ~0.3-1 GB per rank
MEASURED = ["--model.n_layer=4", "--model.d_model=256", "--model.n_head=4", "--model.block_size=256",
            "--data.seq_len=256", "--model.tie_embeddings=false", "--train.micro_batch_size=4", "--train.steps=2",
            "--train.device=cpu", "--train.eval_every=100", "--train.eval_batches=1", "--checkpoint.every=0",
            "--log.sample_every=0", "--log.tensorboard=false", "--parallel.engine=fsdp"]


@pytest.mark.process
@pytest.mark.parametrize("tp, pp, checkpointing", [(1, 1, 1), (2, 1, 0), (1, 2, 0), (2, 2, 0)],
                         ids=["fsdp4-checkpointing", "tp2xfsdp2", "pp2xfsdp2", "tp2xpp2"])
def test_the_estimate_is_within_a_fifth_of_the_measured_peak(tp, pp, checkpointing, tiny_data_dir, tmp_path):
    # one micro-batch per replica and step, or one per pipeline rank: the fewest that show the peak
    flags = [*MEASURED, f"--train.batch_size={4 * 4 // tp}", f"--parallel.tp={tp}", f"--parallel.pp={pp}",
             f"--parallel.activation_checkpointing={checkpointing}", f"--data.dir={tiny_data_dir}"]
    out = tmp_path / "run"
    env = job_env(PYTHONPATH=str(Path.cwd()))
    if torchrun_forced():
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                                 str(WORKER), *flags, f"--train.out_dir={out}"], capture_output=True, text=True,
                                timeout=600, env=env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    else:
        pool(4).run(peak_worker.main, [*flags, f"--train.out_dir={out}"], env=env)
    peaks = [json.loads(Path(p).read_text())["peak"] for p in sorted(glob.glob(str(out / "peak_rank*.json")))]
    assert len(peaks) == 4
    estimate = estimate_layout(load_config(None, flags), tp, pp, 4 // (tp * pp), checkpointing).total
    assert max(peaks) == pytest.approx(estimate, rel=0.2), (peaks, estimate)


def _measure(flags: list[str], out: Path) -> dict[str, int]:
    """The heap at its peak and at the measured step's start (`peak_worker`), the most of the 4 ranks of a run of
    lm.train's `flags` in the tests' pool of processes."""
    pool(4).run(peak_worker.main, [*flags, f"--train.out_dir={out}"], env=job_env(PYTHONPATH=str(Path.cwd())))
    ranks = [json.loads(Path(p).read_text()) for p in glob.glob(str(out / "peak_rank*.json"))]
    return {key: max(rank[key] for rank in ranks) for key in ("peak", "start")}


@pytest.mark.process
def test_context_parallelism_and_hsdp_move_the_measured_heap_as_estimated(tiny_data_dir, tmp_path):
    # each rank runs one micro-batch of 4 windows in all three; loss_chunk keeps the logits from hiding the blocks.
    # cp2 runs first: a process's first job also counts what torch sets up once, which the start comparison avoids
    flags = [*MEASURED, "--model.loss_chunk=128", f"--data.dir={tiny_data_dir}"]
    layouts = {"cp2": ["--train.batch_size=8", "--parallel.cp=2"], "fsdp4": ["--train.batch_size=16"],
               "hsdp2x2": ["--train.batch_size=16", "--parallel.dp_replicate=2"]}
    heap, estimate = {}, {}
    for name, extra in layouts.items():
        heap[name] = _measure([*flags, *extra], tmp_path / name)
        cfg = load_config(None, [*flags, *extra])
        estimate[name] = estimate_layout(cfg, 1, 1, 4 // cfg.parallel.cp, 0, cp=cfg.parallel.cp,
                                         dp_replicate=cfg.parallel.dp_replicate)
        assert heap[name]["peak"] == pytest.approx(estimate[name].total, rel=0.2), (name, heap, estimate[name])
    # cp 2 halves the blocks' tokens but keeps whole keys, values and logits: what the step adds to the heap
    # shrinks by the estimate's saving (the state is sharded over 4 ranks in both)
    added = {name: heap[name]["peak"] - heap[name]["start"] for name in heap}
    saved = estimate["fsdp4"].total - estimate["cp2"].total
    assert saved > 0 and added["fsdp4"] - added["cp2"] == pytest.approx(saved, rel=0.1), (added, saved)
    # two replicas of 2 shards hold twice the state of 4 shards; at the step's start it is the weights and the
    # moments, 12 of the state's 16 bytes a parameter
    grown = estimate["hsdp2x2"].state - estimate["fsdp4"].state
    assert grown > 0 and heap["hsdp2x2"]["start"] - heap["fsdp4"]["start"] == pytest.approx(grown * 12 / 16, rel=0.1)


@pytest.mark.process
def test_gpipe_and_interleaved_1f1b_hold_the_forwards_estimated(tiny_data_dir, tmp_path):
    # pipeline 2 x FSDP2 2 with 4 micro-batches of 2 windows a step: rank 0 holds 4 forwards of its 2 blocks under
    # GPipe (and rank 1 four micro-batches' log-softmax), and 5 of one block (2 of a round on its other stage, 2
    # more a rank from the last, and one) under interleaved 1F1B, where 1F1B would hold 2 of 2 blocks
    flags = [*MEASURED, "--train.micro_batch_size=2", "--train.batch_size=16", "--parallel.pp=2",
             f"--data.dir={tiny_data_dir}"]
    schedules = {"gpipe": ["--parallel.pp_schedule=gpipe"],
                 "interleaved": ["--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_stages_per_rank=2"]}
    heap, estimate = {}, {}
    for name, extra in schedules.items():
        heap[name] = _measure([*flags, *extra], tmp_path / name)
        par = load_config(None, [*flags, *extra]).parallel
        estimate[name] = estimate_layout(load_config(None, [*flags, *extra]), 1, 2, 2, 0,
                                         schedule=par.pp_schedule, stages_per_rank=par.pp_stages_per_rank)
    for name in schedules:
        assert heap[name]["peak"] == pytest.approx(estimate[name].total, rel=0.2), (name, heap, estimate[name])
    # GPipe's peak is far past what 1F1B would hold, which the estimate of 1F1B could not pass for (interleaved
    # 1F1B holds about what 1F1B holds: its smaller stages make up for its longer warm-up)
    one_f_one_b = estimate_layout(load_config(None, flags), 1, 2, 2, 0).total
    assert heap["gpipe"]["peak"] > 1.3 * one_f_one_b, (heap, one_f_one_b)


@pytest.mark.parametrize("pp, stages_per_rank, n_micro", [(2, 2, 4), (2, 2, 2), (4, 2, 8), (4, 3, 4), (4, 2, 12),
                                                          (3, 2, 3)])
def test_interleaved_1f1b_holds_the_forwards_torchs_schedule_runs_before_their_backwards(pp, stages_per_rank,
                                                                                        n_micro):
    # the schedule's own list of actions per rank (torch builds it without a process group): the most forwards a
    # rank has run whose backward it has not
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, stages_per_rank, n_micro
    schedule.number_of_rounds = max(1, n_micro // pp)
    schedule.microbatches_per_round = n_micro // schedule.number_of_rounds
    for rank in range(pp):
        held = most = 0
        for action in filter(None, schedule._calculate_single_rank_operations(rank)):
            held += {_ComputationType.FORWARD: 1, _ComputationType.FULL_BACKWARD: -1}.get(action.computation_type, 0)
            most = max(most, held)
        assert in_flight("interleaved_1f1b", pp, rank, n_micro, stages_per_rank) == most, rank
    assert [in_flight("1f1b", pp, r, n_micro) for r in range(pp)] == [min(n_micro, pp - r) for r in range(pp)]
    assert in_flight("gpipe", pp, pp - 1, n_micro) == n_micro


def test_hsdp_shards_over_one_replica_and_all_reduces_the_shards_across_replicas():
    cfg = load_config("configs/llama3-8b.yaml", [])
    params, hsdp = num_params(cfg.model), estimate_layout(cfg, 1, 1, 8, 0, dp_replicate=2)
    assert hsdp.state == 2 * estimate_layout(cfg, 1, 1, 8, 0).state == 16 * params // 4
    # all-gathers and reduce-scatters over the 4 ranks of a replica, then each fp32 shard all-reduced over 2
    n = hsdp.micro_batches
    assert hsdp.fsdp_bytes == int(params * (4 * n + 4) * 3 / 4 + 8 * params / 4 * 1 / 2)
    assert hsdp.label == "tp 1 x pp 1 x dp 8 (hsdp 2 x 4)"


def test_without_tp_or_pp_the_layout_estimate_is_the_fsdp_engine_estimate():
    cfg = load_config("configs/llama3-8b.yaml", ["--train.micro_batch_size=2", "--train.batch_size=16"])
    for every in (0, 1):
        assert estimate_layout(cfg, 1, 1, 8, every).total == estimate_memory(cfg, 8, "fsdp", 0, False, every).total


def test_llama3_8b_brackets_torchtitans_measured_memory():
    # torchtitan (docs/performance.md, Table 1): Llama 3.1 8B, 8 H100s, FSDP, local batch 2 x 8192 tokens,
    # selective activation checkpointing: 82.4 GiB. Selective recomputation keeps less than none and more than
    # full, so the estimates without and with full recomputation must lie on either side. (Our preset's vocabulary
    # is 100,277 ids to Llama 3's 128,256, which makes its logits about a fifth smaller.)
    cfg = load_config("configs/llama3-8b.yaml", ["--train.micro_batch_size=2", "--train.batch_size=16"])
    none, full = (estimate_layout(cfg, 1, 1, 8, every).total / GIB for every in (0, 1))
    assert full < 82.4 < none


def test_llama3_70b_fits_64_gpus_of_80gb_with_full_recomputation_as_torchtitan_trained_it():
    # torchtitan trained Llama 3 70B with FSDP on 64 A100s of 80 GB, local batch 1 x 8192, full recomputation
    cfg = load_config("configs/llama3-70b.yaml", ["--train.batch_size=64"])
    rows = {(r.tp, r.pp, r.activation_checkpointing, r.cpu_offload): r for r in layout_rows(cfg, 8, 8)}
    assert rows[1, 1, 1, False].total * 1.1 + GIB <= 80 * GIB
    assert rows[1, 1, 0, False].total > 80 * GIB


@pytest.mark.parametrize("config, nodes, picked", [
    ("llama3-8b", 1, (1, 1, 0, False)),   # FSDP alone fits without recomputation
    ("llama3-8b", 8, (1, 1, 0, False)),
    ("llama3-70b", 1, (1, 1, 1, True)),   # 70B's AdamW state is 140 GB per GPU over 8: only offloaded
    ("llama3-70b", 8, (4, 2, 0, False)),  # tensor 4 x pipeline 2 spares the recomputation
])
def test_a_layout_is_picked_for_llama3_8b_and_70b_on_8_and_64_gpus(config, nodes, picked):
    cfg = load_config(f"configs/{config}.yaml", [])
    best = pick_layout(layout_rows(cfg, nodes, 8), 80.0)
    assert (best.tp, best.pp, best.activation_checkpointing, best.cpu_offload) == picked


def test_the_dry_run_prints_the_layouts_and_the_pick(capsys):
    assert train_main(["--config", "configs/llama3-70b.yaml", "--dry-run", "--nodes", "8"]) == 0
    out = capsys.readouterr().out
    assert "layouts on 8 node(s) x 8 GPUs = 64" in out
    assert "pick: tp 4 x pp 2 x dp 8, activation checkpointing off" in out
    assert "--parallel.engine=fsdp --parallel.tp=4 --parallel.pp=2" in out


@pytest.mark.parametrize("args, message", [
    (["--nodes", "2"], "--nodes: only --dry-run takes it"),
    (["--dry-run", "--nodes", "2", "--nproc", "8"], "--nproc 8: --nodes 2 x --gpus-per-node 8 is 16 GPUs"),
])
def test_layout_flags_out_of_place_are_refused(args, message, capsys):
    assert run(train_main, ["--config", "configs/llama3-8b.yaml", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_cluster_the_batch_cannot_split_over_is_named_as_such_not_as_memory():
    """llama-tiny (0.3 GiB) on a million nodes: its 4-sample batch in micro-batches of 2 feeds at most 2 replicas."""
    cfg = load_config("configs/llama-tiny.yaml", [])
    assert layout_rows(cfg, 1_000_000, 8) == []
    line = layout_table(cfg, 1_000_000, 8, 80.0).splitlines()[-1]
    assert line.startswith("pick: no layout of 8000000 GPUs can train this config: the batch split rules out 2 "
                           "(tp 1 x pp 1 x dp 8000000, tp 2 x pp 1 x dp 4000000: train.batch_size: 4 is not a "
                           "multiple of train.micro_batch_size (2) x 8000000 data-parallel replica(s)")
    # the model's divisibility rules out the rest, each key's first case named
    assert "; the divisibility rules out 236 (" in line
    assert "parallel.tp=4: 4 tensor-parallel ranks are more than its 2 key/value heads" in line
    assert "parallel.pp=2: the token embedding sits on the first pipeline stage" in line
    assert line.endswith("this config trains on at most 4 GPUs (tp 2 x pp 1 x dp 2): plan fewer, or raise "
                         "train.batch_size (4)")
    assert "fits 80 GiB" not in line and "memory" not in line


def test_when_only_memory_rules_the_layouts_out_the_pick_says_so_with_the_smallest():
    cfg = load_config("configs/llama3-70b.yaml", [])
    line = layout_table(cfg, 1, 8, 10.0).splitlines()[-1]
    assert line == ("pick: no layout of 8 GPUs can train this config: the memory rules out the 10 that remain (the "
                    "smallest, tp 1 x pp 1 x dp 8 with every block recomputed, state offloaded, needs 34.46 GiB per "
                    "GPU, more than 10 GiB leaves room for); lower train.micro_batch_size (1), or add GPUs")


def test_the_engine_table_names_a_world_size_the_batch_cannot_split_over():
    cfg = load_config("configs/llama-tiny.yaml", [])
    assert plan_table(cfg, 8).splitlines()[-1] == (
        "pick: none on 8 devices: train.batch_size: 4 is not a multiple of train.micro_batch_size (2) x 8 "
        "data-parallel replica(s) (world size 8); expected a multiple of 16, or a number of replicas that divides "
        "its 2 micro-batches")
    assert plan_table(cfg, 2).splitlines()[-1].startswith("pick: ddp")


def test_a_million_nodes_plan_quickly(capsys):
    assert train_main(["--config", "configs/llama-tiny.yaml", "--dry-run", "--nodes", "1000000"]) == 0
    out = capsys.readouterr().out
    assert "pick: none on 8000000 devices: train.batch_size: 4" in out
    assert "pick: no layout of 8000000 GPUs can train this config: the batch split rules out 2" in out


def test_a_hundred_million_blocks_plan_quickly():
    # the deepest pipeline looked at is the batch's micro-batches, not the model's blocks; a process with a timeout,
    # so that a regression fails here instead of hanging the suite
    done = subprocess.run([sys.executable, "-m", "lm.train", "--config", "configs/llama-tiny.yaml", "--dry-run",
                           "--nodes", "2", "--model.n_layer=100000000"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "this config trains on at most 4 GPUs (tp 2 x pp 1 x dp 2)" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "argument --nodes: expected an integer in [1, 16777216], got '0'"),
    (["--nodes", "16777217"], "argument --nodes: expected an integer in [1, 16777216], got '16777217'"),
    (["--nodes", "inf"], "argument --nodes: expected an integer in [1, 16777216], got 'inf'"),
    (["--gpus-per-node", "4096"], "argument --gpus-per-node: expected an integer in [1, 1024], got '4096'"),
    (["--nproc", "0"], "argument --nproc: expected an integer in [1, 16777216], got '0'"),
    (["--gpu-gib", "0"], "argument --gpu-gib: expected a number in [1, 1e+06], got '0'"),
    (["--gpu-gib", "-80"], "argument --gpu-gib: expected a number in [1, 1e+06], got '-80'"),
    (["--gpu-gib", "inf"], "argument --gpu-gib: expected a number in [1, 1e+06], got 'inf'"),
    (["--gpu-gib", "nan"], "argument --gpu-gib: expected a number in [1, 1e+06], got 'nan'"),
    (["--nodes", "4000000"], "error: --nodes 4000000 x --gpus-per-node 8 is 32000000 GPUs; a dry run plans for at "
     "most 16777216"),
])
def test_the_dry_runs_numbers_out_of_range_are_one_error_line(args, message, capsys):
    try:
        code = run(train_main, ["--config", "configs/llama-tiny.yaml", "--dry-run", *args])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err.strip().splitlines()[-1], err


def test_the_dry_run_refuses_an_objective_the_run_would_refuse(capsys):
    # it planned an encoder-decoder whose windows need more sentinels than the model has; the run refused it
    assert run(train_main, ["--config", "configs/demo-encdec.yaml", "--model.n_sentinels=5", "--dry-run"]) == 2
    assert capsys.readouterr().err == ("error: model.n_sentinels: 5 sentinels do not fit data.seq_len=128: its windows "
                                       "of 129 tokens have 6 noise spans and need 7 sentinels (6 spans + 1 end "
                                       "marker)\n")


def test_tensor_parallel_traffic_is_megatrons_four_collectives_a_block():
    # each block runs 2 all-reduces forward and 2 backward of its (b, s, h) activations in bf16; a ring all-reduce
    # sends 2 (tp - 1) / tp of it, so 8 * b*s*h*2 * (tp - 1) / tp bytes a block and micro-batch
    cfg = load_config("configs/llama3-8b.yaml", [])
    b, s, h = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.d_model
    for tp in (2, 4, 8):
        row = estimate_layout(cfg, tp, 1, 8 // tp if tp < 8 else 1, 0)
        assert row.tp_bytes == 8 * b * s * h * 2 * (tp - 1) // tp * cfg.model.n_layer * row.micro_batches, tp
    assert estimate_layout(cfg, 1, 1, 8, 0).tp_bytes == 0


def test_a_pipeline_with_fewer_micro_batches_than_stages_is_ruled_out():
    cfg = load_config(None, ["--model.n_layer=4", "--model.tie_embeddings=false", "--train.batch_size=3",
                             "--train.micro_batch_size=1"])
    out = _ruled_out(cfg, 1, 4, 1)  # 3 micro-batches for 4 stages
    assert out is not None and out.constraint == "batch split"
    assert "a step has 3 per replica over 1 replicas" in out.reason
    assert _ruled_out(cfg, 1, 3, 1) is None  # 3 for 3


def _row(gib: float) -> LayoutEstimate:
    return LayoutEstimate(1, 1, 8, 0, 1, int(gib * GIB), 0, 0, 0, 0, 0)


def test_the_fits_column_says_what_the_pick_uses_margin_and_context_included():
    tight, roomy = _row(9.5), _row(5.0)  # 9.5 GiB plus 10% and the CUDA context exceed 10 GiB
    lines = _rows_text("t", [tight, roomy], 10.0)
    assert [line.split()[-1] for line in lines[3:5]] == ["no", "yes"]
    assert pick_layout([tight], 10.0) is None and pick_layout([tight, roomy], 10.0) is roomy


TINY = ["--config", "configs/llama-tiny.yaml"]


def test_gpus_per_node_alone_plans_one_node(capsys):
    assert train_main([*TINY, "--dry-run", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "layouts on 1 node(s) x 2 GPUs = 2" in out
    assert "world size 2," in out


def test_gpus_per_node_without_a_dry_run_is_refused(capsys):
    assert run(train_main, [*TINY, "--gpus-per-node", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --gpus-per-node: only --dry-run takes it; torchrun sets the world size of a real run")


def test_the_world_size_defaults_to_one(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert train_main([*TINY, "--dry-run"]) == 0
    assert "world size 1," in capsys.readouterr().out


@pytest.mark.parametrize("value", ["two", "0", ""])
def test_a_world_size_that_is_no_count_of_devices_is_one_error_line(value, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", value)
    assert run(train_main, [*TINY, "--dry-run"]) == 2
    assert capsys.readouterr().err == (f"error: --nproc: not given, and WORLD_SIZE={value!r} is not an integer from 1 "
                                       "to 16777216\n")


def test_the_configured_line_names_deepspeeds_stage_alone(capsys):
    dry_run(load_config("configs/llama-tiny.yaml", ["--parallel.engine=deepspeed", "--parallel.zero_stage=2"]), 2,
            80.0)
    assert "configured: parallel.engine=deepspeed zero_stage=2 cpu_offload=False" in capsys.readouterr().out
    dry_run(load_config("configs/llama-tiny.yaml", ["--parallel.engine=ddp"]), 2, 80.0)
    out = capsys.readouterr().out
    assert "configured: parallel.engine=ddp cpu_offload=False" in out and "zero_stage" not in out


def test_exactly_the_most_devices_are_planned(capsys):
    # 2,097,152 nodes x 8 GPUs = 16,777,216, the limit itself; one GPU more is refused
    assert train_main([*TINY, "--dry-run", "--nodes", "2097152"]) == 0
    assert "pick: no layout of 16777216 GPUs can train this config" in capsys.readouterr().out
    assert run(train_main, [*TINY, "--dry-run", "--nodes", "2097153"]) == 2


def test_a_pick_that_must_offload_and_recompute_names_both_flags_its_gpu_and_its_host_memory():
    # llama3-70b on 8 GPUs of 40 GiB: only the offloaded layout with every block recomputed fits
    cfg = load_config("configs/llama3-70b.yaml", [])
    lines = layout_table(cfg, 1, 8, 40.0).splitlines()
    row = estimate_layout(cfg, 1, 1, 8, 1, cpu_offload=True)
    assert lines[-4].split() == ["tp", "1", "x", "pp", "1", "x", "dp", "8", "1", "yes", "64",
                                 f"{row.state / GIB:.2f}", f"{row.gathered / GIB:.2f}",
                                 f"{row.activations / GIB:.2f}", "34.46", "0.0", f"{row.fsdp_bytes / 1e9:.1f}",
                                 "0.0", "0.0", "yes"]
    assert lines[-2] == (f"pick: tp 1 x pp 1 x dp 8, activation checkpointing every block (34.46 GiB per GPU, "
                         f"{row.state / GIB:.2f} GiB host memory per process): --parallel.engine=fsdp "
                         "--parallel.activation_checkpointing=1 --parallel.cpu_offload=true")
    assert f"{row.state / GIB:.2f}" == "130.56"  # the host holds the state, not the GPU's 34.46 GiB
    # the rows that keep the state on the GPU say so
    assert [line.split()[9] for line in lines[3:-4]] == ["no"] * 20


def test_the_divisibility_reasons_name_three_cases_the_count_of_the_rest_and_each_axis_first_reason_in_axis_order():
    cfg = load_config("configs/llama-tiny.yaml", [])
    line = layout_table(cfg, 1_000_000, 8, 80.0).splitlines()[-1]
    assert ("; the divisibility rules out 236 (tp 1 x pp 2 x dp 4000000, tp 1 x pp 4 x dp 2000000, tp 1 x pp 5 x dp "
            "1600000 and 233 more: parallel.pp=2: the token embedding sits on the first pipeline stage and the output "
            "head on the last, so they cannot share one weight; set model.tie_embeddings=false; parallel.tp=4: 4 "
            "tensor-parallel ranks are more than its 2 key/value heads (model.n_kv_head); a tp that splits this "
            "model: 1, 2); ") in line


def test_the_context_parallel_column_shows_the_context_parallel_traffic():
    cfg = load_config("configs/llama3-8b.yaml", ["--parallel.engine=fsdp", "--parallel.cp=2"])
    lines = configured_table(cfg, 16, 80.0).splitlines()
    row = estimate_layout(cfg, 1, 1, 8, 0, cp=2)
    assert lines[1].split()[-7:-3] == ["ep", "GB", "cp", "GB"]
    assert lines[3].split()[-3:] == ["0.0", f"{row.cp_bytes / 1e9:.1f}", "yes"]
    assert f"{row.cp_bytes / 1e9:.1f}" == "73.0"
