import itertools

import numpy as np
import pytest

from lm.data.span_corruption import (
    corrupt,
    corrupt_rows,
    corrupted_lengths,
    noise_mask,
    noise_masks,
    reconstruct,
    span_counts,
)

S0 = 1000  # sentinel_start in these tests: every token id is below it


def runs(mask: np.ndarray) -> list[tuple[bool, int]]:
    """(value, length) of every run of equal values, in order."""
    return [(bool(v), len(list(g))) for v, g in itertools.groupby(mask.tolist())]


def test_span_counts():
    assert span_counts(2) == (1, 1)  # round(0.3) = 0 noise tokens, raised to 1
    assert span_counts(17) == (3, 1)
    assert span_counts(129) == (19, 6)
    assert span_counts(512) == (77, 26)
    assert span_counts(10, noise_density=0.99) == (9, 1)  # one token is always kept, one gap only
    assert span_counts(100, noise_density=0.5, mean_span_length=1.0) == (50, 50)
    # round(3.5) = 4 noise tokens would make 4 spans, but the 3 kept tokens only fill 3 gaps
    assert span_counts(7, noise_density=0.5, mean_span_length=1.0) == (4, 3)
    assert corrupted_lengths(129) == (129 - 19 + 6, 19 + 6 + 1)


@pytest.mark.parametrize("args, message", [
    ((1,), "at least 2 tokens, got 1"),
    ((10, 0.0), r"noise_density must be in \(0, 1\), got 0.0"),
    ((10, 0.15, 0.5), "mean_span_length must be >= 1, got 0.5"),
])
def test_span_counts_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        span_counts(*args)


def test_noise_masks_pick_every_layout_equally_often():
    # 10 tokens, 5 noise in 2 runs and 5 kept in 2 runs: 4 splits of each, 16 layouts
    masks = noise_masks(10, np.random.default_rng(0).random((1600, 8)), 0.5, 2.5)
    layouts, counts = np.unique(masks, axis=0, return_counts=True)
    assert len(layouts) == 16 and counts.min() > 70 and counts.max() < 130  # 100 each expected
    assert all([v for v, _ in runs(m)] == [False, True, False, True] for m in layouts)
    with pytest.raises(ValueError, match=r"noise masks of 10 tokens take uniforms \(B, 8\), got \(2, 9\)"):
        noise_masks(10, np.zeros((2, 9)))


@pytest.mark.parametrize("length, density, mean", [
    (2, 0.15, 3.0), (17, 0.15, 3.0), (129, 0.15, 3.0), (512, 0.15, 3.0), (64, 0.5, 1.0), (33, 0.3, 8.0),
])
def test_noise_mask_has_exact_counts_and_alternating_runs(length, density, mean):
    num_noise, num_spans = span_counts(length, density, mean)
    for seed in range(20):
        mask = noise_mask(length, np.random.default_rng(seed), density, mean)
        assert mask.dtype == bool and mask.shape == (length,)
        assert int(mask.sum()) == num_noise
        values = [v for v, _ in runs(mask)]
        assert values == [False, True] * num_spans  # starts kept, alternates, ends with noise


def test_noise_mask_is_a_function_of_the_generator():
    def mask(seed, key):
        return noise_mask(129, np.random.default_rng([seed, key]))

    assert np.array_equal(mask(3, 17), mask(3, 17))
    masks = {mask(3, key).tobytes() for key in range(10)} | {mask(4, 0).tobytes()}
    assert len(masks) == 11


def test_corrupt_example():
    tokens = np.arange(10, 18)  # a b c d e f g h
    mask = np.array([0, 0, 1, 1, 0, 0, 1, 0], dtype=bool)  # noise: c d, g
    inputs, targets = corrupt(tokens, mask, S0)
    assert inputs.tolist() == [10, 11, S0, 14, 15, S0 + 1, 17]
    assert targets.tolist() == [S0, 12, 13, S0 + 1, 16, S0 + 2]
    assert inputs.dtype == targets.dtype == np.int64
    # a mask that starts with noise, and one without any
    inputs, targets = corrupt(tokens[:3], np.array([1, 0, 1], dtype=bool), S0)
    assert inputs.tolist() == [S0, 11, S0 + 1] and targets.tolist() == [S0, 10, S0 + 1, 12, S0 + 2]
    inputs, targets = corrupt(tokens[:3], np.zeros(3, dtype=bool), S0)
    assert inputs.tolist() == [10, 11, 12] and targets.tolist() == [S0]
    with pytest.raises(ValueError, match="same length"):
        corrupt(tokens, mask[:-1], S0)


def test_corrupt_rows_equals_corrupt_row_by_row():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, S0, (5, 40))
    masks = noise_masks(40, rng.random((5, 38)), 0.3, 2.0)
    inputs, targets = corrupt_rows(tokens, masks, S0)
    for row, mask, i, t in zip(tokens, masks, inputs, targets):
        expected = corrupt(row, mask, S0)
        assert np.array_equal(i, expected[0]) and np.array_equal(t, expected[1])
    uneven = np.array([[0, 1, 0], [0, 1, 1]], dtype=bool)
    with pytest.raises(ValueError, match="the same number of noise tokens and of noise runs"):
        corrupt_rows(np.zeros((2, 3)), uneven, S0)


def test_round_trip_and_lengths_for_random_windows():
    rng = np.random.default_rng(0)
    for _ in range(300):
        length = int(rng.integers(2, 700))
        density = float(rng.uniform(0.01, 0.9))
        mean = float(rng.uniform(1.0, 10.0))
        tokens = rng.integers(0, S0, length)
        mask = noise_mask(length, rng, density, mean)
        inputs, targets = corrupt(tokens, mask, S0)
        assert (len(inputs), len(targets)) == corrupted_lengths(length, density, mean)
        _, num_spans = span_counts(length, density, mean)
        assert targets[-1] == S0 + num_spans  # the end marker
        assert np.array_equal(reconstruct(inputs, targets, S0, num_spans + 1), tokens)


@pytest.mark.parametrize("inputs, targets, message", [
    ([1, S0 + 5], [S0 + 5, 2], r"inputs hold id 1005, neither a token \(< 1000\) nor a sentinel \(< 1005\)"),
    ([1, S0], [S0, -1, S0 + 1], "targets hold id -1"),
    ([1, S0], [2, S0, 3], "targets must start with a sentinel, got token 2"),
    ([1, S0], [S0, 2, S0, 3], "targets hold sentinel 0 twice"),
    ([S0, 1, S0], [S0, 2, S0 + 1], "inputs hold sentinel 0 twice"),
    ([1, S0 + 1], [S0, 2, S0 + 2], "inputs hold sentinel 1, which the targets lack"),
    ([1, S0], [S0, 2, S0 + 1, 3, S0 + 2], "targets hold tokens after sentinel 1, which the inputs lack"),
])
def test_reconstruct_rejects_malformed_pairs(inputs, targets, message):
    with pytest.raises(ValueError, match=message):
        reconstruct(np.array(inputs), np.array(targets), S0, 5)
