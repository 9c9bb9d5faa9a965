"""Auxiliary-loss-free balancing of the mixtures of experts (model.router_bias_rate, `lm.models.gpt.moe`): the bias
chooses the experts and the unbiased scores weigh them, the update evens a skewed load, what is counted and when,
rate 0 leaves the model as it was, and a moved bias is refused by the Hugging Face export."""

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lm.errors import ExportError
from lm.hf.targets import hf_state_dict
from lm.models.gpt import hf_moe
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.family import FAMILY
from lm.models.gpt.model import GPT
from lm.models.gpt.moe import Router, balance_routers

MOE = GPTConfig(n_layer=2, n_head=4, d_model=32, block_size=16, vocab_size=96, n_experts=4, experts_per_token=2,
                expert_d_ff=16, router_bias_rate=0.01)
APPLIED = torch.tensor(1.0)  # a whole step: the learning rate at its peak


def same(t: torch.Tensor) -> torch.Tensor:
    """The reduce of one process."""
    return t


def built(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


@pytest.mark.parametrize("kind, renorm", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_the_bias_chooses_the_experts_and_the_unbiased_scores_weigh_them(kind, renorm):
    router = Router(dataclasses.replace(MOE, router=kind, router_renorm=renorm)).eval()
    torch.manual_seed(0)
    x = torch.randn(10, 32)
    router.score_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))  # large enough to put expert 3 in every top 2
    weights, chosen, logits, _ = router(x)
    scores = logits.softmax(-1) if kind == "softmax" else logits.sigmoid()
    assert (chosen == 3).any(-1).all()
    assert torch.equal(chosen, (scores + router.score_bias).topk(2).indices)
    picked = scores.gather(-1, chosen)
    want = picked if not renorm else picked / picked.sum(-1, keepdim=True)
    assert torch.equal(weights, want)
    assert router.routed is None  # an eval forward counts nothing


def test_the_update_evens_a_skewed_load():
    # one token in four prefers each expert a little, and every token prefers expert 0 by 1.0 more: top-1 sends
    # all 64 tokens to expert 0 until the biases make up that margin
    cfg = dataclasses.replace(MOE, experts_per_token=1, d_model=4, router_bias_rate=0.05)
    router = Router(cfg)
    x = torch.cat([torch.eye(4)] * 16)  # (64, 4): token t is one-hot at t % 4
    with torch.no_grad():
        router.gate.weight.copy_(0.5 * torch.eye(4))
        router.gate.weight[0] += 1.0  # expert 0's logit: 1.0 above the others' for every token
    loads = []
    for _ in range(40):
        router(x)
        loads.append(router.routed.clone())
        balance_routers(router, same, APPLIED)
        if len(loads) == 1:  # all 64 on expert 0: its bias goes down by the rate, the others' up
            assert router.score_bias.tolist() == pytest.approx([-0.05, 0.05, 0.05, 0.05])
    assert loads[0].tolist() == [64, 0, 0, 0]
    assert loads[-1].tolist() == [16, 16, 16, 16]
    # once even, every bias stays where it stopped: sign(0) moves none
    assert torch.equal(loads[-2], loads[-1])
    assert router.routed is None
    # a skipped step moves nothing
    before = router.score_bias.clone()
    router.score_bias.add_(torch.tensor([0.5, 0, 0, 0]))
    router(x)
    balance_routers(router, same, torch.tensor(0.0))  # a skipped step
    assert torch.equal(router.score_bias, before + torch.tensor([0.5, 0, 0, 0]))


