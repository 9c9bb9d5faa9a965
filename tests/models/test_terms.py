"""A step's loss terms from its micro-batches (`lm.models.terms.combine`): each reduced as it says."""

import pytest
import torch

from lm.models.terms import Reduce, Term, combine


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
