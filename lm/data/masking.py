"""Masked-LM corruption of a window (BERT, Devlin et al. 2019; ModernBERT, Warner et al. 2024), as pure numpy.

A window's first T tokens become the encoder's input with [CLS] at position 0. Of positions 1..T-1,
exactly k = max(1, round(rate * (T - 1))) are targets: the model predicts their original tokens. Of
the k, exactly round(mask_fraction * k) are shown as [MASK], up to round(random_fraction * k) as a
random tokenizer id and the rest as themselves:

    window   a  b  c  d  e  f  g  h
    ids      C  b  M  d  e  r  g  h      (targets: c, f; C = [CLS], M = [MASK], r random)
    labels   -  -  c  -  -  f  -  -      (- = IGNORE)

A fixed k per row, not a coin flip per token, keeps the number of targets the same in every row, so
every micro-batch's mean loss is over the same count and a mean of micro-batch means is the mean over
the global batch at any world size.
"""

import numpy as np

from lm.errors import ConfigError

__all__ = ["IGNORE", "check_masking", "mask_rows", "masking_draws", "replacement_counts", "target_count"]

IGNORE = -100
"""Label of a position that is not a target (the default ignore_index of torch's cross-entropy)."""


def check_masking(rate: float, mask_fraction: float, random_fraction: float) -> None:
    """Raise ConfigError naming the data.mlm_* key whose value cannot be masked with."""
    if not 0.0 < rate < 1.0:
        raise ConfigError(f"data.mlm_rate: must be in (0, 1), got {rate}")
    for key, value in (("mlm_mask_fraction", mask_fraction), ("mlm_random_fraction", random_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"data.{key}: must be in [0, 1], got {value}")
    if mask_fraction + random_fraction > 1.0:
        raise ConfigError(
            f"data.mlm_mask_fraction + data.mlm_random_fraction: the shares of targets shown as [MASK] and as a "
            f"random token must sum to at most 1, got {mask_fraction} + {random_fraction}"
        )


def target_count(seq_len: int, rate: float) -> int:
    """k, the targets of every window of `seq_len` tokens: max(1, round(rate * (seq_len - 1))), <= seq_len - 1."""
    if seq_len < 2:
        raise ConfigError(f"data.seq_len: masked LM needs windows of at least 2 tokens ([CLS] and one target), "
                          f"got {seq_len}")
    return min(max(1, round(rate * (seq_len - 1))), seq_len - 1)


def replacement_counts(k: int, mask_fraction: float, random_fraction: float) -> tuple[int, int]:
    """(n_mask, n_random) of k targets: round(mask_fraction * k) and round(random_fraction * k), the
    latter lowered where rounding both up would exceed k (k = 3 at 0.5/0.5: 2 and 1)."""
    n_mask = min(round(mask_fraction * k), k)
    return n_mask, min(round(random_fraction * k), k - n_mask)


def masking_draws(
    seed: int, keys: np.ndarray, seq_len: int, n_random: int, vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The random draws of rows `keys` (B,): uniforms (B, T - 1) float64 and random ids (B, n_random) int64
    in [0, vocab_size). Row b draws from np.random.default_rng([seed, keys[b]]) alone, so a row's
    corruption does not depend on the batch it is in."""
    keys = np.asarray(keys, dtype=np.int64)
    uniforms = np.empty((len(keys), seq_len - 1))  # (B, T - 1)
    random_ids = np.empty((len(keys), n_random), dtype=np.int64)  # (B, n_random)
    for i, key in enumerate(keys.tolist()):
        rng = np.random.default_rng([seed, key])
        uniforms[i] = rng.random(seq_len - 1)
        random_ids[i] = rng.integers(0, vocab_size, n_random)
    return uniforms, random_ids


def mask_rows(
    tokens: np.ndarray, uniforms: np.ndarray, random_ids: np.ndarray, k: int, n_mask: int, mask_id: int,
    cls_id: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Corrupt `tokens` (B, T): (ids (B, T), labels (B, T)), both int64.

    Row b ranks positions 1..T-1 by its `uniforms` (B, T - 1), smallest first (iid uniforms rank in a
    uniformly random order): the first k are its targets, of which the first n_mask become mask_id and
    the next n_random = random_ids.shape[1] take `random_ids` (B, n_random). Position 0 becomes cls_id
    and is never a target. labels hold the original token at the targets and IGNORE elsewhere.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    batch, seq_len = tokens.shape
    n_random = random_ids.shape[1]
    if uniforms.shape != (batch, seq_len - 1) or not 0 < k <= seq_len - 1 or n_mask + n_random > k:
        raise ValueError(f"masking tokens {tokens.shape} takes uniforms ({batch}, {seq_len - 1}) and at most k "
                         f"<= {seq_len - 1} targets, got {uniforms.shape}, k={k}, {n_mask} masked + {n_random} random")
    order = np.argsort(uniforms, axis=1, kind="stable")[:, :k] + 1  # (B, k) target positions in draw order
    row = np.arange(batch)[:, None]  # (B, 1)
    labels = np.full((batch, seq_len), IGNORE, dtype=np.int64)
    labels[row, order] = tokens[row, order]
    ids = tokens.copy()
    ids[:, 0] = cls_id
    ids[row, order[:, :n_mask]] = mask_id
    ids[row, order[:, n_mask:n_mask + n_random]] = random_ids
    return ids, labels
