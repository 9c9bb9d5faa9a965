"""Tensor parallelism (parallel.tp) composed with FSDP2 on real gloo groups: the same losses as one process on
the same global batches, checkpoints that resume under other layouts, and the layouts refused before a run."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from lm import consolidate
from lm.cli import run as run_tool
from lm.config import load_config
from lm.errors import ConfigError
from lm.models.family import TPStyle
from tests.distributed.test_engines import held_share, resume_copy, train, val_losses
from tests.distributed.test_pipeline import MICRO4, one_process_run
from tests.workers import pool

# the Llama options with grouped-query attention: 4 query heads, 2 key/value heads, an untied head
LLAMA = ["--parallel.engine=fsdp", "--model.n_head=4", "--model.n_kv_head=2", "--model.pos=rope",
         "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.bias=false", "--model.tie_embeddings=false",
         "--train.steps=10", "--checkpoint.every=5", "--train.eval_every=5"]
# Sums over the tensor-parallel ranks add the same numbers in another order: float32 rounding, ~1e-7 here.
SAME_REL = 1e-5


def assert_same(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=SAME_REL), (step, got, want)


@pytest.mark.process
def test_tp2_by_fsdp2_trains_like_one_process_and_resumes_under_fsdp4_and_one_process(tiny_data_dir, tmp_path,
                                                                                      tmp_path_factory):
    one_dir, one = one_process_run(tiny_data_dir, tmp_path_factory, *LLAMA)
    # one micro-batch a rank; test_expert_parallel's tp2 layout accumulates 2 under tp2 x fsdp2
    two_d = train(4, tmp_path / "tp2dp2", tiny_data_dir, *LLAMA, "--parallel.tp=2", *MICRO4)
    assert sorted(one) == sorted(two_d) == list(range(1, 11))
    assert_same(two_d, one, range(1, 11))
    assert held_share(tmp_path / "tp2dp2") == pytest.approx(1 / 4, abs=0.02)  # split by tp, then sharded by dp
    state = json.loads((tmp_path / "tp2dp2/checkpoints/step_00000005/state.json").read_text())
    assert state["world_size"] == 4
    # the step-5 checkpoint of the 2-D run, resumed with tensor parallelism off on 4 ranks and on 1
    for nproc in (4, 1):
        run = resume_copy(tmp_path / "tp2dp2", tmp_path / f"resumed{nproc}", step=5)
        resumed = train(nproc, run, tiny_data_dir, *LLAMA)
        assert sorted(resumed) == [6, 7, 8, 9, 10]
        assert_same(resumed, one, range(6, 11))
    # consolidated, the 2-D run's weights are the one-process run's up to rounding. AdamW divides each gradient by
    # its own size, so where a gradient is near zero (an embedding row seen once) rounding moves the update by a
    # share of the learning rate: a few of the 1.6M embedding weights differ by ~1e-4, the rest by < 1e-5
    weights = {}
    for run, run_dir in (("one", one_dir), ("tp2dp2", tmp_path / "tp2dp2")):
        out = tmp_path / f"{run}.safetensors"
        assert run_tool(consolidate.main, [f"--checkpoint={run_dir}", str(out)]) == 0
        weights[run] = load_file(out)
    assert sorted(weights["one"]) == sorted(weights["tp2dp2"])
    for name, tensor in weights["one"].items():
        diff = (weights["tp2dp2"][name] - tensor).abs()
        assert diff.max() < 1e-3 and (diff > 1e-5).sum() <= 10, (name, diff.max(), (diff > 1e-5).sum())


@pytest.mark.process
def test_a_one_process_checkpoint_resumes_with_tensor_parallelism(tiny_data_dir, tmp_path, tmp_path_factory):
    one_dir, one = one_process_run(tiny_data_dir, tmp_path_factory, *LLAMA)
    run = resume_copy(one_dir, tmp_path / "tp2", step=5)
    assert_same(train(2, run, tiny_data_dir, *LLAMA, "--parallel.tp=2", *MICRO4), one, range(6, 11))


# each case: a set of model options and training features under tp=2 on 2 ranks, against 1 process
CASES = {
    # learned positions (replicated table), a tied head, LayerNorm with biases, GELU; recomputed blocks; z-loss
    "gpt2+checkpointing+z_loss": ["--parallel.activation_checkpointing=1", "--optim.z_loss=1e-4"],
    # the project's modern recipe: QK-norm (on each rank's heads), ReLU², a logit soft-cap; Muon; packed documents
    "modern+muon+document_mask": ["--model.pos=rope", "--model.norm=rmsnorm", "--model.mlp=relu2",
                                  "--model.qk_norm=true", "--model.logit_softcap=15", "--model.bias=false",
                                  "--optim.name=muon", "--data.document_mask=true"],
    # the original transformer's post-norm blocks (no final norm) with rotary positions, per-block torch.compile:
    # a block compiled with the sequence's cut in its graph had passed back only this rank's slice of the
    # embedding's gradient
    "post_norm+rope+compile": ["--model.norm_position=post", "--model.pos=rope", "--train.compile=true"],
}


@pytest.mark.process
@pytest.mark.parametrize("case", CASES)
def test_tp2_matches_one_process(case, tiny_data_dir, tmp_path, tmp_path_factory):
    flags = ["--parallel.engine=fsdp", "--model.n_head=4", "--train.steps=4", *CASES[case]]
    # against the eager model: compiled and eager agree to rounding (tests/training/test_trainer.py), and a cold
    # compile on one process more would double the case's time
    # micro-batches of 4 on one process too: validation reads train.eval_batches micro-batches
    one_dir, one = one_process_run(tiny_data_dir, tmp_path_factory,
                                   *[f for f in flags if f != "--train.compile=true"], *MICRO4)
    two = train(2, tmp_path / "tp2", tiny_data_dir, *flags, "--parallel.tp=2", *MICRO4)  # 2 micro-batches a step
    assert sorted(two) == [1, 2, 3, 4]
    assert_same(two, one, range(1, 5))
    want = val_losses(one_dir)
    assert want and sorted(val_losses(tmp_path / "tp2")) == sorted(want)
    assert_same(val_losses(tmp_path / "tp2"), want, sorted(want))


@pytest.mark.parametrize("flags, message", [
    (["--parallel.tp=2"], "parallel.tp: tensor parallelism composes with FSDP2 (parallel.engine=fsdp); the ddp engine"),
    (["--parallel.engine=deepspeed", "--parallel.zero_stage=2", "--parallel.tp=2"], "the deepspeed engine is "
     "data-parallel only"),
    (["--parallel.engine=fsdp", "--parallel.tp=4", "--model.n_head=4", "--model.n_kv_head=2"],
     "parallel.tp=4: 4 tensor-parallel ranks are more than its 2 key/value heads (model.n_kv_head); a tp that "
     "splits this model: 1, 2"),
    (["--parallel.engine=fsdp", "--parallel.tp=2", "--model.n_head=3", "--model.d_model=48"],
     "parallel.tp=2: its 3 query heads (model.n_head) do not split over 2 tensor-parallel ranks; a tp that splits "
     "this model: 1"),
    (["--parallel.engine=fsdp", "--parallel.tp=2", "--model.arch=lstm"], "parallel.tp=2: an LSTM (model.arch=lstm) "
     "has no tensor-parallel plan"),
    (["--parallel.engine=fsdp", "--parallel.tp=2", "--model.arch=encdec"], "has no tensor-parallel plan yet"),
    (["--parallel.engine=fsdp", "--parallel.tp=2", "--model.loss_chunk=8"], "model.loss_chunk cuts the positions"),
    (["--parallel.engine=fsdp", "--parallel.tp=2", "--data.seq_len=15"], "parallel.tp=2: data.seq_len=15 does not "
     "split into 2 sequence slices"),
    (["--parallel.tp=0"], "parallel.tp: must be >= 1"),
])
def test_a_layout_the_model_cannot_take_is_refused_by_the_config(flags, message):
    base = ["--model.block_size=32", "--data.seq_len=16", "--model.vocab_size=96"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, *flags])
    assert message in str(err.value)


@pytest.mark.process
def test_a_world_size_that_tp_does_not_divide_is_refused_before_any_process_group(tiny_data_dir, tmp_path):
    # what each of 3 ranks sees: WORLD_SIZE=3 and no store to join; the check comes before joining one
    env = {**os.environ, "WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "lm.train", "--parallel.engine=fsdp", "--parallel.tp=2", "--model.n_head=4",
         "--model.n_layer=1", "--model.d_model=32", "--model.block_size=32", "--data.seq_len=16",
         f"--data.dir={tiny_data_dir}", f"--train.out_dir={tmp_path / 'run'}", "--train.device=cpu"],
        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: parallel.tp=2 does not divide the world size 3 (ranks torchrun started); the product must be one "
        "of 1, 3, or start a multiple of 2 ranks")
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def apply_plans(plans: list[dict[str, str]]) -> list[str]:
    """A pool job: for each plan (module -> TPStyle name), a two-layer MLP on the meta device parallelised by it over
    a 1-D mesh of the pool's ranks; the error raised, or "ok"."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    from lm.distributed.tensor_parallel import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    for plan in plans:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        try:
            apply_tensor_parallel(model, {name: TPStyle[style] for name, style in plan.items()}, mesh)
            results.append("ok")
        except ValueError as err:
            results.append(str(err))
    return results


@pytest.mark.process
def test_a_plan_that_leaves_a_parameter_out_is_refused():
    # left out, FSDP2 would shard the module over another mesh than the rest, and the gradient norm would mix meshes
    results = [r["value"] for r in pool(2).run(apply_plans, [{"0": "COLUMNS"}, {"0": "COLUMNS", "2": "ROWS"}])]
    assert results == [["the tensor-parallel plan leaves 2.weight, 2.bias out; give its module a style", "ok"]] * 2
