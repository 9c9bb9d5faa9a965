"""The bag-of-words baseline of a fine-tuning task: `python -m experiments.bow --file data/lines.csv`.

    python -m experiments.bow --file data/lines.csv [--val-fraction 0.1] [--num-classes 2]

A multinomial logistic regression on word features, scored on the very rows a fine-tuned head is scored on:
the file is read and split as `lm.finetune` reads and splits it (`read_labelled`, `split_examples` with the
same val fraction). Words are the lower-cased `\\w+` runs of a text; the vocabulary is the train rows' words
only (a val word never seen in training is dropped, as a tokenizer-free baseline must). Three feature sets:
counts, binary (present or not) and tf-idf (smoothed idf from the train rows, rows scaled to unit length).

Each feature set is fitted at every L2 strength of a grid, full batch with L-BFGS in float64 from zero
weights until the gradient vanishes (the objective is convex, so this is its one optimum): mean cross-entropy
+ l2 / 2 * |W|^2, the bias not penalised. The table gives each fit's train and val accuracy and val macro-F1
and marks the best val accuracy. That best one is picked on the val rows themselves, so it is an optimistic
figure for the baseline: a fine-tuned model is held to no such choice.
"""

import argparse
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lm.bench.common import print_table
from lm.cli import finite_float, positive_int, run
from lm.data.labelled import read_labelled, split_examples
from lm.report.metrics import classification_metrics, confusion_matrix

FEATURES = ("counts", "binary", "tfidf")
L2_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
_WORD = re.compile(r"\w+")
_MAX_ITER = 5000
_TOLERANCE_GRAD = 1e-7
_CONVERGED = 1e-5  # a fit whose largest |gradient| ends above this is reported as not converged


def words(text: str) -> list[str]:
    """The lower-cased word tokens of a text (runs of letters, digits and underscores)."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Features:
    """The train and val rows as sparse feature matrices over the train vocabulary."""

    train: torch.Tensor
    """(N_train, V) sparse float64"""
    val: torch.Tensor
    """(N_val, V) sparse float64"""
    vocab_size: int


def featurize(train_texts: Sequence[str], val_texts: Sequence[str], kind: str) -> Features:
    """Word features of `kind` (one of `FEATURES`) for the train and val texts, the vocabulary and the idf
    taken from the train texts alone."""
    train_counts = [Counter(words(t)) for t in train_texts]
    vocab = {w: i for i, w in enumerate(sorted(set().union(*train_counts)))}
    df = np.zeros(len(vocab))  # (V,) train rows holding each word
    for counts in train_counts:
        df[[vocab[w] for w in counts]] += 1
    idf = np.log((1 + len(train_texts)) / (1 + df)) + 1  # (V,) smoothed, as scikit-learn's TfidfTransformer

    def matrix(counts_of_rows: list[Counter]) -> torch.Tensor:
        rows, cols, values = [], [], []
        for r, counts in enumerate(counts_of_rows):
            known = [(vocab[w], n) for w, n in counts.items() if w in vocab]
            row = np.array([n for _, n in known], dtype=np.float64)
            col = np.array([c for c, _ in known], dtype=np.int64)
            if kind == "binary":
                row = np.ones_like(row)
            elif kind == "tfidf":
                row = row * idf[col]
                row = row / max(np.linalg.norm(row), 1e-12)
            rows += [r] * len(known)
            cols += col.tolist()
            values += row.tolist()
        index = torch.tensor([rows, cols], dtype=torch.int64).reshape(2, -1)
        return torch.sparse_coo_tensor(index, torch.tensor(values, dtype=torch.float64),
                                       (len(counts_of_rows), len(vocab)), check_invariants=True).coalesce()

    if kind not in FEATURES:
        raise ValueError(f"kind must be one of {FEATURES}, got {kind!r}")
    return Features(matrix(train_counts), matrix([Counter(words(t)) for t in val_texts]), len(vocab))


@dataclass(frozen=True)
class Fit:
    """A logistic regression fitted at one L2 strength, and its scores."""

    l2: float
    iterations: int
    max_grad: float
    """largest |gradient| of the objective at the end: ~0 when L-BFGS converged"""
    train_accuracy: float
    val_accuracy: float
    val_f1: float


def loss_and_gradients(x: torch.Tensor, x_t: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor, l2: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean cross-entropy + l2 / 2 * |W|^2 and its gradients (loss, dW (V, C), db (C,)) for x (N, V) and its
    transpose x_t (V, N), both sparse CSR, y (N,) int64 classes, W (V, C), b (C,).

    Written out rather than left to autograd: autograd's sparse matmul backward ran ~50x slower than this
    transposed CSR product on the development CPU, and an L-BFGS fit evaluates it hundreds of times."""
    logits = x @ weight + bias  # (N, C)
    log_p = torch.log_softmax(logits, dim=1)  # (N, C)
    rows = torch.arange(len(y))
    loss = -log_p[rows, y].mean() + l2 / 2 * weight.pow(2).sum()
    residual = log_p.exp()  # (N, C) softmax - one-hot, over N: the gradient of the mean loss at the logits
    residual[rows, y] -= 1
    residual /= len(y)
    return loss, x_t @ residual + l2 * weight, residual.sum(dim=0)


