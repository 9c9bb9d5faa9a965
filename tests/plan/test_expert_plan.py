"""The planner under expert parallelism (parallel.ep): a mixture's experts split over ep ranks, then sharded by FSDP2
over the dp / ep ranks holding the same ones, in the memory plan and the layouts of `--dry-run --nodes`."""

import dataclasses

import pytest

from lm.config import load_config
from lm.data.config import DataConfig
from lm.errors import ConfigError
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.family import FAMILY
from lm.plan.counts import counts, num_params, root_params, unit_params
from lm.plan.layout_table import layout_table
from lm.plan.layouts import estimate_layout, layout_rows, pick_layout
from lm.plan.memory import GIB, estimate_memory
from lm.plan.memory_table import plan_rows

# 2 blocks of width 32 on rotary positions, each a mixture of 4 gelu experts 16 wide, 2 a token; windows of 16 tokens,
# global batches of 8, micro-batches of 2; float32 on the CPU
MOE = ["--model.n_layer=2", "--model.n_head=4", "--model.d_model=32", "--model.block_size=16", "--model.mlp=gelu",
       "--model.pos=rope", "--model.norm=rmsnorm", "--model.bias=false", "--model.n_experts=4",
       "--model.experts_per_token=2", "--model.expert_d_ff=16", "--model.moe_first_dense=0", "--data.seq_len=16",
       "--train.batch_size=8", "--train.micro_batch_size=2", "--train.device=cpu", "--parallel.engine=fsdp"]
EXPERTS = 4 * 2 * 32 * 16
"""A block's routed experts: 4 of w_in (32, 16) and w_out (16, 32)"""
BLOCK = 4 * 32 * 32 + 2 * 32 + 32 * 4 + EXPERTS
"""A block: attention (q, k, v, o), 2 RMSNorm gains, the router (32 -> 4), the experts"""


def moe(*flags: str):
    return load_config(None, [*MOE, *flags])


def test_the_counts_find_the_routed_experts():
    n = counts(moe().model)
    assert (n.experts, n.units, n.expert_layers, n.n_experts) == (2 * EXPERTS, ((BLOCK, EXPERTS),), 2, 4)
    assert BLOCK == 8_384
    # a dense first block (its gelu MLP 32 -> 128 -> 32) is the largest unit, and under ep it stays whole
    first_dense = moe("--model.moe_first_dense=1").model
    dense_block = 4 * 32 * 32 + 2 * 32 + 2 * 32 * 128
    assert counts(first_dense).units == ((dense_block, 0), (BLOCK, EXPERTS))
    assert unit_params(first_dense, ep=2) == unit_params(first_dense) == dense_block
    assert unit_params(moe().model, ep=2) == BLOCK - EXPERTS // 2


