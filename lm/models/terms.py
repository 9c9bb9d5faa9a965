"""A training loss as named terms: what a family's `loss` returns for one micro-batch.

Each term is a 0-dim tensor with how it combines over micro-batches, data-parallel ranks and pipeline stages
(`Reduce`). One of them is the objective, the one backward differentiates; the trainer logs every term by name
(`train/<name>` in the log line, metrics.jsonl and TensorBoard) and knows none of them, so a family adds a term
(a load-balancing loss, a router z-loss, a second head's loss) in its own code alone.

A next-token family returns {"loss": cross-entropy}; with optim.z_loss also "z_loss" (the mean log Z^2) and
"objective" (cross-entropy + z_loss x that term), the one optimized, so "loss" stays comparable with val/loss.
"""

import enum
from dataclasses import dataclass, replace

import torch


class Reduce(enum.Enum):
    """How a term combines over the micro-batches of a step, the data-parallel ranks and the pipeline stages
    (the ranks that hold a term; a tensor- or context-parallel group counts once). A logged window of steps
    averages their values, except MAX, which keeps its largest."""

    MEAN = "mean"
    """Weighted by each micro-batch's `weight` (the targets it averages over): a token-weighted mean"""
    SUM = "sum"
    """Added up (a count, say)"""
    MAX = "max"
    """The largest (the most loaded expert, say)"""


@dataclass(frozen=True)
class Term:
    """One named quantity of a micro-batch's loss."""

    value: torch.Tensor
    """0-dim; the objective keeps its graph, which backward differentiates"""
    reduce: Reduce = Reduce.MEAN
    weight: float = 1.0
    """What a MEAN term's value averages over in this micro-batch (its targets), so that micro-batches and ranks
    with more of them count more; 1 makes it a plain mean of means"""


@dataclass(frozen=True)
class Losses:
    """A micro-batch's terms by name, and which of them is optimized."""

    terms: dict[str, Term]
    objective: str = "loss"

    def __post_init__(self) -> None:
        if self.objective not in self.terms:
            raise ValueError(f"the objective {self.objective!r} is none of the terms {sorted(self.terms)}")

    @property
    def optimized(self) -> torch.Tensor:
        """What backward differentiates."""
        return self.terms[self.objective].value

    def detached(self) -> dict[str, Term]:
        """The terms, their values cut from the graph: what is logged."""
        return {name: replace(term, value=term.value.detach()) for name, term in self.terms.items()}


def mean_terms(weight: float, **values: torch.Tensor) -> dict[str, Term]:
    """Token-weighted mean terms sharing one `weight`, by name."""
    return {name: Term(value, Reduce.MEAN, weight) for name, value in values.items()}


def combine(micro_batches: list[dict[str, Term]]) -> dict[str, Term]:
    """A step's terms from its micro-batches' (detached) ones, each reduced as it says; a MEAN term's weight
    becomes the step's total. Equal weights give the plain mean of the values. Sums run in micro-batch order."""
    step = {}
    for name, first in micro_batches[0].items():
        terms = [terms[name] for terms in micro_batches]
        weights = [term.weight for term in terms]
        equal = len(set(weights)) == 1
        value = first.value if first.reduce is not Reduce.MEAN or equal else first.value * first.weight
        for term in terms[1:]:
            if first.reduce is Reduce.MAX:
                value = torch.maximum(value, term.value)
            else:
                value = value + (term.value if first.reduce is Reduce.SUM or equal else term.value * term.weight)
        if first.reduce is Reduce.MEAN:
            value = value / (len(terms) if equal else sum(weights))
        step[name] = Term(value, first.reduce, sum(weights))
    return step
