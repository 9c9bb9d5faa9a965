"""Training objectives: what a model is trained to predict from the raw windows the loader reads.

An objective is a callable `objective(rows, keys)`: `rows` (B, T + 1) int64 are windows of the token
shards and `keys` (B,) int64 name the samples (the loader passes global loader positions for training
and sample ids for validation). It returns the model's batch as a tuple of int64 arrays, the model's
arguments in order; the trainer moves them to its device. Any randomness is a pure function of
(seed, key), so a run resumed at any world size sees the same batch. Which objective trains which
model is the model family's choice (`Training.objective`): this package knows no model.

- NextToken: decoder-only language modelling (x, y).
- SpanCorruption: T5's encoder-decoder objective (src, tgt_in, tgt_out).
- MaskedLM: BERT-style masked LM for an encoder (ids, labels), masking by `lm.data.masking`.
"""

from typing import Protocol

import numpy as np

from lm.data.masking import check_masking, mask_rows, masking_draws, replacement_counts, target_count
from lm.data.span_corruption import corrupt_rows, corrupted_lengths, noise_masks, span_counts
from lm.errors import ConfigError

__all__ = ["MaskedLM", "NextToken", "Objective", "ScoredObjective", "SpanCorruption", "document_positions"]


class Objective(Protocol):
    def __call__(self, rows: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, ...]: ...


class ScoredObjective(Objective, Protocol):
    """An objective a model is scored on window by window (lm.eval), and how its report names it."""

    targets: str
    """What it scores, plural: "target tokens"."""
    accuracy: str
    """The name of the share of targets predicted right, where the model reports it."""

    def describe(self, seq_len: int) -> str:
        """What the windows of seq_len tokens go through, in a few words."""


def document_positions(x: np.ndarray, eot: int) -> np.ndarray:
    """Each input token's position inside its document, (B, T) int64, for inputs x (B, T).

    An end-of-text token opens the document after it, as its first position: preparation puts one after
    every document (and nowhere else), so a document run alone is [eot, t_1, ..., t_n] with targets
    [t_1, ..., t_n, eot], and its first token is predicted from the end-of-text token alone. The window's
    first token opens a document too (the rest of one that began in an earlier window).
    """
    t = np.arange(x.shape[1], dtype=np.int64)  # (T,)
    starts = np.where((x == eot) | (t == 0), t, 0)  # (B, T): the index of each document's first token
    return t - np.maximum.accumulate(starts, axis=1)


class NextToken:
    """Decoder-only language modelling: inputs x and next-token targets y, each (B, T) int64, and with
    `document_eot` (data.document_mask) the positions of x inside their documents (B, T) int64, from
    which the model keeps attention inside each document (`document_positions`)."""

    def __init__(self, document_eot: int | None = None) -> None:
        self.document_eot = document_eot

    def __call__(self, rows: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, ...]:
        batch = np.asarray(rows, dtype=np.int64)  # (B, T + 1)
        # copies, so that targets can be flattened with .view(-1) by the loss
        x, y = np.ascontiguousarray(batch[:, :-1]), np.ascontiguousarray(batch[:, 1:])
        if self.document_eot is None:
            return x, y
        return x, y, document_positions(x, self.document_eot)


