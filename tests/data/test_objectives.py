import numpy as np
import pytest
import torch

from lm.data.loader import SplitWindows, TokenLoader, val_batches
from lm.data.objectives import NextToken, SpanCorruption, build_objective
from lm.data.span_corruption import corrupt, corrupted_lengths, noise_mask, reconstruct
from lm.models.config import ConfigError, ModelConfig

VOCAB = 50257


def encdec(**overrides) -> ModelConfig:
    return ModelConfig(**{"arch": "encdec", "vocab_size": VOCAB, "pos": "sinusoidal", **overrides})


def span_objective(seed=0, window_len=33, n_sentinels=10) -> SpanCorruption:
    return SpanCorruption(seed, VOCAB, n_sentinels, VOCAB + n_sentinels, window_len)


def assert_reconstructs(batch, rows, spec):
    """Every row's source and target give back the row, and tgt_in is tgt_out behind the start token.

    `spec` (a ModelConfig or a SpanCorruption) names the number of sentinels and the pad id."""
    src, tgt_in, tgt_out = batch
    sentinels, pad = spec.n_sentinels, spec.pad_id
    assert torch.equal(tgt_in[:, 0], torch.full((len(rows),), pad))
    assert torch.equal(tgt_in[:, 1:], tgt_out[:, :-1])
    for s, t, row in zip(src.numpy(), tgt_out.numpy(), rows):
        assert np.array_equal(reconstruct(s, t, VOCAB, sentinels), row)


def test_next_token():
    rows = np.arange(10, dtype=np.int64).reshape(2, 5)
    x, y = NextToken()(rows, np.array([3, 4]))
    assert x.dtype == y.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
    assert x.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]] and y.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]


def test_span_corruption_batch():
    objective = span_objective()
    rows = np.random.default_rng(0).integers(0, VOCAB, (6, 33))
    batch = objective(rows, np.arange(100, 106))
    s, u = objective.lengths
    assert (s, u) == corrupted_lengths(33) == (33 - 5 + 2, 5 + 2 + 1)
    assert [t.shape for t in batch] == [(6, s), (6, u), (6, u)]
    assert all(t.dtype == torch.int64 for t in batch)
    assert_reconstructs(batch, rows, objective)


def test_span_corruption_depends_only_on_seed_and_key():
    objective = span_objective()
    rows = np.tile(np.arange(33), (4, 1))  # identical rows: only the keys tell them apart
    src, _, tgt = objective(rows, np.array([7, 8, 9, 7]))
    assert torch.equal(src[0], src[3]) and torch.equal(tgt[0], tgt[3])
    assert not torch.equal(src[0], src[1]) and not torch.equal(src[1], src[2])
    alone, _, _ = objective(rows[:1], np.array([8]))
    assert torch.equal(alone[0], src[1])  # the rest of the batch does not matter
    expected = corrupt(rows[1], noise_mask(33, np.random.default_rng([0, 8])), VOCAB)
    assert src[1].tolist() == expected[0].tolist() and tgt[1].tolist() == expected[1].tolist()
    other_seed, _, _ = span_objective(seed=1)(rows[:1], np.array([7]))
    assert not torch.equal(other_seed[0], src[0])
    with pytest.raises(ValueError, match=r"rows \(B, 33\) and keys \(B,\), got \(4, 32\) and \(4,\)"):
        objective(rows[:, :-1], np.arange(4))


def test_from_config_and_build_objective():
    cfg = encdec(n_sentinels=20)
    objective = SpanCorruption.from_config(cfg, 128, seed=3)
    assert (objective.seed, objective.sentinel_start, objective.n_sentinels, objective.pad_id) == (
        3, VOCAB, 20, VOCAB + 20)
    assert objective.window_len == 129 and objective.lengths == corrupted_lengths(129)
    assert isinstance(build_objective(cfg, 128, 3), SpanCorruption)
    assert isinstance(build_objective(ModelConfig(), 128, 3), NextToken)


def test_too_few_sentinels_is_a_config_error():
    message = ("model.n_sentinels: 5 sentinels do not fit data.seq_len=128: its windows of 129 tokens have "
               "6 noise spans and need 7 sentinels (6 spans + 1 end marker)")
    with pytest.raises(ConfigError) as error:
        build_objective(encdec(n_sentinels=5), 128, 0)
    assert str(error.value) == message
    SpanCorruption.from_config(encdec(n_sentinels=7), 128, 0)  # exactly enough


def test_block_size_shorter_than_the_source_is_a_config_error():
    # windows of 5 tokens: 1 noise token in 1 span, so the source is as long as the window
    with pytest.raises(ConfigError, match=r"model.block_size: 4 is shorter .* data.seq_len=4 \(source, target "
                                          r"lengths \(5, 3\)\)"):
        SpanCorruption.from_config(encdec(block_size=4), 4, 0)


def test_on_prepared_data_through_the_loader(tiny_data_dir):
    cfg = encdec(n_sentinels=8)
    objective = SpanCorruption.from_config(cfg, 64, seed=0)  # windows of 65 tokens: 10 noise tokens in 3 spans
    spans = TokenLoader(tiny_data_dir, "train", 64, 0, 0, 1, 8, 4, objective)
    plain = TokenLoader(tiny_data_dir, "train", 64, 0, 0, 1, 8, 4)
    for _ in range(3):
        for batch, (x, y) in zip(spans.next_batch(), plain.next_batch()):
            rows = torch.cat([x, y[:, -1:]], dim=1).numpy()  # (B, 65): the windows themselves
            assert batch[0].shape == (4, 65 - 10 + 3) and batch[2].shape == (4, 10 + 3 + 1)
            assert int(batch[0].max()) < cfg.pad_id
            assert_reconstructs(batch, rows, cfg)

    windows = SplitWindows(tiny_data_dir, "val", 64)
    for i, batch in enumerate(val_batches(windows, 4, 0, 1, 5, objective)):
        ids = np.arange(4 * i, 4 * i + 4)
        assert_reconstructs(batch, windows.read_rows(ids), cfg)
        assert torch.equal(batch[0], objective(windows.read_rows(ids), ids)[0])  # keyed by sample id