def fit_logistic(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                                          int, float]:
    """Minimise mean cross-entropy + l2 / 2 * |W|^2 over W (V, C), b (C,) for x (N, V) sparse and y (N,) int64
    classes, full batch with L-BFGS from zeros: (W, b, iterations, final max |gradient|)."""
    with warnings.catch_warnings():  # torch calls its sparse CSR support beta; these two products are all we use
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        x_csr, x_t = x.to_sparse_csr(), x.t().coalesce().to_sparse_csr()
    weight = torch.zeros(x.shape[1], num_classes, dtype=torch.float64)
    bias = torch.zeros(num_classes, dtype=torch.float64)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1, max_iter=_MAX_ITER, tolerance_grad=_TOLERANCE_GRAD,
                                  tolerance_change=1e-12, history_size=20, line_search_fn="strong_wolfe")

    def objective() -> torch.Tensor:
        loss, weight.grad, bias.grad = loss_and_gradients(x_csr, x_t, y, weight, bias, l2)
        return loss

    optimizer.step(objective)
    objective()
    max_grad = max(weight.grad.abs().max().item(), bias.grad.abs().max().item())
    return weight, bias, optimizer.state[weight]["n_iter"], max_grad


def predict(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> np.ndarray:
    """The most likely class of each row of x (N, V): (N,) int64."""
    return (torch.sparse.mm(x, weight) + bias).argmax(dim=1).numpy()


def l2_sweep(features: Features, train_labels: np.ndarray, val_labels: np.ndarray, num_classes: int,
             grid: Sequence[float] = L2_GRID) -> list[Fit]:
    """One fit per L2 strength of `grid`, scored on the train and val rows."""
    y = torch.from_numpy(np.asarray(train_labels, dtype=np.int64))
    fits = []
    for l2 in grid:
        weight, bias, iterations, max_grad = fit_logistic(features.train, y, num_classes, l2)
        train_accuracy = float((predict(features.train, weight, bias) == train_labels).mean())
        val = classification_metrics(confusion_matrix(val_labels, predict(features.val, weight, bias), num_classes))
        fits.append(Fit(l2, iterations, max_grad, train_accuracy, val["accuracy"], val["f1"]))
    return fits


def best_fit(results: dict[str, list[Fit]]) -> tuple[str, Fit]:
    """The feature set and fit of the highest val accuracy, ties going to the higher macro-F1, then to the
    first in table order."""
    ranked = [(kind, fit) for kind, fits in results.items() for fit in fits]
    return max(ranked, key=lambda pair: (pair[1].val_accuracy, pair[1].val_f1))


def bow_baseline(path: str, val_fraction: float, num_classes: int, text_column: str = "text",
                 label_column: str = "label", features: Sequence[str] = FEATURES,
                 grid: Sequence[float] = L2_GRID) -> dict:
    """Read and split a labelled file as fine-tuning does and sweep every feature set over the L2 grid:
    {"train_idx", "val_idx" (the split_examples indices), "vocab_size", "fits": {kind: [Fit, ...]}}."""
    texts, labels = read_labelled(path, text_column, label_column, "classify", num_classes)
    train_idx, val_idx = split_examples(len(texts), val_fraction)
    train_texts, val_texts = [texts[i] for i in train_idx], [texts[i] for i in val_idx]
    fits, vocab_size = {}, 0
    for kind in features:
        found = featurize(train_texts, val_texts, kind)
        vocab_size = found.vocab_size
        fits[kind] = l2_sweep(found, labels[train_idx], labels[val_idx], num_classes, grid)
    return {"train_idx": train_idx, "val_idx": val_idx, "vocab_size": vocab_size, "fits": fits}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bow", description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", required=True, help="the labelled file fine-tuning reads (task.file)")
    parser.add_argument("--val-fraction", type=finite_float, default=0.1,
                        help="rows held out for validation, as task.val_fraction (the same rows)")
    parser.add_argument("--num-classes", type=positive_int, default=2, help="classes, as model.num_classes")
    parser.add_argument("--text-column", default="text", help="as task.text_column")
    parser.add_argument("--label-column", default="label", help="as task.label_column")
    args = parser.parse_args(argv)
    if not 0.0 < args.val_fraction < 1.0:
        parser.error(f"--val-fraction: must be in (0, 1), got {args.val_fraction}")
    if args.num_classes < 2:
        parser.error(f"--num-classes: a classifier needs at least 2, got {args.num_classes}")
    torch.set_flush_denormal(True)
    # one thread: L-BFGS's thousands of dot products of ~10^4 numbers ran 500x slower on 2 threads of a busy
    # 2-core machine (BLAS threads waiting on each other) than on one, and this problem gains nothing from more
    torch.set_num_threads(1)
    start = time.perf_counter()
    found = bow_baseline(args.file, args.val_fraction, args.num_classes, args.text_column, args.label_column)
    seconds = time.perf_counter() - start
    best_kind, best = best_fit(found["fits"])
    rows = []
    for kind, fits in found["fits"].items():
        for fit in fits:
            mark = "<- best" if fit is best else ""
            rows.append([kind, f"{fit.l2:g}", str(fit.iterations), f"{fit.max_grad:.0e}", f"{fit.train_accuracy:.2%}",
                         f"{fit.val_accuracy:.2%}", f"{fit.val_f1:.4f}", mark])
    print_table(f"bag-of-words logistic regression on {args.file}: {len(found['train_idx'])} train rows, "
                f"{len(found['val_idx'])} val rows (split_examples, val fraction {args.val_fraction}), "
                f"{found['vocab_size']:,} train words", ["features", "l2", "L-BFGS iters", "max |grad|",
                                                         "train acc", "val acc", "val macro-F1", ""], rows)
    print(f"\nbest: {best_kind}, l2 {best.l2:g}: val accuracy {best.val_accuracy:.2%}, macro-F1 {best.val_f1:.4f} "
          "(chosen on the val rows themselves, so optimistic for the baseline)")
    unconverged = [f"{kind} l2 {fit.l2:g}" for kind, fits in found["fits"].items() for fit in fits
                   if not fit.max_grad <= _CONVERGED]
    if unconverged:
        print(f"not converged (max |grad| > {_CONVERGED:g}): {', '.join(unconverged)}")
    print(f"{seconds:.1f} s, reading and features included (1 thread)")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
