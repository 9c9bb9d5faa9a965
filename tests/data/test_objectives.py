import numpy as np
import pytest

from lm.data.loader import SplitWindows, TokenLoader, val_batches
from lm.data.objectives import MaskedLM, NextToken, SpanCorruption
from lm.data.span_corruption import corrupt, corrupted_lengths, noise_mask, reconstruct
from lm.errors import ConfigError

VOCAB = 50257


def span_objective(seed=0, window_len=33, n_sentinels=10) -> SpanCorruption:
    return SpanCorruption(seed, VOCAB, n_sentinels, VOCAB + n_sentinels, window_len)


def assert_reconstructs(batch, rows, spec):
    """Every row's source and target give back the row, and tgt_in is tgt_out behind the start token.

    `spec` (a SpanCorruption) names the number of sentinels and the pad id."""
    src, tgt_in, tgt_out = batch
    sentinels, pad = spec.n_sentinels, spec.pad_id
    assert np.array_equal(tgt_in[:, 0], np.full(len(rows), pad))
    assert np.array_equal(tgt_in[:, 1:], tgt_out[:, :-1])
    for s, t, row in zip(src, tgt_out, rows):
        assert np.array_equal(reconstruct(s, t, VOCAB, sentinels), row)


def test_next_token():
    rows = np.arange(10, dtype=np.int64).reshape(2, 5)
    x, y = NextToken()(rows, np.array([3, 4]))
    assert x.dtype == y.dtype == np.int64 and x.flags.c_contiguous and y.flags.c_contiguous
    assert x.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]] and y.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]


def test_span_corruption_batch():
    objective = span_objective()
    rows = np.random.default_rng(0).integers(0, VOCAB, (6, 33))
    batch = objective(rows, np.arange(100, 106))
    s, u = objective.lengths
    assert (s, u) == corrupted_lengths(33) == (33 - 5 + 2, 5 + 2 + 1)
    assert [t.shape for t in batch] == [(6, s), (6, u), (6, u)]
    assert all(a.dtype == np.int64 for a in batch)
    assert_reconstructs(batch, rows, objective)


def test_span_corruption_depends_only_on_seed_and_key():
    objective = span_objective()
    rows = np.tile(np.arange(33), (4, 1))  # identical rows: only the keys tell them apart
    src, _, tgt = objective(rows, np.array([7, 8, 9, 7]))
    assert np.array_equal(src[0], src[3]) and np.array_equal(tgt[0], tgt[3])
    assert not np.array_equal(src[0], src[1]) and not np.array_equal(src[1], src[2])
    alone, _, _ = objective(rows[:1], np.array([8]))
    assert np.array_equal(alone[0], src[1])  # the rest of the batch does not matter
    expected = corrupt(rows[1], noise_mask(33, np.random.default_rng([0, 8])), VOCAB)
    assert src[1].tolist() == expected[0].tolist() and tgt[1].tolist() == expected[1].tolist()
    other_seed, _, _ = span_objective(seed=1)(rows[:1], np.array([7]))
    assert not np.array_equal(other_seed[0], src[0])
    with pytest.raises(ValueError, match=r"rows \(B, 33\) and keys \(B,\), got \(4, 32\) and \(4,\)"):
        objective(rows[:, :-1], np.arange(4))


def test_too_few_sentinels_is_a_config_error():
    message = ("model.n_sentinels: 5 sentinels do not fit data.seq_len=128: its windows of 129 tokens have "
               "6 noise spans and need 7 sentinels (6 spans + 1 end marker)")
    with pytest.raises(ConfigError) as error:
        SpanCorruption(0, VOCAB, 5, VOCAB + 5, 129)
    assert str(error.value) == message
    SpanCorruption(0, VOCAB, 7, VOCAB + 7, 129)  # exactly enough


def test_on_prepared_data_through_the_loader(tiny_data_dir):
    objective = span_objective(window_len=65, n_sentinels=8)  # windows of 65 tokens: 10 noise tokens in 3 spans
    spans = TokenLoader(tiny_data_dir, "train", 64, 0, 0, 1, 8, 4, objective)
    plain = TokenLoader(tiny_data_dir, "train", 64, 0, 0, 1, 8, 4)
    for _ in range(3):
        for batch, (x, y) in zip(spans.next_batch(), plain.next_batch()):
            rows = np.concatenate([x, y[:, -1:]], axis=1)  # (B, 65): the windows themselves
            assert batch[0].shape == (4, 65 - 10 + 3) and batch[2].shape == (4, 10 + 3 + 1)
            assert int(batch[0].max()) < objective.pad_id
            assert_reconstructs(batch, rows, objective)

    windows = SplitWindows(tiny_data_dir, "val", 64)
    for i, batch in enumerate(val_batches(windows, 4, 0, 1, 5, objective)):
        ids = np.arange(4 * i, 4 * i + 4)
        assert_reconstructs(batch, windows.read_rows(ids), objective)
        assert np.array_equal(batch[0], objective(windows.read_rows(ids), ids)[0])  # keyed by sample id


def test_next_token_document_positions_are_those_of_the_inputs():
    # eot = 0. Row 0: x = [5, 0, 7, 8], y = [0, 7, 8, 9]; the end-of-text at x[1] opens the next document.
    # Row 1: x = [0, 6, 0, 2]; its second end-of-text opens a third document. Positions are read from x, not y.
    rows = np.array([[5, 0, 7, 8, 9],
                     [0, 6, 0, 2, 3]])
    x, y, positions = NextToken(document_eot=0)(rows, np.arange(2))
    assert x.tolist() == [[5, 0, 7, 8], [0, 6, 0, 2]]
    assert y.tolist() == [[0, 7, 8, 9], [6, 0, 2, 3]]
    assert positions.tolist() == [[0, 0, 1, 2], [0, 1, 0, 1]]


def test_span_corruption_needs_one_sentinel_more_than_it_has_spans():
    # windows of 17 tokens have 1 noise span: its sentinel and the end marker need 2 sentinels
    with pytest.raises(ConfigError, match=r"model.n_sentinels: 1 sentinels do not fit data.seq_len=16: its windows of "
                                          r"17 tokens have 1 noise spans and need 2 sentinels"):
        SpanCorruption(0, 100, 1, 0, 17)
    SpanCorruption(0, 100, 2, 0, 17)


@pytest.mark.parametrize("mask_id, cls_id", [(10, 3), (3, 10), (11, 11)])
def test_masked_lm_refuses_mask_or_cls_ids_inside_the_vocabulary(mask_id, cls_id):
    # vocabulary of 10 ids (0..9): [MASK] and [CLS] must be two distinct ids from 10 on
    with pytest.raises(ValueError, match=r"must be two ids after the tokenizer's 10"):
        MaskedLM(0, 10, mask_id, cls_id, 0.5, 0.8, 0.1)
    MaskedLM(0, 10, 10, 11, 0.5, 0.8, 0.1)
