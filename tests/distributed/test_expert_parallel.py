"""Expert parallelism (parallel.ep) on real 4-process gloo groups: a mixture of experts trained with its experts split
over ep ranks (with FSDP2, alone, and with tensor parallelism) logs the losses one process logs on the same global
batches, and its checkpoint resumes under one process and under another ep, and consolidates to the whole experts."""

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from lm.cli import run
from lm.distributed.torch_engine import by_mesh
from tests.distributed.test_engines import engine_and_loss, resume_copy, train
from tests.distributed.test_engines_moe import terms
from tests.workers import pool

# every test here trains on gloo groups of 4 processes: the full tier only
pytestmark = pytest.mark.process

MOE = ["--parallel.engine=fsdp", "--model.n_head=4", "--model.n_experts=8", "--model.experts_per_token=2",
       "--model.expert_d_ff=32", "--model.n_shared_experts=1", "--train.steps=6", "--checkpoint.every=3"]
"""A 2-layer mixture, d_model 32, 8 experts top-2 and a shared one, for 6 steps of global batches of 8 windows
(validated and saved at steps 3 and 6): 2 windows per micro-batch on every layout, so every router measures its
balance over the same tokens. 6 steps, not 10: a step under tp costs a second on this machine, and a checkpoint
resumed at step 3 still continues for 3 steps."""
STEPS = list(range(1, 7))
RESUMED = [4, 5, 6]
SAME_BATCH_REL = 1e-4
"""A step of the split run against one process: the all-to-all and FSDP2 sum in another order than one process"""
GRAD_NORM_REL = 2e-5
"""The first step's gradient norm against one process's (a 4-process fsdp run without ep: 5e-6 off)"""
RESUME_REL = 1e-5
"""A resumed step against the same step of the uninterrupted run"""
LAYOUTS = {"ep2": ["--parallel.ep=2"], "ep4": ["--parallel.ep=4"], "ep2_tp2": ["--parallel.ep=2", "--parallel.tp=2"],
           "hsdp2_ep2": ["--parallel.dp_replicate=2", "--parallel.ep=2"], "tp2": ["--parallel.tp=2"]}
EXPERT_SHARE = {"ep2": 1 / 4, "ep4": 1 / 4, "ep2_tp2": 1 / 2, "hsdp2_ep2": 1 / 2}
"""The share of the experts' parameters rank 0 holds: 1/ep of the experts, sharded by FSDP2 over the rest of dp_shard
(HSDP's replicas hold the same; tp2: no expert parallelism, the mixture whole on both tensor-parallel ranks, as under
ep2_tp2)"""


def expert_share(out: Path) -> float:
    """The share of the experts' parameters rank 0 holds, as the run in `out` logged it."""
    found = re.search(r"expert parallelism: \d+ ranks split .* rank 0 holds ([\d,]+) of their ([\d,]+) parameters",
                      out.with_suffix(".log").read_text())
    assert found, f"no expert-parallel layout in {out.with_suffix('.log')}"
    held, total = (int(g.replace(",", "")) for g in found.groups())
    return held / total


@pytest.fixture(scope="module")
def one_process(tiny_data_dir, tmp_path_factory) -> Path:
    """The mixture on one process, which every layout's 4 processes must log alike."""
    out = tmp_path_factory.mktemp("one") / "run"
    train(1, out, tiny_data_dir, *MOE)
    return out


@pytest.fixture(scope="module")
def ep2(tiny_data_dir, tmp_path_factory) -> Path:
    """The mixture with ep=2 x FSDP2 on 4 processes: compared with one process, and resumed from its step 3."""
    out = tmp_path_factory.mktemp("ep2") / "run"
    train(4, out, tiny_data_dir, *MOE, *LAYOUTS["ep2"])
    return out


def losses(out: Path) -> dict[int, float]:
    return {step: row["train/loss"] for step, row in terms(out).items()}


