import numpy as np
import pytest

from lm.data.config import DataConfig
from lm.data.loader import TokenLoader
from lm.data.masking import IGNORE, mask_rows, masking_draws, replacement_counts, target_count
from lm.data.objectives import MaskedLM
from lm.errors import ConfigError

VOCAB = 1000
MASK, CLS = VOCAB, VOCAB + 1


def objective(rate=0.3, mask=1.0, random=0.0, seed=0) -> MaskedLM:
    return MaskedLM(seed, VOCAB, MASK, CLS, rate, mask, random)


def windows(batch=8, window=65, seed=1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, window))


def test_masked_lm_batch():
    rows = windows()
    ids, labels = objective()(rows, np.arange(8))
    assert ids.shape == labels.shape == (8, 64) and ids.dtype == labels.dtype == np.int64
    k = round(0.3 * 63)  # 19 of the 63 positions after [CLS]
    targets = labels != IGNORE
    assert targets.sum(axis=1).tolist() == [k] * 8
    assert (ids[:, 0] == CLS).all() and not targets[:, 0].any()
    assert np.array_equal(labels[targets], rows[:, :64][targets])  # the original ids at the targets
    assert (ids[targets] == MASK).all()  # ModernBERT's default: every target is [MASK]
    assert np.array_equal(ids[:, 1:][~targets[:, 1:]], rows[:, 1:64][~targets[:, 1:]])  # the rest unchanged


def test_deterministic_and_keyed():
    rows, keys = windows(), np.arange(100, 108)
    first, again = objective()(rows, keys), objective()(rows, keys)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    same = np.tile(rows[:1], (3, 1))  # identical windows: only the keys tell them apart
    ids, _ = objective()(same, np.array([5, 6, 5]))
    assert np.array_equal(ids[0], ids[2]) and not np.array_equal(ids[0], ids[1])
    other_seed, _ = objective(seed=1)(same[:1], np.array([5]))
    assert not np.array_equal(other_seed[0], ids[0])


@pytest.mark.parametrize("cut", [1, 3, 5, 7])
def test_any_split_of_the_batch_gives_the_same_rows(cut):
    """What a 2-rank run sees: each rank corrupts its part of the batch, in either order."""
    spec = objective(0.15, 0.8, 0.1)
    rows, keys = windows(), np.arange(40, 48)
    whole = spec(rows, keys)
    head, tail = spec(rows[:cut], keys[:cut]), spec(rows[cut:], keys[cut:])
    for full, a, b in zip(whole, head, tail):
        assert np.array_equal(full, np.concatenate([a, b]))
    order = np.random.default_rng(cut).permutation(8)  # any order of the rows
    for full, part in zip(whole, spec(rows[order], keys[order])):
        assert np.array_equal(full[order], part)


def test_bert_split_gives_exact_counts():
    rows = windows(batch=16, window=129)
    ids, labels = objective(0.15, 0.8, 0.1)(rows, np.arange(16))
    k = round(0.15 * 127)  # 19
    n_mask, n_random = round(0.8 * k), round(0.1 * k)  # 15, 2
    targets = labels != IGNORE
    assert targets.sum(axis=1).tolist() == [k] * 16
    assert ((ids == MASK) & targets).sum(axis=1).tolist() == [n_mask] * 16
    assert not ((ids == MASK) & ~targets).any()
    # the other targets hold a random id or their own; a random draw equals the original 1 time in VOCAB
    unmasked = targets & (ids != MASK)
    assert (unmasked.sum(axis=1) == k - n_mask).all()
    assert ((ids >= 0) & (ids < VOCAB))[unmasked].all()
    changed = (unmasked & (ids != rows[:, :128])).sum(axis=1)
    assert changed.sum() >= 16 * n_random - 2 and (changed <= n_random).all()


def test_random_replacements_are_drawn_from_the_tokenizer_ids():
    rows = np.full((64, 33), 7)
    ids, labels = objective(0.5, 0.0, 1.0)(rows, np.arange(64))
    replaced = ids[labels != IGNORE]
    assert replaced.size == 64 * 16 and replaced.min() >= 0 and replaced.max() < VOCAB
    assert len(np.unique(replaced)) > 500  # 1,024 draws of 1,000 ids cover most of them
    assert (labels[labels != IGNORE] == 7).all()


def test_same_as_the_pure_functions():
    rows, keys = windows(batch=3, window=17), np.array([9, 2, 4])
    k = target_count(16, 0.15)
    n_mask, n_random = replacement_counts(k, 0.8, 0.1)
    uniforms, random_ids = masking_draws(3, keys, 16, n_random, VOCAB)
    expected = mask_rows(rows[:, :16], uniforms, random_ids, k, n_mask, MASK, CLS)
    for a, b in zip(MaskedLM(3, VOCAB, MASK, CLS, 0.15, 0.8, 0.1)(rows, keys), expected):
        assert np.array_equal(a, b)


def test_mask_rows_by_hand():
    tokens = np.array([[10, 11, 12, 13, 14]])
    uniforms = np.array([[0.9, 0.1, 0.5, 0.3]])  # positions 1..4 ranked 2, 4, 3, 1
    ids, labels = mask_rows(tokens, uniforms, np.array([[77]]), 3, 1, MASK, CLS)
    assert ids.tolist() == [[CLS, 11, MASK, 13, 77]]  # 2 masked, 4 random, 3 kept; 1 not a target
    assert labels.tolist() == [[IGNORE, IGNORE, 12, 13, 14]]


