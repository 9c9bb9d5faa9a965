"""A step's loss terms from its micro-batches (`lm.models.terms.combine`): each reduced as it says."""

import pytest
import torch
import torch.nn.functional as F

from lm.models.family import PlainLoss
from lm.models.loss import cross_entropy_terms
from lm.models.registry import config_class, get_family
from lm.models.terms import Losses, Reduce, Term, combine


def micro(value: float, weight: float, reduce: Reduce = Reduce.MEAN) -> dict[str, Term]:
    return {"x": Term(torch.tensor(value), reduce, weight)}


def test_a_mean_weighs_each_micro_batch_by_its_targets_and_keeps_their_total():
    step = combine([micro(2.0, 10), micro(4.0, 30)])["x"]
    assert step.value.item() == pytest.approx((2 * 10 + 4 * 30) / 40) and step.weight == 40
    equal = combine([micro(2.0, 10), micro(4.0, 10)])["x"]
    assert equal.value.item() == 3.0 and equal.weight == 20


def test_a_sum_adds_the_values_whatever_their_weights_and_a_max_takes_the_largest():
    assert combine([micro(2.0, 10, Reduce.SUM), micro(4.0, 30, Reduce.SUM)])["x"].value.item() == 6.0
    assert combine([micro(2.0, 10, Reduce.MAX), micro(4.0, 30, Reduce.MAX)])["x"].value.item() == 4.0


def test_a_steps_terms_keep_their_kind_of_reduction():
    # the window and the ranks reduce a step's term as it says: a SUM or MAX read as a MEAN would be averaged
    micro = [{"n": Term(torch.tensor(2.0), Reduce.SUM, 10), "top": Term(torch.tensor(5.0), Reduce.MAX, 10),
              "loss": Term(torch.tensor(1.0), Reduce.MEAN, 10)},
             {"n": Term(torch.tensor(4.0), Reduce.SUM, 30), "top": Term(torch.tensor(3.0), Reduce.MAX, 30),
              "loss": Term(torch.tensor(3.0), Reduce.MEAN, 30)}]
    step = combine(micro)
    assert {name: term.reduce for name, term in step.items()} == {"n": Reduce.SUM, "top": Reduce.MAX,
                                                                  "loss": Reduce.MEAN}
    assert step["n"].value.item() == 6.0 and step["top"].value.item() == 5.0
    assert step["loss"].value.item() == pytest.approx((1 * 10 + 3 * 30) / 40) and step["loss"].weight == 40


def test_detached_terms_keep_their_weight_and_reduction_and_leave_the_graph():
    value = torch.tensor(2.0, requires_grad=True) * 3
    losses = Losses({"loss": Term(value, Reduce.MEAN, 37.0), "n": Term(value * 0 + 5, Reduce.SUM, 1.0)})
    detached = losses.detached()
    assert detached["loss"] == Term(detached["loss"].value, Reduce.MEAN, 37.0)
    assert detached["n"].reduce is Reduce.SUM
    assert not detached["loss"].value.requires_grad and detached["loss"].value.item() == 6.0


def test_a_cross_entropys_terms_are_weighted_by_its_targets():
    plain = cross_entropy_terms(torch.tensor(2.5), 96)
    assert plain.objective == "loss" and plain.terms["loss"] == Term(plain.terms["loss"].value, Reduce.MEAN, 96)
    with_z = cross_entropy_terms(torch.tensor([2.5, 4.0]), 96, z_loss=1e-2)
    assert with_z.objective == "objective"
    assert {name: (term.value.item(), term.weight) for name, term in with_z.terms.items()} == {
        "loss": (2.5, 96), "z_loss": (4.0, 96), "objective": (pytest.approx(2.5 + 1e-2 * 4.0), 96)}


def test_an_objective_that_is_none_of_the_terms_is_refused():
    with pytest.raises(ValueError, match="the objective 'objective' is none of the terms"):
        Losses({"loss": Term(torch.tensor(1.0))}, objective="objective")


def test_a_next_token_loss_and_score_count_every_target_of_the_batch() -> None:
    # 2 windows of 7 targets: the loss's terms average over (and are weighted by) 14 targets, and score counts 14
    cfg = config_class("gpt")(vocab_size=100, block_size=32, n_layer=1, n_head=2, d_model=32)
    family = get_family("gpt")
    torch.manual_seed(0)
    model = family.build(cfg)
    idx, targets = torch.randint(0, 100, (2, 7)), torch.randint(0, 100, (2, 7))
    logits = model.logits(model(idx)).float().view(14, -1)
    expected = F.cross_entropy(logits, targets.view(14))
    losses = family.training.loss(model, model, [idx, targets], PlainLoss(0.1))
    assert {name: term.weight for name, term in losses.terms.items()} == {"loss": 14, "z_loss": 14, "objective": 14}
    torch.testing.assert_close(losses.terms["loss"].value, expected, rtol=0, atol=1e-6)
    scored = family.training.score(model, model, [idx, targets])
    assert int(scored.count) == 14
    torch.testing.assert_close(scored.loss, expected, rtol=0, atol=1e-6)
