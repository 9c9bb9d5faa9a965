"""Muon on one process: the Newton-Schulz iteration, the update rule, the AdamW groups beside it, the skip
on the device, and which parameters `build_optimizer` gives it."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from lm.config import OptimConfig
from lm.distributed.muon import Muon, newton_schulz
from lm.distributed.optim import build_optimizer, set_lr
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from tests.workers import job_env, pool


def with_singular_values(m: int, n: int, values: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(U diag(values) V^T, U, V): a (m, n) matrix with the given singular values and random singular vectors."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g))
    return u @ torch.diag(values) @ v.T, u, v


@pytest.mark.parametrize("shape", [(48, 48), (32, 96), (96, 32)])
def test_newton_schulz_keeps_the_singular_vectors_and_brings_every_singular_value_near_one(shape):
    k = min(shape)
    # singular values over two decades, at any scale: the iteration normalises first
    g, u, v = with_singular_values(*shape, torch.logspace(-2, 0, k) * 7.0)
    o = newton_schulz(g, steps=5)
    assert o.shape == g.shape and o.dtype == g.dtype
    core = u.T @ o @ v  # diagonal exactly when o has g's singular vectors
    diagonal = torch.diagonal(core)
    assert (core - torch.diag(diagonal)).abs().max() < 1e-5
    # the quintic is tuned for speed, not convergence: 5 steps leave every value in [0.68, 1.21]
    assert diagonal.min() > 0.65 and diagonal.max() < 1.25
    # so o is orthogonal to that tolerance: o o^T (or o^T o) is near the identity
    gram = o @ o.T if shape[0] <= shape[1] else o.T @ o
    assert (gram - torch.eye(k)).abs().max() < 0.5
    assert torch.linalg.svdvals(o).sub(1).abs().max() < 0.35


def test_newton_schulz_of_a_zero_matrix_is_zero():
    # DCP initialises optimizer state by stepping zero gradients at lr 0: the update must be finite
    assert torch.equal(newton_schulz(torch.zeros(4, 6), 5), torch.zeros(4, 6))


def two_groups(shape: tuple[int, int] = (6, 4)) -> tuple[nn.Parameter, nn.Parameter, Muon]:
    """A matrix (6, 4 by default) under Muon and a vector under AdamW, with gradients."""
    torch.manual_seed(0)
    matrix, vector = nn.Parameter(torch.randn(*shape)), nn.Parameter(torch.randn(5))
    opt = Muon([{"params": [matrix], "muon": True, "weight_decay": 0.1}, {"params": [vector], "weight_decay": 0.0}],
               momentum=0.9, ns_steps=5, lr=0.05, betas=(0.9, 0.95), eps=1e-8, fused=True)
    matrix.grad, vector.grad = torch.randn(*shape), torch.randn(5)
    return matrix, vector, opt


@pytest.mark.parametrize("shape", [(6, 4), (4, 6)], ids=["tall", "wide"])
def test_a_muon_step_follows_the_documented_rule(shape):
    matrix, _, opt = two_groups(shape)
    p0, g = matrix.detach().clone(), matrix.grad.clone()
    opt.step()
    buf = 0.1 * g  # from a zero buffer: momentum * 0 + (1 - momentum) * g
    u = 0.1 * g + 0.9 * buf  # Nesterov
    scale = max(1.0, shape[0] / shape[1]) ** 0.5  # sqrt(max(1, rows / cols)): a wide matrix is not scaled down
    expected = p0 * (1 - 0.05 * 0.1) - 0.05 * scale * newton_schulz(u, 5)
    torch.testing.assert_close(matrix.detach(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(opt.state[matrix]["momentum_buffer"], buf, rtol=0, atol=0)
    assert opt.state[matrix]["step"].item() == 1


def test_the_adamw_groups_step_exactly_as_torch_adamw():
    _, vector, opt = two_groups()
    twin = nn.Parameter(vector.detach().clone())
    twin.grad = vector.grad.clone()
    reference = torch.optim.AdamW([twin], lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    for _ in range(3):
        opt.step()
        reference.step()
    assert torch.equal(vector, twin)


def test_a_step_with_found_inf_changes_nothing():
    matrix, vector, opt = two_groups()
    opt.step()  # a real step first, so every state exists
    before = [t.clone() for t in (matrix, vector, opt.state[matrix]["momentum_buffer"], opt.state[matrix]["step"],
                                  opt.state[vector]["exp_avg"], opt.state[vector]["step"])]
    matrix.grad.fill_(float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    after = (matrix, vector, opt.state[matrix]["momentum_buffer"], opt.state[matrix]["step"],
             opt.state[vector]["exp_avg"], opt.state[vector]["step"])
    for old, new in zip(before, after):
        assert torch.equal(old, new)
    opt.found_inf = torch.zeros(())  # and a finite step after it is applied
    matrix.grad.normal_()
    opt.step()
    assert not torch.equal(matrix, before[0]) and opt.state[matrix]["step"].item() == 2


def groups_of(model: nn.Module, cfg: OptimConfig) -> list[set[str]]:
    names = {id(p): name for name, p in model.named_parameters()}
    groups = build_optimizer(model, cfg, [model.lm_head]).param_groups
    return [{names[id(p)] for p in group["params"]} for group in groups]


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8, vocab_size=64, pos="rope",
                          norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False))
    adamw = groups_of(model, OptimConfig())
    decay, no_decay, matrices = groups_of(model, OptimConfig(name="muon"))
    assert matrices == adamw[0] - {"lm_head.weight"}  # every decayed Linear weight but the head's
    assert all(name.startswith("blocks.") and name.endswith(".weight") for name in matrices)
    assert decay == {"lm_head.weight"} and no_decay == adamw[1]  # embedding and norms, undecayed


def test_a_tied_gpt_under_muon_has_no_empty_group():
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=64))
    opt = build_optimizer(model, OptimConfig(name="muon"), [model.lm_head])
    # AdamW's decayed group would hold only the head, which is the embedding: it is left out, not left empty
    assert [group["muon"] for group in opt.param_groups] == [False, True]
    assert all(group["params"] for group in opt.param_groups)


def test_the_schedule_scales_muon_lr_as_it_scales_lr():
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=64))
    cfg = OptimConfig(name="muon", lr=1e-3, muon_lr=0.02)
    opt = build_optimizer(model, cfg, [model.lm_head])
    set_lr(opt, 5e-4, cfg)  # half the peak
    assert [group["lr"] for group in opt.param_groups] == [5e-4, pytest.approx(0.01)]


@pytest.mark.parametrize("head", ["classify", "regress", "mlm"])
def test_an_encoders_output_head_stays_with_adamw(head):
    from lm.models.encoder.config import EncoderConfig
    from lm.models.registry import family_of

    cfg = EncoderConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=64, head=head,
                        num_classes=3 if head == "classify" else 0)
    family = family_of(cfg)
    model = family.build(cfg)
    names = {id(p): name for name, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(name="muon"), family.output_layers(model))
    muon = {names[id(p)] for group in opt.param_groups if group["muon"] for p in group["params"]}
    head_weight = "wte.weight" if head == "mlm" else "score.weight"  # the masked-token head is the embedding
    assert muon and all(name.startswith("blocks.") or name == "mlm_dense.weight" for name in muon)
    assert head_weight not in muon and head_weight in names.values()


def test_each_group_gets_the_configured_optimizer_settings():
    # a Muon group built with weight_decay 0 would train on (test_muon's step test builds its own groups)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=64, tie_embeddings=False))
    cfg = OptimConfig(name="muon", weight_decay=0.05, beta1=0.8, beta2=0.9, eps=1e-6, lr=1e-3)
    opt = build_optimizer(model, cfg, [model.lm_head])
    settings = [(g["weight_decay"], g.get("muon", False), g["betas"], g["eps"], g["lr"]) for g in opt.param_groups]
    assert settings == [(0.05, False, (0.8, 0.9), 1e-6, 1e-3), (0.0, False, (0.8, 0.9), 1e-6, 1e-3),
                        (0.05, True, (0.8, 0.9), 1e-6, 1e-3)]
    adamw = build_optimizer(model, OptimConfig(weight_decay=0.05, eps=1e-6), [model.lm_head])
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["fused"] is True
    assert [(g["weight_decay"], g["eps"]) for g in adamw.param_groups] == [(0.05, 1e-6), (0.0, 1e-6)]


def test_muon_is_given_the_ranks_that_share_its_work():
    # under ddp Muon's ranks split the matrices' orthogonalisation between them: it must know how many
    # there are and which one it is, or every rank would do all of the work
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=64))
    opt = build_optimizer(model, OptimConfig(name="muon"), [model.lm_head], world_size=4, rank=3)
    assert (opt.world_size, opt.rank) == (4, 3)


def quintic_by_hand(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The documented iteration written out: the wide orientation, Frobenius-normalised, then
    x <- a x + (b A + c A^2) x with A = x x^T and (a, b, c) = (3.4445, -4.7750, 2.0315)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


@pytest.mark.parametrize("shape", [(5, 8), (8, 5)])
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_newton_schulz_is_the_documented_quintic_iteration(shape, steps):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(newton_schulz(g, steps), quintic_by_hand(g, steps), rtol=0, atol=1e-5)


def test_newton_schulz_returns_the_dtype_it_was_given():
    # the iteration runs in float32 off CUDA, but a bfloat16 gradient must get a bfloat16 update back
    g = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)).bfloat16()
    o = newton_schulz(g, 5)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o, quintic_by_hand(g.float(), 5).bfloat16(), rtol=0, atol=1e-2)


def test_two_muon_steps_follow_the_nesterov_rule():
    # the first step from a zero buffer cannot tell Nesterov momentum from plain momentum or the raw gradient
    # (all are multiples of the one gradient and the orthogonalisation ignores scale); the second step can
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(6, 4))
    g1, g2 = torch.randn(6, 4), torch.randn(6, 4)
    opt = Muon([{"params": [p], "muon": True, "weight_decay": 0.1}], momentum=0.9, ns_steps=5, lr=0.05)
    lr, wd, scale = 0.05, 0.1, (6 / 4) ** 0.5
    expected = p.detach().clone()
    buf = torch.zeros(6, 4)
    for g in (g1, g2):
        p.grad = g.clone()
        opt.step()
        buf = 0.9 * buf + 0.1 * g
        nesterov = 0.1 * g + 0.9 * buf
        expected = expected * (1 - lr * wd) - lr * scale * quintic_by_hand(nesterov, 5)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, rtol=0, atol=1e-6)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-5)
    assert opt.state[p]["step"].item() == 2


def test_a_matrix_without_a_gradient_is_left_alone():
    # a frozen or unused matrix in a Muon group: no step, no state, no error
    torch.manual_seed(0)
    used, unused = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    opt = Muon([{"params": [used, unused], "muon": True, "weight_decay": 0.1}], momentum=0.9, ns_steps=5, lr=0.05)
    before = unused.detach().clone()
    used.grad = torch.randn(4, 4)
    opt.step()
    assert torch.equal(unused, before) and unused not in opt.state
    assert not torch.equal(used.detach(), before)


def test_a_muon_group_with_a_vector_is_refused():
    matrix, vector = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="a muon group holds 2-D matrices only"):
        Muon([{"params": [matrix, vector], "muon": True}], momentum=0.9, ns_steps=5, lr=0.05)


def test_a_groups_own_momentum_and_steps_are_kept():
    matrix = nn.Parameter(torch.randn(4, 4))
    opt = Muon([{"params": [matrix], "muon": True, "momentum": 0.5, "ns_steps": 3}], momentum=0.9, ns_steps=5, lr=0.1)
    assert (opt.param_groups[0]["momentum"], opt.param_groups[0]["ns_steps"]) == (0.5, 3)


def test_a_decayed_adamw_group_steps_exactly_as_torch_adamw():
    # the AdamW groups' weight decay is AdamW's decoupled one (p <- p (1 - lr wd)), not Adam's L2 term
    torch.manual_seed(0)
    vector = nn.Parameter(torch.randn(5))
    twin = nn.Parameter(vector.detach().clone())
    opt = Muon([{"params": [vector], "weight_decay": 0.5}], momentum=0.9, ns_steps=5, lr=0.05, betas=(0.9, 0.95))
    reference = torch.optim.AdamW([twin], lr=0.05, betas=(0.9, 0.95), weight_decay=0.5)
    for _ in range(3):
        vector.grad = torch.randn(5)
        twin.grad = vector.grad.clone()
        opt.step()
        reference.step()
    torch.testing.assert_close(vector.detach(), twin.detach(), rtol=0, atol=1e-7)


def muon_on_two_ranks() -> dict:
    """Three matrices stepped by Muon on each of 2 ranks with the same gradients (as after DDP's all-reduce);
    the weights after the step and how many matrices this rank orthogonalised itself."""
    import lm.distributed.muon as muon

    calls = []
    plain = muon.newton_schulz

    def counted(g, steps):
        calls.append(tuple(g.shape))
        return plain(g, steps)

    muon.newton_schulz = counted
    try:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(*shape)) for shape in ((4, 6), (6, 4), (5, 5))]
        grads = [torch.randn_like(p) for p in params]
        opt = muon.Muon([{"params": params, "muon": True, "weight_decay": 0.0}], momentum=0.9, ns_steps=5, lr=0.1,
                        world_size=dist.get_world_size(), rank=dist.get_rank())
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    finally:
        muon.newton_schulz = plain
    return {"weights": [p.detach().clone() for p in params], "calls": calls}


@pytest.mark.process
def test_ddp_ranks_split_the_orthogonalisation_and_agree_with_one_process():
    replies = pool(2).run(muon_on_two_ranks, env=job_env())
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(*shape)) for shape in ((4, 6), (6, 4), (5, 5))]
    grads = [torch.randn_like(p) for p in params]
    expected = []
    for p, g in zip(params, grads):
        update = quintic_by_hand(0.1 * g + 0.9 * (0.1 * g), 5)  # Nesterov from a zero buffer
        expected.append(p.detach() - 0.1 * max(1.0, p.shape[0] / p.shape[1]) ** 0.5 * update)
    for reply in replies:
        for got, want in zip(reply["value"]["weights"], expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # rank r orthogonalises matrices r, r + 2, ...: rank 0 the first and third, rank 1 the second
    assert [reply["value"]["calls"] for reply in replies] == [[(4, 6), (5, 5)], [(6, 4)]]
