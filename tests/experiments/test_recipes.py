"""The recipe report's arithmetic: when a val curve first reaches a loss."""

import numpy as np

from experiments.recipes import first_reaching


def test_first_reaching_interpolates_between_evaluations():
    tokens, loss = np.array([100.0, 200.0, 300.0]), np.array([5.0, 4.0, 3.0])
    assert first_reaching(tokens, loss, 4.5) == 150.0
    assert first_reaching(tokens, loss, 6.0) == 100.0  # reached at the first evaluation
    assert first_reaching(tokens, loss, 2.0) is None  # never