def grad_norm(out: Path) -> float:
    return terms(out)[1]["train/grad_norm"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_split_mixture_logs_the_losses_of_one_process(layout, one_process, ep2, tiny_data_dir, tmp_path):
    out = ep2 if layout == "ep2" else tmp_path / layout
    if layout != "ep2":
        train(4, out, tiny_data_dir, *MOE, *LAYOUTS[layout])
    split, one = losses(out), losses(one_process)
    assert sorted(split) == sorted(one) == STEPS
    for step in one:
        assert split[step] == pytest.approx(one[step], rel=SAME_BATCH_REL), (layout, step)
    # AdamW hardly sees a gradient's scale, so the losses would not show experts' gradients divided wrongly; the
    # first step's gradient norm (the same weights and batch) does
    assert grad_norm(out) == pytest.approx(grad_norm(one_process), rel=GRAD_NORM_REL), layout
    assert split[STEPS[-1]] < split[1] - 0.1
    if layout in EXPERT_SHARE:
        assert expert_share(out) == pytest.approx(EXPERT_SHARE[layout])


def test_an_expert_parallel_checkpoint_resumes_under_one_process_and_another_ep(ep2, tiny_data_dir, tmp_path):
    uninterrupted = losses(ep2)
    for name, nproc, flags in (("one", 1, []), ("ep4", 4, LAYOUTS["ep4"]), ("fsdp4", 4, [])):
        resumed = train(nproc, resume_copy(ep2, tmp_path / name, step=3), tiny_data_dir, *MOE, *flags)
        assert sorted(resumed) == RESUMED
        for step in resumed:
            assert resumed[step] == pytest.approx(uninterrupted[step], rel=RESUME_REL), (name, step)


def test_an_expert_parallel_checkpoint_consolidates_to_every_expert(ep2, one_process, tmp_path):
    from lm.consolidate import main as consolidate

    weights = {}
    for name, run_dir in (("ep2", ep2), ("one", one_process)):
        out = tmp_path / f"{name}.safetensors"
        assert run(consolidate, ["--checkpoint", str(run_dir / "checkpoints" / "step_00000003"), str(out)]) == 0
        weights[name] = load_file(out)
    experts = [k for k in weights["ep2"] if k.endswith("experts.w_in")]
    assert len(experts) == 2 and weights["ep2"][experts[0]].shape == (8, 32, 32)
    assert weights["ep2"].keys() == weights["one"].keys()
    for key, tensor in weights["ep2"].items():  # the same 3 steps: equal but for AdamW's rounding of tiny gradients
        assert tensor.shape == weights["one"][key].shape and (tensor - weights["one"][key]).abs().max() < 1e-3, key


def dispatch_against_whole(counts_by_rank: list[list[int]]) -> list[float]:
    """In each rank of a 2-rank pool: 4 experts split over the 2 ranks and the same experts whole, fed this rank's
    rows (`counts_by_rank[rank]` of them for each expert); the largest differences of the outputs, of the rows'
    gradients and of this rank's experts' weight gradients (the whole experts' summed over the ranks)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lm.distributed.expert_parallel import apply_expert_parallel
    from lm.models.gpt.config import GPTConfig
    from lm.models.gpt.moe import Experts

    rank = dist.get_rank()
    torch.manual_seed(0)
    whole = Experts(GPTConfig(d_model=16, n_head=2, mlp="swiglu"), 4, 8)
    whole.draw_(0.2, 0.2)
    split = copy.deepcopy(whole)
    apply_expert_parallel([split], init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    counts = torch.tensor(counts_by_rank[rank])
    torch.manual_seed(1 + rank)
    rows = torch.randn(int(counts.sum()), 16)  # (N, C), sorted by expert
    upstream = torch.randn(rows.shape)
    outputs, grads = [], []
    for experts in (split, whole):
        x = rows.clone().requires_grad_()
        y = experts(x, counts)
        (y * upstream).sum().backward()
        outputs.append(y.detach())
        grads.append(x.grad)
    diffs = [(outputs[0] - outputs[1]).abs().max().item() if rows.numel() else 0.0,
             (grads[0] - grads[1]).abs().max().item() if rows.numel() else 0.0]
    for name, param in whole.named_parameters():
        dist.all_reduce(param.grad)  # (4, ...) what all ranks' rows give each expert
        local = getattr(split, name).grad.to_local()  # (2, ...) this rank's experts
        diffs.append((local - param.grad[2 * rank:2 * rank + 2]).abs().max().item())
    return diffs


@pytest.mark.parametrize("counts", [[[2, 2, 1, 0], [3, 1, 2, 4]], [[6, 4, 0, 0], [0, 3, 0, 0]]],
                         ids=["uneven", "one rank idle"])
def test_dispatch_computes_what_the_whole_experts_compute(counts):
    # "uneven": rank 0 receives 2 + 2 rows from itself and 3 + 1 from rank 1 for its experts 0 and 1, so grouping
    # them by expert is a permutation that is not its own inverse (a combine that forgot to invert it would fail);
    # "one rank idle": every row goes to rank 0's experts (a collapsed router), so rank 1 computes none
    for rank, reply in enumerate(pool(2).run(dispatch_against_whole, counts)):
        assert max(reply["value"]) < 1e-5, (rank, reply["value"])


SPLIT_MOE = ["--parallel.engine=fsdp", "--parallel.ep=2", "--model.n_layer=2", "--model.n_head=4",
             "--model.d_model=32", "--model.block_size=16", "--model.n_experts=4", "--model.experts_per_token=2",
             "--model.expert_d_ff=32", "--data.seq_len=16", "--train.device=cpu", "--train.batch_size=4",
             "--train.micro_batch_size=2"]


def _norms_around_clipping(max_norm: float) -> tuple[float, float, int]:
    """A pool's job: one micro-batch's gradients under ep=2, their global norm before and after clipping to
    `max_norm`, and how many device meshes the gradients live on."""
    engine, loss, cfg = engine_and_loss(SPLIT_MOE)
    x = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    with engine.micro_batch(last=True):
        engine.backward(loss(engine.model, engine.run, [x[:, :-1], x[:, 1:]]).optimized)
    grads = [p.grad for p in engine.model.parameters() if p.grad is not None]
    before = engine.clip_grad_norm(max_norm).item()
    after = engine.grad_norm(grads).item()
    return before, after, len(by_mesh(grads))


@pytest.mark.process
def test_clipping_scales_the_experts_gradients_too():
    # the experts' gradients live on a mesh of their own: every mesh's gradients are scaled, not the first's only
    for reply in pool(2).run(_norms_around_clipping, 1e-3):
        before, after, meshes = reply["value"]
        assert meshes == 2 and before > 1e-2
        assert after == pytest.approx(1e-3, rel=1e-4)