def test_fsdp_under_ep_shards_the_experts_over_the_ranks_sharing_them_and_gathers_a_share():
    cfg = moe("--parallel.ep=2")
    total, root = num_params(cfg.model), root_params(cfg.model)
    split, whole = estimate_memory(cfg, 4), estimate_memory(cfg, 4, ep=1)
    assert (split.ep, split.label, whole.label) == (2, "fsdp x ep 2", "fsdp")
    # each ep rank holds 2 of each block's 4 experts (2 x 2,048 parameters), FSDP2 halves them over the 2 ranks
    # holding them
    dense = -(-(total - 2 * EXPERTS) // 4)
    assert split.parameters == split.gradients == 4 * (dense + 2048) and split.optimizer == 8 * (dense + 2048)
    assert whole.parameters == 4 * -(-total // 4)
    # a gathered block (two at once) holds its ep rank's 2 experts, not all 4: float32 weight and gradient, 8 bytes
    assert split.gathered == (root + 2 * (BLOCK - EXPERTS // 2)) * 8
    assert whole.gathered - split.gathered == 2 * (EXPERTS // 2) * 8
    assert split.activations == whole.activations


@pytest.mark.parametrize("flags, world, message", [
    (["--parallel.ep=4"], 6, "parallel.ep=4 does not divide the 6 data-parallel rank(s) planned for"),
    ([], 4, "parallel.ep=3: its 4 experts (model.n_experts) do not split over 3 expert-parallel ranks"),
])
def test_an_ep_the_plan_cannot_take_is_one_error(flags, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        estimate_memory(moe(*flags), world, ep=None if flags else 3)


def test_a_layout_under_ep_counts_the_all_to_all_and_the_experts_share():
    cfg = moe()
    root = root_params(cfg.model)
    row = estimate_layout(cfg, 1, 1, 4, 0, ep=2)
    assert (row.ep, row.label, row.micro_batches) == (2, "tp 1 x pp 1 x dp 4 (ep 2)", 1)
    # 2 x 16 tokens, each to its 2 experts and back, forward and backward: 4 x 32 x 2 rows of 32 fp32 values, half
    # of them to the other ep rank; 2 mixture layers, one micro-batch
    assert row.ep_bytes == 4 * 32 * 2 * 32 * 4 // 2 * 2 == 32_768
    dense = 2 * (BLOCK - EXPERTS) + root
    assert row.state == 16 * (-(-dense // 4) + 2 * EXPERTS // 2 // 2)
    assert row.gathered == (root + 2 * (BLOCK - EXPERTS + EXPERTS // 2)) * 8
    # FSDP2, 4 bytes a parameter for each micro-batch's two 16-bit all-gathers and 4 for the gradients' reduce-scatter:
    # the dense weights over 4 ranks, an ep rank's 4,096 experts over its 2 sharing ranks
    assert row.fsdp_bytes == int(dense * 8 * 3 / 4) + 2 * EXPERTS // 2 * 8 // 2
    assert estimate_layout(cfg, 1, 1, 4, 0).ep_bytes == 0
    # under tp the mixture runs whole on every tensor-parallel rank: its experts are not divided by tp
    tp2 = estimate_layout(cfg, 2, 1, 2, 0)
    assert tp2.state == 16 * (-(-int(dense / 2) // 2) + 2 * EXPERTS // 2)


def test_without_tp_a_layout_under_ep_holds_the_fsdp_engine_estimate():
    cfg = moe("--parallel.ep=2")
    for every in (0, 1):
        layout = estimate_layout(cfg, 1, 1, 4, every, ep=2)
        assert layout.total == estimate_memory(cfg, 4, activation_checkpointing=every).total


def test_the_layouts_try_every_ep_dividing_the_experts_and_dp_and_pick_one_when_only_it_fits():
    cfg = moe()
    rows = layout_rows(cfg, 1, 4)
    # tp 1, 2 or 4 (no pipeline: a mixture takes none), and every ep dividing both dp and the 4 experts
    assert {(r.tp, r.pp, r.dp, r.ep) for r in rows} == {(1, 1, 4, 1), (1, 1, 4, 2), (1, 1, 4, 4), (2, 1, 2, 1),
                                                        (2, 1, 2, 2), (4, 1, 1, 1)}
    # a device just large enough for ep 2 without recomputation: ep 1's larger gathered blocks do not fit; ep 4
    # fits, but sends more over 2 micro-batches: the all-gathers of ep 2's 4,096 experts it saves (12 bytes each
    # over 2 ranks) are less than the all-to-all it adds (3/4 of 2 x 65,536 bytes against 1/2)
    cfg = moe("--train.batch_size=16")
    ep2, ep4 = estimate_layout(cfg, 1, 1, 4, 0, ep=2), estimate_layout(cfg, 1, 1, 4, 0, ep=4)
    assert (ep4.fsdp_bytes + ep4.ep_bytes) - (ep2.fsdp_bytes + ep2.ep_bytes) == -4096 * 12 // 2 + 98_304 - 65_536
    device_gib = (ep2.total * 1.1 + GIB) / GIB
    assert estimate_layout(cfg, 1, 1, 4, 0).total > ep2.total > ep4.total
    assert pick_layout(layout_rows(cfg, 1, 4), device_gib) == ep2
    table = layout_table(cfg, 1, 4, device_gib)
    assert "pick: tp 1 x pp 1 x dp 4 (ep 2), activation checkpointing off" in table
    assert table.splitlines()[-2].endswith("--parallel.engine=fsdp --parallel.ep=2")


def test_a_mixture_block_keeps_each_tokens_k_copies_and_its_router_scores():
    """Beside the hidden units of k routed experts, a mixture's block keeps each token's k copies and its float32
    router probabilities: at a fixed width, 4 bytes a token for every expert in every block."""
    # the routed experts (2 x 64 units) wider than a dense block, so the mixture is the larger estimate
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=32, block_size=16, vocab_size=96, n_experts=4, experts_per_token=2,
                    expert_d_ff=64, d_ff=16)
    tokens = 3 * 16  # micro-batches of 3 windows of 16

    def estimate(n_experts: int) -> int:
        wider = dataclasses.replace(cfg, n_experts=n_experts)
        return FAMILY.estimates.activation_bytes(wider, DataConfig(seq_len=16), 3, 2, 2, 0, True)[0]

    assert estimate(12) - estimate(4) == cfg.n_layer * 4 * (12 - 4) * tokens


def test_the_engine_table_of_an_ep_config_splits_the_experts_under_fsdp_alone():
    rows = plan_rows(moe("--parallel.ep=2"), 4)
    assert {(r.engine, r.ep) for r in rows} == {("ddp", 1), ("fsdp", 2), ("deepspeed", 1)}


@pytest.mark.parametrize("engine, stage", [("ddp", None), ("deepspeed", 2)])
def test_ep_on_another_engine_than_fsdp_is_refused(engine, stage):
    with pytest.raises(ValueError, match=f"ep 2 goes with engine fsdp only, got {engine}"):
        estimate_memory(moe(), 4, engine, stage, ep=2)


def test_an_ep_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"parallel.ep: must be >= 1 \(1 = no expert parallelism\), got 0"):
        estimate_memory(moe(), 4, ep=0)


MIXTURE_OF_FOUR = ["--model.n_layer=2", "--model.n_head=4", "--model.d_model=32", "--model.block_size=16",
                   "--model.mlp=gelu", "--model.pos=rope", "--model.norm=rmsnorm", "--model.bias=false",
                   "--model.n_experts=4", "--model.experts_per_token=2", "--model.expert_d_ff=16",
                   "--model.moe_first_dense=0", "--data.seq_len=16", "--train.batch_size=8",
                   "--train.micro_batch_size=2", "--train.device=cpu", "--parallel.engine=fsdp"]
WHY_EP = (", then of the expert-parallel ranks the number that sends least (FSDP2's all-gathers of the experts "
          "against the all-to-alls of the tokens)")


def test_the_why_line_names_the_expert_parallel_rule_only_for_tables_with_expert_parallel_rows():
    cfg = load_config(None, MIXTURE_OF_FOUR)
    table = layout_table(cfg, 1, 2, 80.0).splitlines()  # ep 1 or 2
    assert any(line.startswith("tp 1 x pp 1 x dp 2 (ep 2)") for line in table)
    assert table[-1].startswith("why: of the layouts that fit") and table[-1].endswith(
        "then the fewest pipeline stages (idle time at each step's start and end)" + WHY_EP)
    dense = layout_table(load_config("configs/llama-tiny.yaml", []), 1, 2, 80.0).splitlines()
    assert dense[-1].endswith("(idle time at each step's start and end)")
