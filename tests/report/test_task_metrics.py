
import numpy as np
import pytest
import torch

from lm.report.metrics import (
    REGRESSION_SUMS,
    classification_metrics,
    confusion_matrix,
    regression_metrics,
    regression_sums,
)
from lm.training.evaluate import task_metrics, task_sums


def macro_f1(y: np.ndarray, p: np.ndarray, num_classes: int) -> float:
    """Macro F1 counted example by example, over the classes that occur in y or p."""
    scores = []
    for c in range(num_classes):
        tp = sum(1 for a, b in zip(y, p) if a == c and b == c)
        fp = sum(1 for a, b in zip(y, p) if a != c and b == c)
        fn = sum(1 for a, b in zip(y, p) if a == c and b != c)
        if tp + fp + fn:
            precision = tp / (tp + fp) if tp + fp else 0.0
            recall = tp / (tp + fn) if tp + fn else 0.0
            scores.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    return sum(scores) / len(scores)


@pytest.mark.parametrize("seed", range(5))
def test_classification_metrics_summed_over_parts(seed):
    rng = np.random.default_rng(seed)
    n, num_classes = 300, 5
    y = rng.integers(0, num_classes, n)
    p = np.where(rng.random(n) < 0.6, y, rng.integers(0, num_classes - 1, n))  # no wrong prediction is class 4
    # the sums of 7 batches, as the trainer adds them up over batches and ranks
    parts = np.array_split(np.arange(n), 7)
    confusion = sum(confusion_matrix(y[i], p[i], num_classes) for i in parts)
    assert confusion.shape == (num_classes, num_classes) and confusion.dtype == np.float64
    assert confusion.sum() == n and confusion[2, 3] == np.sum((y == 2) & (p == 3))
    metrics = classification_metrics(confusion)
    assert metrics["accuracy"] == pytest.approx(np.mean(y == p), abs=1e-12)
    assert metrics["f1"] == pytest.approx(macro_f1(y, p, num_classes), abs=1e-12)


def test_classification_metrics_by_hand():
    # class 0: tp 2, fp 1, fn 0 -> F1 0.8; class 1: tp 1, fp 0, fn 1 -> 2/3; class 2 absent and never predicted
    confusion = np.array([[2, 0, 0], [1, 1, 0], [0, 0, 0]])
    metrics = classification_metrics(confusion)
    assert metrics == {"accuracy": pytest.approx(0.75), "f1": pytest.approx((0.8 + 2 / 3) / 2)}
    # a class predicted but absent counts, with F1 0
    assert classification_metrics(np.array([[1, 1], [0, 0]]))["f1"] == pytest.approx((2 / 3 + 0) / 2)
    weighted = confusion_matrix(np.array([0, 1, 1]), np.array([0, 1, 0]), 2, weight=np.array([1.0, 0.0, 1.0]))
    assert weighted.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    with pytest.raises(ValueError, match="positive total"):
        classification_metrics(np.zeros((3, 3)))


@pytest.mark.parametrize("seed", range(5))
def test_regression_metrics_summed_over_parts(seed):
    rng = np.random.default_rng(seed)
    y = rng.normal(3.0, 2.0, 500)
    p = 0.7 * y + rng.normal(0.5, 1.0, 500)
    weight = np.ones(500)
    weight[-20:] = 0  # fillers of an evaluation's last batch
    parts = np.array_split(np.arange(500), 9)
    sums = sum(regression_sums(y[i], p[i], weight[i]) for i in parts)
    assert sums.shape == (len(REGRESSION_SUMS),) == (7,) and sums.dtype == np.float64
    metrics = regression_metrics(sums)
    yk, pk = y[:480], p[:480]
    assert metrics["mse"] == pytest.approx(np.mean((pk - yk) ** 2), rel=1e-12)
    dy, dp = yk - yk.mean(), pk - pk.mean()
    assert metrics["pearson"] == pytest.approx(np.sum(dy * dp) / np.sqrt(np.sum(dy**2) * np.sum(dp**2)), rel=1e-10)


