"""The recipe report's arithmetic (when a val curve first reaches a loss) and its command line."""

import numpy as np
import pytest

from experiments import recipes
from experiments.recipes import first_reaching
from lm.cli import run


def test_first_reaching_interpolates_between_evaluations():
    tokens, loss = np.array([100.0, 200.0, 300.0]), np.array([5.0, 4.0, 3.0])
    assert first_reaching(tokens, loss, 4.5) == 150.0
    assert first_reaching(tokens, loss, 6.0) == 100.0  # reached at the first evaluation
    assert first_reaching(tokens, loss, 2.0) is None  # never


def test_help_and_a_directory_without_runs_are_one_answer_each(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        recipes.main(["--help"])
    assert done.value.code == 0 and "--ablations" in capsys.readouterr().out
    assert run(recipes.main, [str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'a'}: not a sweep directory with runs "
                                       "(python -m lm.sweep --out writes one)\n")