def test_what_a_training_step_counts():
    model = built(MOE).train()
    x, y = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    FAMILY.training.loss(model, model, [x, y])
    FAMILY.training.loss(model, model, [x, y])  # a second micro-batch of the same step adds its counts
    routers = [b.mlp.router for b in model.blocks]
    assert [r.routed.sum().item() for r in routers] == [2 * 2 * 16 * 2] * 2  # micro-batches x tokens x k
    assert torch.equal(routers[0].routed, 2 * model.blocks[0].mlp.stats.counts)
    counted = [r.routed.clone() for r in routers]
    FAMILY.training.after_step(model, same, APPLIED)
    for router, load in zip(routers, counted):
        want = 0.01 * torch.sign(load.double().mean() - load.double()).float()
        assert torch.equal(router.score_bias, want)
    # activation checkpointing recomputes a block in backward and counts its tokens again: every count of the
    # layer doubles, so sign(mean - load) and the update are unchanged
    block, h = model.blocks[0], torch.randn(2, 16, 32, requires_grad=True)
    block(h).sum().backward()
    plain = block.mlp.router.routed.clone()
    block.mlp.router.routed = None
    checkpoint(block, h, use_reentrant=False).sum().backward()
    assert torch.equal(block.mlp.router.routed, 2 * plain)
    # evaluation forwards count nothing
    model.eval()
    block.mlp.router.routed = None
    with torch.no_grad():
        model(x)
    assert block.mlp.router.routed is None


def test_the_bias_is_a_buffer_saved_with_the_weights_and_zeroed_by_init():
    model = built(MOE)
    biases = {name: t for name, t in model.state_dict().items() if name.endswith("score_bias")}
    assert sorted(biases) == ["blocks.0.mlp.router.score_bias", "blocks.1.mlp.router.score_bias"]
    assert not any(name.endswith("score_bias") for name, _ in model.named_parameters())
    with torch.device("meta"):
        meta = GPT(MOE)
    meta.to_empty(device="cpu")
    for block in meta.blocks:
        block.mlp.router.score_bias.fill_(7.0)  # what to_empty may leave
    torch.manual_seed(0)
    meta.init_weights()
    assert all(torch.equal(t, torch.zeros(4)) for t in (b.mlp.router.score_bias for b in meta.blocks))
    loaded = built(MOE, seed=1)
    model.blocks[1].mlp.router.score_bias.fill_(0.25)
    loaded.load_state_dict(model.state_dict())
    assert loaded.blocks[1].mlp.router.score_bias.tolist() == [0.25] * 4


def test_rate_0_leaves_the_model_as_it_was():
    plain = built(dataclasses.replace(MOE, router_bias_rate=0.0))
    assert not any("score_bias" in name for name in plain.state_dict())
    assert list(plain.buffers()) == []
    x, y = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    FAMILY.training.loss(plain, plain, [x, y])
    assert plain.blocks[0].mlp.router.routed is None
    FAMILY.training.after_step(plain, same, APPLIED)  # nothing to update, no collective


def test_a_moved_bias_is_refused_by_the_export_and_a_zero_bias_exports():
    cfg = dataclasses.replace(MOE, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    model = built(cfg)
    mixtral = hf_moe.TARGETS[0]
    exported = hf_state_dict(model, mixtral)
    assert not any("bias" in name for name in exported)
    assert exported.keys() == hf_state_dict(built(dataclasses.replace(cfg, router_bias_rate=0.0)), mixtral).keys()
    model.blocks[1].mlp.router.score_bias[2] = 0.01
    with pytest.raises(ExportError, match=(
            r"as MixtralForCausalLM \(Mixtral\): blocks.1.mlp.router.score_bias and the other routers' balancing "
            r"biases \(model.router_bias_rate=0.01, DeepSeek-V3's e_score_correction_bias\) are not 0 in 1 of its")):
        hf_state_dict(model, mixtral)


def test_the_error_rule_moves_each_bias_by_its_relative_imbalance_times_the_steps_size():
    cfg = dataclasses.replace(MOE, experts_per_token=1, d_model=4, router_bias_update="error", router_bias_rate=0.1)
    router = Router(cfg)
    router.routed = torch.tensor([40, 20, 4, 0])  # mean 16
    balance_routers(router, same, torch.tensor(0.5))  # half a step: the schedule's factor
    assert router.score_bias.tolist() == pytest.approx([0.05 * -24 / 16, 0.05 * -4 / 16, 0.05 * 12 / 16, 0.05])
    router.routed = torch.tensor([16, 16, 16, 16])  # even: nothing moves
    before = router.score_bias.clone()
    balance_routers(router, same, torch.tensor(1.0))
    assert torch.equal(router.score_bias, before)
    router.routed = None  # no training forward since the last update: nothing counted, nothing moves
    balance_routers(router, same, torch.tensor(1.0))
    assert torch.equal(router.score_bias, before)
