"""The z-loss term (optim.z_loss): the next-token families' loss adds it to the cross-entropy when asked, plain or
chunked, and asking changes neither the cross-entropy nor anything when not asked."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lm.models.loss import chunked_cross_entropy, head_loss
from tests.models.test_loss_chunk import B, T, build, family_loss, tiny


def test_head_loss_with_z_is_the_cross_entropy_and_the_mean_squared_log_partition() -> None:
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 40) * 4, torch.randint(0, 40, (3, 5))
    ce, z = head_loss(logits, targets, with_z=True)
    torch.testing.assert_close(ce, F.cross_entropy(logits.view(15, 40), targets.view(15)), rtol=1e-6, atol=0)
    torch.testing.assert_close(z, torch.logsumexp(logits, -1).square().mean(), rtol=1e-6, atol=0)
    # without it, the plain float32 F.cross_entropy, bit for bit
    assert torch.equal(head_loss(logits, targets), F.cross_entropy(logits.view(15, 40), targets.view(15)))


@pytest.mark.parametrize("arch", ["gpt", "lstm"])
@pytest.mark.parametrize("chunk", [0, 5])
def test_the_loss_adds_the_z_term_and_its_gradients_match_the_formula(arch, chunk) -> None:
    cfg = tiny(arch=arch, loss_chunk=chunk)
    torch.manual_seed(1)
    idx, targets = torch.randint(0, 100, (B, T)), torch.randint(0, 100, (B, T))
    torch.manual_seed(0)
    model = build(cfg)
    with_z = family_loss(model, idx, targets, z_loss=0.5)
    plain = family_loss(model, idx, targets)
    # the cross-entropy is optimized alone without it, and logged as "loss" either way
    assert list(plain.terms) == ["loss"] and plain.objective == "loss"
    assert list(with_z.terms) == ["loss", "z_loss", "objective"] and with_z.objective == "objective"
    terms = {name: term.value for name, term in with_z.detached().items()}
    assert not any(value.requires_grad for value in terms.values())
    torch.testing.assert_close(terms["loss"], plain.optimized, rtol=0, atol=1e-6)
    loss = with_z.optimized
    torch.testing.assert_close(loss, terms["loss"] + 0.5 * terms["z_loss"], rtol=0, atol=1e-6)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    # the same objective spelled out from the plain logits
    torch.manual_seed(0)
    reference = build(replace(cfg, loss_chunk=0))
    logits = reference.logits(reference(idx))
    log_z = torch.logsumexp(logits, -1)  # (B, T)
    (F.cross_entropy(logits.view(B * T, -1), targets.view(-1)) + 0.5 * log_z.square().mean()).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_terms_equal_the_plain_ones() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    h, targets = torch.randn(3, 5, 8), torch.randint(0, 50, (3, 5))
    plain = head_loss(head(h), targets, with_z=True)
    for chunk in (1, 4, 16):
        torch.testing.assert_close(chunked_cross_entropy(head, h, targets, chunk, with_z=True), plain,
                                   rtol=1e-6, atol=1e-6)
