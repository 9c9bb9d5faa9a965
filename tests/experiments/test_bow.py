"""The bag-of-words baseline: fine-tuning's split, a train-only vocabulary, converged fits, one-line refusals."""

import csv

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from experiments.bow import FEATURES, best_fit, bow_baseline, featurize, loss_and_gradients, main, words
from lm.cli import run
from lm.data.labelled import split_examples

WORDS = {0: ["alpha", "beta", "gamma", "delta"], 1: ["omega", "psi", "chi", "phi"]}


def write_rows(path, rows, header=("text", "label")):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def separable(n: int = 40) -> list[tuple[str, int]]:
    """Rows whose class shows in every word: two words of the class's own four, in varying case."""
    rng = np.random.default_rng(0)
    rows = []
    for label in rng.permutation(np.arange(n) % 2).tolist():
        picked = rng.choice(WORDS[label], size=2)
        rows.append((f"{picked[0].upper()}, {picked[1]}!", label))
    return rows


def test_words_are_lower_cased_word_runs():
    assert words("And GOD said, Let there be light: thou'rt") == ["and", "god", "said", "let", "there", "be", "light",
                                                                  "thou", "rt"]


def test_a_separable_file_is_learnt_to_every_val_row(tmp_path):
    path = write_rows(tmp_path / "sep.csv", separable())
    found = bow_baseline(str(path), 0.25, 2, grid=(1e-3, 1e-2))
    val_labels = [separable()[i][1] for i in found["val_idx"].tolist()]
    assert 0 < sum(val_labels) < len(val_labels)  # both classes are scored
    for kind in FEATURES:
        for fit in found["fits"][kind]:
            assert fit.val_accuracy == 1.0 and fit.val_f1 == 1.0 and fit.train_accuracy == 1.0
            assert fit.max_grad < 1e-5  # converged
    kind, best = best_fit(found["fits"])
    assert (kind, best.l2) == ("counts", 1e-3)  # a tie goes to the first in table order


def test_split_is_fine_tuning_split_and_vocabulary_comes_from_train_rows(tmp_path):
    rows = separable(30)
    train_idx, val_idx = split_examples(len(rows), 0.2)
    for i in val_idx.tolist():  # words only val rows hold must not enter the vocabulary
        rows[i] = (rows[i][0] + f" unseen{i}", rows[i][1])
    found = bow_baseline(str(write_rows(tmp_path / "t.csv", rows)), 0.2, 2, features=("counts",), grid=(1.0,))
    assert np.array_equal(found["train_idx"], train_idx) and np.array_equal(found["val_idx"], val_idx)
    assert found["vocab_size"] == len({w for i in train_idx.tolist() for w in words(rows[i][0])}) == 8


def test_features_of_one_row():
    features = featurize(["a a b", "b c"], ["a d"], "counts")
    assert features.vocab_size == 3
    assert features.train.to_dense().tolist() == [[2, 1, 0], [0, 1, 1]]
    assert features.val.to_dense().tolist() == [[1, 0, 0]]  # d never seen in training
    assert featurize(["a a b", "b c"], ["a d"], "binary").train.to_dense().tolist() == [[1, 1, 0], [0, 1, 1]]
    tfidf = featurize(["a a b", "b c"], ["a d"], "tfidf").train.to_dense()
    assert torch.allclose(tfidf.norm(dim=1), torch.ones(2, dtype=torch.float64))
    assert tfidf[1, 2] > tfidf[1, 1]  # c is in fewer rows than b


def test_written_out_gradients_equal_autograd():
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(7, 5, generator=gen, dtype=torch.float64) > 0.6).double()  # (N, V)
    y = torch.tensor([0, 2, 1, 1, 0, 2, 2])
    weight = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    loss, d_weight, d_bias = loss_and_gradients(x.to_sparse_csr(), x.t().to_sparse_csr(), y, weight.detach(),
                                                bias.detach(), 0.3)
    reference = F.cross_entropy(x @ weight + bias, y) + 0.15 * weight.pow(2).sum()
    reference.backward()
    assert torch.allclose(loss, reference.detach())
    assert torch.allclose(d_weight, weight.grad) and torch.allclose(d_bias, bias.grad)


def test_cli_prints_the_table_and_the_best(tmp_path, capsys):
    path = write_rows(tmp_path / "sep.csv", separable())
    assert run(main, ["--file", str(path), "--val-fraction", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "30 train rows, 10 val rows" in out and out.count("<- best") == 1
    assert "best: counts, l2 1e-05: val accuracy 100.00%" in out and "optimistic" in out


def test_a_missing_column_is_one_error_line(tmp_path, capsys):
    path = write_rows(tmp_path / "nolabel.csv", [("some words", "x")], header=("text", "class"))
    assert run(main, ["--file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: no column 'label'; the columns are ['class', 'text']\n"


def test_bad_flags_are_refused(tmp_path, capsys):
    path = str(write_rows(tmp_path / "sep.csv", separable()))
    for flags in (["--val-fraction", "1"], ["--val-fraction", "nan"], ["--num-classes", "1"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["--file", path, *flags])
        assert exit_info.value.code == 2
        assert flags[0] in capsys.readouterr().err
