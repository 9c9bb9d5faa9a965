"""Mixture-of-experts blocks of the decoder family (`lm.models.gpt.moe`): the grouped and the per-expert paths
against each other and against a token-by-token reference, the routers, the loss terms, the sizes, and what is
refused."""

import dataclasses

import pytest
import torch

from lm.config import load_config
from lm.errors import ConfigError, ExportError
from lm.hf.targets import pick_target
from lm.models.gpt import hf, hf_remote
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.family import FAMILY, idle_expert_params
from lm.models.gpt.model import GPT
from lm.models.gpt.moe import MoE, RouterStats, router_stats, with_router_terms
from lm.models.layers import activate
from lm.models.loss import cross_entropy_terms
from lm.plan.counts import num_params

MOE = GPTConfig(n_layer=2, n_head=4, d_model=32, block_size=16, vocab_size=96, n_experts=4, experts_per_token=2,
                expert_d_ff=16)


def built(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def by_hand(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts one at a time, weighted by the router, plus the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen, _, _ = moe.router(flat)
    e = moe.experts
    out = []
    for token, (w, picks) in enumerate(zip(weights, chosen)):
        row = torch.zeros_like(flat[token])
        for weight, i in zip(w, picks):
            gate = flat[token] @ e.w_gate[i] if e.kind == "swiglu" else None
            row = row + weight * (activate(e.kind, flat[token] @ e.w_in[i], gate) @ e.w_out[i])
        out.append(row)
    out = torch.stack(out)
    if moe.shared is not None:
        out = out + moe.shared(flat)
    return out.reshape(x.shape)


@pytest.mark.parametrize("options", [
    {"mlp": "swiglu"},
    {"mlp": "relu2", "n_shared_experts": 1},
    {"mlp": "gelu", "router": "sigmoid", "experts_per_token": 3},
    {"mlp": "swiglu", "router_renorm": False, "experts_per_token": 1},
], ids=["swiglu", "relu2+shared", "gelu+sigmoid-top3", "unnormalised-top1"])
def test_grouped_and_per_expert_paths_agree_with_a_token_by_token_reference(options):
    moe = built(dataclasses.replace(MOE, **options)).blocks[0].mlp
    x = torch.randn(3, 8, 32, requires_grad=True)
    results = {}
    for grouped in (True, False):
        moe.experts.grouped = grouped
        y = moe(x)
        (grad,) = torch.autograd.grad((y * torch.linspace(-1, 1, 32)).sum(), x)
        results[grouped] = (y.detach(), grad, moe.stats.counts)
    with torch.no_grad():
        reference = by_hand(moe, x)
    assert torch.allclose(results[True][0], reference, atol=1e-5, rtol=1e-5)
    assert torch.allclose(results[False][0], results[True][0], atol=1e-5, rtol=1e-5)
    assert torch.allclose(results[False][1], results[True][1], atol=1e-5, rtol=1e-5)
    assert results[True][2].sum() == 3 * 8 * moe.k  # dropless: every token reaches its k experts


def test_experts_whose_rows_are_not_16_byte_aligned_take_one_product_per_expert():
    """torch._grouped_mm refuses rows not 16-byte aligned: 6 float32 hidden units are 24 bytes."""
    moe = built(dataclasses.replace(MOE, expert_d_ff=6)).blocks[0].mlp
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        y = moe(x)  # the default path: grouped where it fits
        moe.experts.grouped = False
        assert torch.equal(y, moe(x))


def test_a_training_forward_drops_out_the_routed_experts_output():
    """model.dropout applies to the experts' weighted sum as to a dense MLP's output."""
    moe = built(dataclasses.replace(MOE, dropout=0.5)).blocks[0].mlp
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        plain = moe.eval()(x)
        dropped = moe.train()(x)
    zeroed = dropped == 0
    assert 0.3 < zeroed.float().mean().item() < 0.7 and (plain[zeroed] != 0).all()
    assert torch.allclose(dropped[~zeroed], 2 * plain[~zeroed], atol=1e-6)  # the rest scaled by 1 / (1 - p)


def test_a_forwards_router_z_loss_is_the_mean_squared_logsumexp():
    """ST-MoE's router z-loss from a real forward: the mean of the squares, not the square of the mean."""
    moe = built(MOE).blocks[0].mlp
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        moe.router.gate.weight.mul_(20)  # logits of a few units, so the two orders differ clearly
        moe(x)
        lse = torch.logsumexp(moe.router.gate(x.reshape(-1, 32)).float(), dim=-1)  # (N,)
    assert torch.allclose(moe.stats.z_loss, lse.square().mean())
    assert not torch.allclose(moe.stats.z_loss, lse.mean().square(), rtol=1e-2)


def test_the_router_terms_weigh_as_the_micro_batchs_targets():
    """Token-weighted means over micro-batches and ranks, as the cross-entropy: a 2 x 16 micro-batch weighs 32."""
    model = built(MOE)
    x, y = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    terms = FAMILY.training.loss(model, model, [x, y]).terms
    assert [terms[name].weight for name in ("moe_balance", "router_z", "objective")] == [32, 32, 32]


def test_a_new_routing_compiles_nothing_new():
    """Under torch.compile the experts' products run eager (their row counts are data): traced, every new routing
    compiled again, and compiled decoding hit dynamo's recompile limit within a few dozen tokens."""
    from torch._dynamo.utils import counters

    experts = built(MOE).blocks[0].mlp.experts
    compiled = torch.compile(experts, backend="eager")  # dynamo's tracing alone: what recompiles
    x = torch.randn(8, 32)
    graphs = counters["stats"]["unique_graphs"]
    for routing in ([8, 0, 0, 0], [2, 2, 2, 2], [0, 1, 3, 4], [5, 0, 3, 0]):
        counts = torch.tensor(routing)
        assert torch.equal(compiled(x, counts), experts(x, counts))
    assert counters["stats"]["unique_graphs"] - graphs == 0


def test_the_routers_weights():
    cfg = dataclasses.replace(MOE, n_experts=6, experts_per_token=3)
    x = torch.randn(10, 32)
    for router, renorm in (("softmax", True), ("softmax", False), ("sigmoid", True)):
        moe = built(dataclasses.replace(cfg, router=router, router_renorm=renorm)).blocks[0].mlp
        weights, chosen, logits, probs = moe.router(x)
        scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
        assert torch.equal(chosen, scores.topk(3).indices)
        picked = scores.gather(-1, chosen)
        want = picked if (router, renorm) == ("softmax", False) else picked / picked.sum(-1, keepdim=True)
        assert torch.allclose(weights, want)
        assert torch.allclose(probs.sum(-1), torch.ones(10))


def test_the_balance_loss_is_one_for_an_even_load_and_the_terms_join_the_objective():
    # the Switch Transformer's n * sum_e f_e p_e: uniform probabilities and an even load give exactly 1
    stats = RouterStats(0, 4 * (torch.full((4,), 0.25) * torch.full((4,), 0.25)).sum(), torch.tensor(2.0),
                        torch.tensor([5, 5, 5, 5]))
    assert stats.balance.item() == 1.0 and stats.load.item() == 1.0
    skewed = RouterStats(1, torch.tensor(1.5), torch.tensor(4.0), torch.tensor([14, 2, 2, 2]))
    assert skewed.load.item() == pytest.approx(14 / 5)
    losses = with_router_terms(cross_entropy_terms(torch.tensor(3.0), 32), [stats, skewed], 32, 0.01, 0.001)
    terms = losses.terms
    assert losses.objective == "objective" and terms["loss"].value.item() == 3.0
    assert terms["moe_balance"].value.item() == pytest.approx(1.25) and terms["router_z"].value.item() == 3.0
    assert terms["expert_load_0"].value.item() == 1.0 and terms["expert_load_1"].reduce.value == "max"
    assert losses.optimized.item() == pytest.approx(3.0 + 0.01 * 1.25 + 0.001 * 3.0)


def test_a_forwards_balance_loss_is_n_sum_f_p():
    # measured by a real forward, not built by hand: f_e the share of the (token, choice) pairs expert e took,
    # p_e its mean probability; a gate of zeros gives every p_e = 1/n, so the loss is sum_e f_e = 1 whatever the load
    moe = built(MOE).blocks[0].mlp
    x = torch.randn(2, 8, MOE.d_model)
    with torch.no_grad():
        moe(x)
        _, chosen, _, probs = moe.router(x.reshape(-1, MOE.d_model))
        f = torch.bincount(chosen.reshape(-1), minlength=MOE.n_experts).float() / chosen.numel()
        assert moe.stats.balance.item() == pytest.approx(MOE.n_experts * (f * probs.mean(0)).sum().item())
        moe.router.gate.weight.zero_()
        moe(x)
    assert moe.stats.balance.item() == pytest.approx(1.0)


def test_a_moe_model_logs_its_router_terms_and_they_change_the_gradients():
    cfg = dataclasses.replace(MOE, moe_first_dense=1)  # block 0 dense, block 1 a mixture
    model = built(cfg)
    x, y = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    from lm.models.gpt.family import FAMILY

    losses = FAMILY.training.loss(model, model, [x, y])
    assert [s.layer for s in router_stats(model)] == [1]
    assert set(losses.terms) == {"loss", "moe_balance", "router_z", "expert_load_1", "objective"}
    weight = model.blocks[1].mlp.router.gate.weight
    (with_aux,) = torch.autograd.grad(losses.optimized, weight)
    (without,) = torch.autograd.grad(FAMILY.training.loss(model, model, [x, y]).terms["loss"].value, weight)
    assert not torch.allclose(with_aux, without)


def test_which_blocks_are_mixtures():
    cfg = dataclasses.replace(MOE, n_layer=6, moe_first_dense=1, moe_every=2)
    assert [i for i in range(6) if cfg.moe_layer(i)] == [2, 4]
    model = built(cfg)
    assert [isinstance(b.mlp, MoE) for b in model.blocks] == [False, False, True, False, True, False]


def test_the_flops_count_the_active_experts_only():
    cfg = dataclasses.replace(MOE, mlp="swiglu", n_experts=8, experts_per_token=2, bias=False)
    assert idle_expert_params(cfg) == 2 * 6 * 3 * 32 * 16
    dense_width = dataclasses.replace(cfg, n_experts=0, expert_d_ff=0, d_ff=2 * 16)
    # with 2 of 8 experts active, the active parameters are a dense model's of twice the expert width, plus routers
    routers = 2 * 32 * 8
    assert num_params(cfg) - idle_expert_params(cfg) == num_params(dense_width) + routers


@pytest.mark.parametrize("flags, message", [
    (["--model.n_experts=4", "--model.experts_per_token=5"],
     "model.experts_per_token: 5 experts per token of model.n_experts=4; it must be 1 to 4"),
    (["--model.n_experts=4", "--model.router=topk"], "model.router: unknown value 'topk'"),
    (["--model.n_experts=4", "--model.moe_first_dense=2"], "no block of the 2 (model.n_layer) is a mixture"),
    (["--model.n_experts=4", "--model.tie_embeddings=false", "--parallel.engine=fsdp", "--parallel.pp=2"],
     "not under pipeline parallelism"),
    (["--model.n_experts=4", "--parallel.engine=fsdp", "--parallel.cp=2"], "not under context parallelism"),
])
def test_what_is_refused_by_the_config(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, ["--model.n_layer=2", "--model.n_head=4", "--data.seq_len=16", *flags])


def test_no_export_target_takes_a_mixture_yet():
    with pytest.raises(ExportError, match="model.n_experts=4") as err:
        pick_target(dataclasses.replace(MOE, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False),
                    (*hf.TARGETS, hf_remote.TARGET), "a decoder-only GPT")
    assert "LlamaForCausalLM (Llama) needs model.n_experts=0" in str(err.value)
