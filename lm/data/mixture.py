"""Which source of a weighted mixture each global training position reads, and which of its windows.

Position n draws from source s when u_n = (phase + n * G) mod 2^64 falls in s's share of [0, 2^64), the
shares being the normalised weights and G = 2^64 / golden ratio (a Weyl sequence). So:
- the source is a pure function of (seed, n), and counting a source's draws before any position is
  arithmetic on the integers below it, which is what lets a run resume, at any world size, from the
  position alone;
- the weights hold exactly in expectation (for a random phase, u_n is uniform for every n) and closely
  over any stretch of consecutive positions: consecutive multiples of G spread over [0, 2^64) as evenly
  as any sequence can, so 1,000 consecutive samples hold each source's share to within a few samples
  (tests/data/test_mixture.py measures the bound);
- source s's k-th draw reads window order_s(k // N_s)[k % N_s]: epoch e of a source is its draws
  e * N_s .. (e + 1) * N_s - 1, counted by that source alone, each a fresh permutation of its N_s windows,
  so no window repeats within a source's epoch and a small source cycles more often than a large one.
Source 0's permutations are those of a single data directory, so a one-source "mixture" reads exactly
what `data.dir` alone would.
"""

from collections.abc import Sequence
from fractions import Fraction

import numpy as np

__all__ = ["MixtureDraws", "exact_shares", "mixture_edges", "sample_order", "sources_at"]

_G = np.uint64(0x9E3779B97F4A7C15)  # round(2^64 / golden ratio), odd
_PHASE_KEY = 0x6D6978  # b"mix": keeps the phase's random stream apart from the orders'
_CHUNK = 1 << 20  # positions counted per numpy call when counting draws from scratch (8 MiB of uint64)


def sample_order(seed: int, epoch: int, num_samples: int, source: int = 0) -> np.ndarray:
    """The order in which `source`'s epoch `epoch` visits its samples: a permutation of 0..num_samples-1,
    (N,) int64. Source 0's is the single-directory order."""
    key = [seed, epoch] if source == 0 else [seed, epoch, source]
    return np.random.default_rng(key).permutation(num_samples)


def exact_shares(weights: Sequence[float]) -> list[Fraction]:
    """Each weight over their sum, exactly: floats are binary fractions, so no sum overflows or rounds."""
    exact = [Fraction(w) for w in weights]
    total = sum(exact)
    return [w / total for w in exact]


def mixture_edges(weights: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(edges, sources): source sources[i] owns [edges[i - 1], edges[i]) of [0, 2^64) (edges[-1] = 0 and the
    last one ends at 2^64), each share its weight over the sum. Only positive weights get a share, so a
    zero-weight source is never drawn. edges (P - 1,) uint64, sources (P,) int64 for P positive weights."""
    exact = exact_shares(weights)
    positive = [i for i, w in enumerate(exact) if w > 0]
    edges, running = [], Fraction(0)
    for i in positive[:-1]:
        running += exact[i]
        edges.append(int(running * 2**64))
    return np.array(edges, dtype=np.uint64), np.array(positive, dtype=np.int64)


def mixture_phase(seed: int) -> np.uint64:
    """The Weyl sequence's starting point for `seed`, uniform over [0, 2^64)."""
    return np.random.default_rng([seed, _PHASE_KEY]).integers(0, 2**64, dtype=np.uint64)


def sources_at(positions: np.ndarray, edges: np.ndarray, sources: np.ndarray, phase: np.uint64) -> np.ndarray:
    """The source each global position (n,) int64 draws from, (n,) int64 (see the module docstring)."""
    u = positions.astype(np.uint64) * _G + phase  # (n,): uint64 arithmetic wraps, i.e. is taken mod 2^64
    return sources[np.searchsorted(edges, u, side="right")]


class MixtureDraws:
    """Which source and which of its windows each global position reads; positions only move forward,
    so the draws counted so far are cached and a step only counts its own positions."""

    def __init__(self, weights: Sequence[float], num_samples: Sequence[int], seed: int) -> None:
        self.num_samples = [int(n) for n in num_samples]
        self.seed = seed
        self.edges, self.sources = mixture_edges(weights)
        self.phase = mixture_phase(seed)
        self._counted_to = 0  # draws of every source in positions [0, _counted_to)
        self._counts = np.zeros(len(self.num_samples), dtype=np.int64)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, its order), the latest used

    def sources_of(self, positions: np.ndarray) -> np.ndarray:
        """Source of each position (n,) int64."""
        if len(self.num_samples) == 1:
            return np.zeros(len(positions), dtype=np.int64)
        return sources_at(positions, self.edges, self.sources, self.phase)

    def draws_before(self, position: int) -> np.ndarray:
        """How many of positions [0, position) each source served, (S,) int64."""
        if len(self.num_samples) == 1:  # one directory serves every position: nothing to count
            return np.array([position], dtype=np.int64)
        if position < self._counted_to:  # a step back (never in training): count again from the start
            self._counted_to, self._counts = 0, np.zeros_like(self._counts)
        for start in range(self._counted_to, position, _CHUNK):
            chunk = np.arange(start, min(start + _CHUNK, position), dtype=np.int64)
            self._counts += np.bincount(self.sources_of(chunk), minlength=len(self._counts))
        self._counted_to = position
        return self._counts.copy()

    def locate(self, positions: range) -> tuple[np.ndarray, np.ndarray]:
        """(source (n,), window id within that source (n,)) of consecutive global positions."""
        where = np.arange(positions.start, positions.stop, dtype=np.int64)
        source = self.sources_of(where)
        draws = np.empty(len(where), dtype=np.int64)  # each position's draw number within its source
        before = self.draws_before(positions.start)
        for s in np.unique(source).tolist():
            mine = source == s
            draws[mine] = before[s] + np.arange(int(mine.sum()))
        window = np.array([self._window(s, k) for s, k in zip(source.tolist(), draws.tolist())], dtype=np.int64)
        return source, window

    def _window(self, source: int, draw: int) -> int:
        epoch, index = divmod(draw, self.num_samples[source])
        cached = self._orders.get(source)
        if cached is None or cached[0] != epoch:  # draws only grow, so one cached epoch per source suffices
            cached = (epoch, sample_order(self.seed, epoch, self.num_samples[source], source))
            self._orders[source] = cached
        return int(cached[1][index])