@pytest.mark.parametrize(("seq_len", "rate", "k"), [
    (2, 0.01, 1), (2, 0.99, 1), (64, 0.001, 1), (64, 0.999, 63), (64, 0.3, 19), (512, 0.3, 153)])
def test_rates_near_the_limits(seq_len, rate, k):
    assert target_count(seq_len, rate) == k
    ids, labels = objective(rate)(windows(batch=2, window=seq_len + 1), np.arange(2))
    assert ((labels != IGNORE).sum(axis=1) == k).all() and labels[:, 0].tolist() == [IGNORE, IGNORE]


def test_replacement_counts():
    assert replacement_counts(10, 0.8, 0.1) == (8, 1)
    assert replacement_counts(3, 0.5, 0.5) == (2, 1)  # round(1.5) twice would be 4 of 3
    assert replacement_counts(7, 1.0, 0.0) == (7, 0) and replacement_counts(7, 0.0, 0.0) == (0, 0)


def test_windows_too_short():
    with pytest.raises(ConfigError, match=r"data.seq_len: masked LM needs windows of at least 2 tokens"):
        objective()(windows(window=2), np.arange(8))
    with pytest.raises(ValueError, match=r"rows \(B, T \+ 1\) and keys \(B,\)"):
        objective()(windows(), np.arange(3))


def test_defaults_are_modernberts():
    cfg = DataConfig()
    assert (cfg.mlm_rate, cfg.mlm_mask_fraction, cfg.mlm_random_fraction) == (0.3, 0.8, 0.1)
    DataConfig(mlm_rate=0.15, mlm_mask_fraction=0.8, mlm_random_fraction=0.1)  # BERT's
    DataConfig(mlm_mask_fraction=0.0, mlm_random_fraction=1.0)


@pytest.mark.parametrize(("keys", "message"), [
    ({"mlm_rate": 0.0}, "data.mlm_rate: must be in (0, 1), got 0.0"),
    ({"mlm_rate": 1.0}, "data.mlm_rate: must be in (0, 1), got 1.0"),
    ({"mlm_mask_fraction": -0.1}, "data.mlm_mask_fraction: must be in [0, 1], got -0.1"),
    ({"mlm_random_fraction": 1.5}, "data.mlm_random_fraction: must be in [0, 1], got 1.5"),
    ({"mlm_mask_fraction": 0.8, "mlm_random_fraction": 0.3},
     "data.mlm_mask_fraction + data.mlm_random_fraction: the shares of targets shown as [MASK] and as a random "
     "token must sum to at most 1, got 0.8 + 0.3"),
])
def test_config_refusals(keys, message):
    with pytest.raises(ConfigError) as error:
        DataConfig(**keys)
    assert str(error.value) == message
    with pytest.raises(ConfigError):
        objective(keys.get("mlm_rate", 0.3), keys.get("mlm_mask_fraction", 1.0), keys.get("mlm_random_fraction", 0.0))


def test_through_the_loader_at_two_world_sizes(tiny_data_dir):
    """Positions key the masking, so 2 ranks' micro-batches, concatenated, are the 1-rank run's batch."""
    spec = MaskedLM(0, 50257, 50257, 50258, 0.15, 0.8, 0.1)
    alone = TokenLoader(tiny_data_dir, "train", 16, 0, 0, 1, 8, 4, spec)
    ranks = [TokenLoader(tiny_data_dir, "train", 16, 0, r, 2, 8, 2, spec) for r in range(2)]
    for _ in range(3):
        one = alone.next_batch()
        two = [batch for loader in ranks for batch in loader.next_batch()]
        for i in range(2):
            assert np.array_equal(np.concatenate([b[i] for b in one]), np.concatenate([b[i] for b in two]))
    ids, labels = one[0]
    assert ids.shape == (4, 16) and ((labels != IGNORE).sum(axis=1) == 2).all()  # round(0.15 * 15) = 2


def test_document_positions_come_from_the_unmasked_window():
    from lm.data.objectives import MaskedLM, document_positions

    rows = np.array([[7, 3, 0, 4, 5, 0, 6, 2, 9]], dtype=np.int64)  # 0: end-of-text; a window of 8 + 1 tokens
    plain = MaskedLM(3, 10, 10, 11, 0.5, 1.0, 0.0)
    ids, labels, keep, positions = MaskedLM(3, 10, 10, 11, 0.5, 1.0, 0.0, document_eot=0)(rows, np.array([4]))
    expected_ids, expected_labels = plain(rows, np.array([4]))
    assert np.array_equal(ids, expected_ids) and np.array_equal(labels, expected_labels)
    assert keep.dtype == bool and keep.all() and keep.shape == ids.shape
    # from the tokens before masking: an end-of-text shown as [MASK] still opens its document
    assert np.array_equal(positions, document_positions(rows[:, :8], 0))
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]


def test_random_replacement_ids_are_tokenizer_ids_only():
    # a random replacement must be an ordinary token: never [MASK], [CLS] or padding, the ids just past the
    # tokenizer's; a small vocabulary and many draws make every allowed id appear and any other one show up
    uniforms, random_ids = masking_draws(0, np.arange(64), 9, 8, 5)
    assert uniforms.shape == (64, 8) and random_ids.shape == (64, 8)
    assert set(np.unique(random_ids).tolist()) == {0, 1, 2, 3, 4}