def test_regression_metrics_edges():
    y = np.array([1.0, 2.0, 3.0])
    assert regression_metrics(regression_sums(y, y)) == {"mse": 0.0, "pearson": 1.0}
    assert regression_metrics(regression_sums(y, -2 * y + 1))["pearson"] == pytest.approx(-1.0)
    constant = regression_metrics(regression_sums(y, np.full(3, 2.0)))
    assert constant["mse"] == pytest.approx(2 / 3) and constant["pearson"] is None
    with pytest.raises(ValueError, match="positive count"):
        regression_metrics(np.zeros(7))


def test_regression_metrics_about_a_common_center_keep_their_digits():
    rng = np.random.default_rng(0)
    parts = np.array_split(np.arange(3000), 375)  # batches of 8, as lm.predict --batch-size 8 sums them
    constant = np.full(3000, 0.123)  # constant labels: no correlation, whatever the batches (it read -0.0000)
    p = rng.normal(0.1, 0.01, 3000)
    sums = sum(regression_sums(constant[i], p[i], center=constant[0]) for i in parts)
    assert regression_metrics(sums)["pearson"] is None
    assert regression_metrics(sum(regression_sums(p[i], np.full(len(i), 0.7), center=p[0]) for i in parts)
                              )["pearson"] is None  # nor constant predictions
    y = 1e8 + rng.normal(0, 1, 3000)  # a large offset: its square cancelled the variance away (None)
    q = y + rng.normal(0, 1, 3000)
    sums = sum(regression_sums(y[i], q[i], center=y[0]) for i in parts)
    assert regression_metrics(sums)["pearson"] == pytest.approx(np.corrcoef(y, q)[0, 1], rel=1e-9)
    assert regression_metrics(sums)["mse"] == pytest.approx(np.mean((q - y) ** 2), rel=1e-9)


def test_a_filler_row_of_weight_0_counts_in_no_sum():
    # example_batches fills a last short batch with rows of weight 0: they must change neither loss nor counts
    import torch.nn.functional as F

    from lm.training.evaluate import task_sums

    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
    sums = task_sums("classify", 2, logits, np.array([0, 0]), np.array([1.0, 0.0]))
    assert sums[1:].sum() == 1 and sums[1:].tolist() == [1, 0, 0, 0]  # row 0 right; the filler (wrong) unseen
    assert sums[0] == pytest.approx(F.cross_entropy(logits[:1], torch.tensor([0])).item())


def test_a_classifiers_val_loss_is_the_summed_cross_entropy_over_the_rows_scored():
    # 5 rows scored (the confusion matrix's total), their cross-entropies summed to 3.0
    sums = np.array([3.0, 2.0, 1.0, 0.0, 2.0])
    assert task_metrics("classify", 2, sums)["val/loss"] == pytest.approx(3.0 / 5)


def test_a_regressions_val_loss_is_the_mean_squared_error():
    labels = np.array([1.0, 2.0, 3.0, 9.0])
    weight = np.array([1.0, 1.0, 1.0, 0.0])  # a filler row counts in no sum
    sums = task_sums("regress", 0, torch.tensor([1.0, 2.0, 5.0, 0.0]), labels, weight, center=1.0)
    assert task_metrics("regress", 0, sums)["val/loss"] == pytest.approx((0 + 0 + 4) / 3)


def test_pearson_of_exactly_linear_columns_stays_within_minus_1_and_1():
    # rounding in the sums carries |r| of such columns a hair past 1 (1.0000000000000002 for these): it is clipped
    y = np.array([-0.1321048632913019, 0.6404226504432821, 0.10490011715303971, -0.535669373161111,
                  0.36159505490948474, 1.3040000451301372, 0.9470809631292422])
    for p, sign in ((y, 1.0), (3 * y + 1, 1.0), (-y, -1.0), (0.1 * y, 1.0)):
        pearson = regression_metrics(regression_sums(y, p))["pearson"]
        assert -1.0 <= pearson <= 1.0 and pearson == pytest.approx(sign, abs=1e-12)
