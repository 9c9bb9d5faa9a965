"""Weighted mixtures: each position's source and window as a pure function of (seed, position)."""

import numpy as np
import pytest

from lm.data.loader import TokenLoader
from lm.data.mixture import MixtureDraws, exact_shares, mixture_edges, mixture_phase, sample_order, sources_at
from tests.data.test_loader import make_data_dir

T = 4
WEIGHTS = [[1, 1], [3, 1], [0.7, 0.2, 0.1], [1, 2, 3, 4], [0.999, 0.001], [5, 0, 1]]


def shares(weights):
    return np.array(weights, dtype=float) / sum(weights)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_any_1000_consecutive_samples_hold_each_weight_to_within_3_samples(weights):
    n = 200_000
    for seed in range(3):
        edges, sources = mixture_edges(weights)
        drawn = sources_at(np.arange(n), edges, sources, mixture_phase(seed))
        for s, share in enumerate(shares(weights)):
            running = np.concatenate([[0], np.cumsum(drawn == s)])  # (n + 1,)
            per_window = running[1000:] - running[:-1000]  # draws of s in positions [i, i + 1000)
            assert np.abs(per_window - 1000 * share).max() <= 3, (weights, seed, s)
            # and the long-run share converges as 1/n: no bias
            assert abs(running[-1] / n - share) <= 3 / n


def test_a_zero_weight_source_is_never_drawn_and_shares_are_exact_fractions():
    edges, sources = mixture_edges([5, 0, 1])
    assert sources.tolist() == [0, 2] and edges.tolist() == [2**64 * 5 // 6]
    assert set(sources_at(np.arange(10_000), edges, sources, mixture_phase(0)).tolist()) == {0, 2}


def test_weights_near_the_float_limit_share_as_any_equal_pair_does():
    # a float sum of two weights of 1e308 overflows to inf; the shares are summed exactly
    assert exact_shares([1e308, 1e308]) == [0.5, 0.5] and exact_shares([1e308, 0.0]) == [1, 0]
    assert mixture_edges([1e308, 1e308])[0].tolist() == mixture_edges([1, 1])[0].tolist() == [2**63]


def test_one_source_reads_exactly_the_single_directory_order():
    draws = MixtureDraws([1.0], [7], seed=3)
    _, window = draws.locate(range(0, 21))
    assert window.tolist() == [int(i) for e in range(3) for i in sample_order(3, e, 7)]


def test_each_source_reads_its_own_order_of_its_seed():
    # two sources of one size: the same order for both would read them in lockstep, and a resumed run's sources
    # after the first would read another order than the one it started with
    draws = MixtureDraws([1, 1], [40, 40], seed=3)
    source, window = draws.locate(range(0, 160))
    for s in (0, 1):
        mine = window[source == s]
        assert mine.tolist() == [int(i) for e in range(2) for i in sample_order(3, e, 40, source=s)][:len(mine)]
    assert not np.array_equal(sample_order(3, 0, 40, source=0), sample_order(3, 0, 40, source=1))


def test_no_window_repeats_within_an_epoch_of_its_source_and_sources_cycle_on_their_own():
    draws = MixtureDraws([1, 1], [5, 50], seed=0)  # the small source runs out ten times as often
    source, window = draws.locate(range(0, 200))
    small = window[source == 0]
    epochs = [small[i:i + 5] for i in range(0, len(small) - len(small) % 5, 5)]
    assert len(epochs) >= 15 and all(sorted(e.tolist()) == list(range(5)) for e in epochs)
    large = window[source == 1]
    assert len(set(large[:50].tolist())) == min(50, len(large))
    assert draws.draws_before(200).tolist() == [int((source == 0).sum()), int((source == 1).sum())]


def test_the_stream_is_a_function_of_the_seed():
    def stream(seed):
        return MixtureDraws([0.7, 0.2, 0.1], [13, 7, 3], seed).locate(range(0, 300))

    assert all(np.array_equal(a, b) for a, b in zip(stream(5), stream(5)))
    assert not np.array_equal(stream(5)[0], stream(6)[0])  # another seed, another phase: other sources


def test_locating_from_any_position_equals_walking_there():
    walked = MixtureDraws([0.7, 0.2, 0.1], [13, 7, 3], seed=5)
    stream = [walked.locate(range(p, p + 8)) for p in range(0, 400, 8)]
    for start in (0, 96, 392):  # a fresh object, as a resumed run builds, knows only the position
        fresh = MixtureDraws([0.7, 0.2, 0.1], [13, 7, 3], seed=5)
        for got, want in zip((fresh.locate(range(p, p + 8)) for p in range(start, 400, 8)), stream[start // 8:]):
            assert all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.fixture
def sources(tmp_path):
    # T=4: 6 windows from 0..24, 12 from 10000..10048
    return [make_data_dir(tmp_path / "a", [25]), make_data_dir(tmp_path / "b", [49], base=10_000)]


def mixed(sources, rank, world, micro, weights=(3, 1), batch=8):
    return TokenLoader(sources, "train", T, 11, rank, world, batch, micro, weights=list(weights))


def firsts(batches) -> list[int]:
    return [int(v) for x, _ in batches for v in x[:, 0]]


def test_a_mixture_loader_reads_the_same_samples_at_any_world_size_and_after_resume(sources):
    one = mixed(sources, 0, 1, 2)
    whole = [firsts(one.next_batch()) for _ in range(12)]  # 96 samples: several epochs of each source
    # 2 ranks for 4 steps, then 1 rank (another micro-batch) for 4, then 2 ranks again: resumed from the position
    stream, state = [], {"position": 0}
    for world, micro, steps in ((2, 2, 4), (1, 4, 4), (2, 1, 4)):
        ranks = [mixed(sources, r, world, micro) for r in range(world)]
        for r in ranks:
            r.load_state_dict(state)
        for _ in range(steps):
            parts = [firsts(r.next_batch()) for r in ranks]
            stream.append([v for part in parts for v in part])
        state = ranks[0].state_dict()
    assert stream == whole
    draws = one.draws_per_source().tolist()
    assert sum(draws) == 96 and draws == [sum(v < 10_000 for s in whole for v in s), sum(v >= 10_000 for s in whole
                                                                                        for v in s)]
    assert abs(draws[0] - 72) <= 3  # weights 3:1


def test_windows_come_whole_from_one_source(sources):
    for x, y in mixed(sources, 0, 1, 8).next_batch():
        rows = np.concatenate([x, y[:, -1:]], axis=1)  # (B, T + 1)
        assert (np.diff(rows, axis=1) == 1).all()  # consecutive tokens of one shard
        assert ((rows < 10_000).all(axis=1) | (rows >= 10_000).all(axis=1)).all()


def test_a_loader_over_one_directory_is_unchanged_by_the_mixture_code(sources):
    plain = TokenLoader(sources[0], "train", T, 11, 0, 1, 8, 2)
    assert firsts(plain.next_batch()) == [int(i) * T for i in sample_order(11, 0, 6)] + [
        int(i) * T for i in sample_order(11, 1, 6)[:2]]