class SpanCorruption:
    """T5 span corruption of each window: (src (B, S), tgt_in (B, U), tgt_out (B, U)), all int64.

    src is the window with its noise spans replaced by sentinels, tgt_out the sentinels each followed by
    its span plus the end sentinel, and tgt_in is tgt_out shifted right behind the decoder start token
    (pad_id), for teacher forcing. The noise of the row with key k is drawn from
    np.random.default_rng([seed, k]) alone.
    """

    targets = "target tokens"
    accuracy = "target-token accuracy"

    def __init__(
        self, seed: int, sentinel_start: int, n_sentinels: int, pad_id: int, window_len: int,
        noise_density: float = 0.15, mean_span_length: float = 3.0,
    ) -> None:
        _, num_spans = span_counts(window_len, noise_density, mean_span_length)
        if num_spans + 1 > n_sentinels:
            raise ConfigError(
                f"model.n_sentinels: {n_sentinels} sentinels do not fit data.seq_len={window_len - 1}: its windows "
                f"of {window_len} tokens have {num_spans} noise spans and need {num_spans + 1} sentinels "
                f"({num_spans} spans + 1 end marker)"
            )
        self.seed, self.sentinel_start, self.n_sentinels, self.pad_id = seed, sentinel_start, n_sentinels, pad_id
        self.window_len, self.noise_density, self.mean_span_length = window_len, noise_density, mean_span_length

    @property
    def lengths(self) -> tuple[int, int]:
        """(S, U): source and target length of every corrupted window."""
        return corrupted_lengths(self.window_len, self.noise_density, self.mean_span_length)

    def describe(self, seq_len: int) -> str:
        s, u = self.lengths
        return f"span corruption of windows of {self.window_len} tokens (source {s}, target {u})"

    def __call__(self, rows: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        keys = np.asarray(keys, dtype=np.int64)
        if rows.ndim != 2 or rows.shape[1] != self.window_len or keys.shape != rows.shape[:1]:
            raise ValueError(
                f"span corruption takes rows (B, {self.window_len}) and keys (B,), got {rows.shape} and {keys.shape}"
            )
        # one generator per row, so a row's noise depends on its key alone (equal to noise_mask(L, rng))
        uniforms = np.zeros((len(rows), self.window_len - 2))  # (B, T - 1)
        for i, key in enumerate(keys.tolist()):
            uniforms[i] = np.random.default_rng([self.seed, key]).random(self.window_len - 2)
        masks = noise_masks(self.window_len, uniforms, self.noise_density, self.mean_span_length)  # (B, T + 1)
        src, tgt_out = corrupt_rows(rows, masks, self.sentinel_start)  # (B, S), (B, U)
        tgt_in = np.empty_like(tgt_out)  # (B, U)
        tgt_in[:, 0] = self.pad_id
        tgt_in[:, 1:] = tgt_out[:, :-1]
        return src, tgt_in, tgt_out


class MaskedLM:
    """Masked-LM corruption of each window: (ids (B, T), labels (B, T)), both int64, from rows (B, T + 1).

    ids are the window's first T tokens with [CLS] (cls_id) at position 0 and, of exactly
    k = max(1, round(rate * (T - 1))) target positions among 1..T-1, round(mask_fraction * k) shown as
    [MASK] (mask_id), round(random_fraction * k) as a uniformly random id in [0, vocab_size) and the rest
    unchanged (`lm.data.masking`); labels hold the original tokens at the targets and -100 elsewhere. The
    window's last token is not read. The corruption of the row with key k is drawn from
    np.random.default_rng([seed, k]) alone. With `document_eot` (data.document_mask) the batch is
    (ids, labels, keep (B, T) bool, all True: no padding, positions (B, T) int64): each token's position
    inside its document, read from the window's own tokens (`document_positions`; [CLS] opens the first).
    """

    targets = "masked tokens"
    accuracy = "masked-token accuracy"

    def __init__(
        self, seed: int, vocab_size: int, mask_id: int, cls_id: int, rate: float, mask_fraction: float,
        random_fraction: float, document_eot: int | None = None,
    ) -> None:
        check_masking(rate, mask_fraction, random_fraction)
        if min(mask_id, cls_id) < vocab_size or mask_id == cls_id:
            raise ValueError(f"[MASK] ({mask_id}) and [CLS] ({cls_id}) must be two ids after the tokenizer's "
                             f"{vocab_size}")
        self.seed, self.vocab_size, self.mask_id, self.cls_id = seed, vocab_size, mask_id, cls_id
        self.rate, self.mask_fraction, self.random_fraction = rate, mask_fraction, random_fraction
        self.document_eot = document_eot

    def describe(self, seq_len: int) -> str:
        """What the windows of `seq_len` tokens hold; ConfigError for windows too short to mask."""
        return (f"windows of {seq_len} tokens, {target_count(seq_len, self.rate)} of each masked ({self.rate:.0%}; "
                f"{self.mask_fraction:.0%} [MASK], {self.random_fraction:.0%} random)")

    def __call__(self, rows: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, ...]:
        rows = np.asarray(rows, dtype=np.int64)
        keys = np.asarray(keys, dtype=np.int64)
        if rows.ndim != 2 or keys.shape != rows.shape[:1]:
            raise ValueError(f"masked LM takes rows (B, T + 1) and keys (B,), got {rows.shape} and {keys.shape}")
        seq_len = rows.shape[1] - 1
        k = target_count(seq_len, self.rate)
        n_mask, n_random = replacement_counts(k, self.mask_fraction, self.random_fraction)
        uniforms, random_ids = masking_draws(self.seed, keys, seq_len, n_random, self.vocab_size)
        ids, labels = mask_rows(rows[:, :seq_len], uniforms, random_ids, k, n_mask, self.mask_id, self.cls_id)
        if self.document_eot is None:
            return ids, labels
        # from the tokens as they are: a masked end-of-text still ends its document
        positions = document_positions(rows[:, :seq_len], self.document_eot)  # (B, T)
        return ids, labels, np.ones(ids.shape, dtype=bool), positions
