"""T5-style span corruption (Raffel et al., 2020, section 3.1.4), as pure numpy functions.

A window of L tokens is split into alternating runs, starting with kept tokens: num_spans runs of kept
tokens and num_spans runs of noise. The encoder input keeps the kept tokens and replaces the i-th noise
run by sentinel i; the decoder target lists, for each run i, sentinel i then the run's tokens, and ends
with one more sentinel that marks the end:

    tokens   a b c d e f g h        (noise: c d, g)
    inputs   a b <0> e f <1> h
    targets  <0> c d <1> g <2>

For a given L both lengths are fixed, so batches need no padding.
"""

import numpy as np

__all__ = ["corrupt", "corrupted_lengths", "noise_mask", "reconstruct", "span_counts"]


def span_counts(length: int, noise_density: float = 0.15, mean_span_length: float = 3.0) -> tuple[int, int]:
    """(num_noise, num_spans) for a window of `length` tokens.

    Every span and every gap between spans has at least one token, and the window keeps at least one
    token, so `length` must be at least 2. Rounding is Python's `round` (half to even), as in T5.
    """
    if length < 2:
        raise ValueError(f"span corruption needs a window of at least 2 tokens, got {length}")
    if not 0.0 < noise_density < 1.0:
        raise ValueError(f"noise_density must be in (0, 1), got {noise_density}")
    if mean_span_length < 1.0:
        raise ValueError(f"mean_span_length must be >= 1, got {mean_span_length}")
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(1, round(num_noise / mean_span_length))
    # one noise token per span at least, and one kept token per gap (there are num_spans gaps)
    num_spans = min(num_spans, num_noise, length - num_noise)
    return num_noise, num_spans


def corrupted_lengths(
    length: int, noise_density: float = 0.15, mean_span_length: float = 3.0
) -> tuple[int, int]:
    """(source_len, target_len) of a corrupted window of `length` tokens.

    The source keeps the non-noise tokens plus one sentinel per span; the target holds the noise tokens,
    one sentinel per span and the end sentinel.
    """
    num_noise, num_spans = span_counts(length, noise_density, mean_span_length)
    return length - num_noise + num_spans, num_noise + num_spans + 1


def random_parts(total: int, num_parts: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random split of `total` items into `num_parts` positive parts, (num_parts,) int64.

    Choosing num_parts - 1 distinct cut points among the total - 1 gaps between items picks every
    composition with equal probability.
    """
    cuts = np.sort(rng.choice(total - 1, size=num_parts - 1, replace=False) + 1)
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int64)


def noise_mask(
    length: int, rng: np.random.Generator, noise_density: float = 0.15, mean_span_length: float = 3.0
) -> np.ndarray:
    """Which tokens of a `length`-token window are noise: (L,) bool.

    Exactly num_noise True tokens in exactly num_spans runs; the window starts with kept tokens and
    kept and noise runs alternate (so it ends with a noise run). Draws from `rng` only.
    """
    num_noise, num_spans = span_counts(length, noise_density, mean_span_length)
    noise_lengths = random_parts(num_noise, num_spans, rng)  # (num_spans,)
    kept_lengths = random_parts(length - num_noise, num_spans, rng)  # (num_spans,)
    run_lengths = np.stack([kept_lengths, noise_lengths], axis=1).reshape(-1)  # (2 * num_spans,) kept, noise, ...
    run_is_noise = np.tile([False, True], num_spans)  # (2 * num_spans,)
    return np.repeat(run_is_noise, run_lengths)


def run_starts(mask: np.ndarray) -> np.ndarray:
    """(L,) bool: True where a noise run begins."""
    previous = np.concatenate([[False], mask[:-1]])
    return mask & ~previous


def corrupt(tokens: np.ndarray, mask: np.ndarray, sentinel_start: int) -> tuple[np.ndarray, np.ndarray]:
    """Encoder inputs and decoder targets of `tokens` (L,) with noise `mask` (L,) bool.

    inputs (L - num_noise + num_spans,): the tokens with the i-th noise run replaced by sentinel i
    (id sentinel_start + i). targets (num_noise + num_spans + 1,): sentinel i then run i, for every run,
    then sentinel num_spans as the end marker. Both int64.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    mask = np.asarray(mask, dtype=bool)
    if tokens.ndim != 1 or tokens.shape != mask.shape:
        raise ValueError(f"tokens {tokens.shape} and mask {mask.shape} must be 1-D and of the same length")
    starts = run_starts(mask)  # (L,)
    num_spans = int(starts.sum())
    sentinels = sentinel_start + np.arange(num_spans + 1, dtype=np.int64)  # (num_spans + 1,)

    # each run start becomes its run's sentinel; the rest of the run is dropped
    run_index = np.cumsum(starts) - 1  # (L,) index of the latest run that began at or before each token
    inputs = np.where(starts, sentinel_start + run_index, tokens)[~mask | starts]

    # the noise tokens, with sentinel i inserted before the first token of run i
    first_of_run = np.flatnonzero(starts[mask])  # (num_spans,) positions within tokens[mask]
    targets = np.insert(tokens[mask], first_of_run, sentinels[:-1])
    return inputs, np.append(targets, sentinels[-1])


def reconstruct(inputs: np.ndarray, targets: np.ndarray, sentinel_start: int, n_sentinels: int) -> np.ndarray:
    """The tokens that `corrupt` made `inputs` (S,) and `targets` (U,) from: (L,) int64.

    Each sentinel in `inputs` is replaced by the tokens that follow the same sentinel in `targets`, up
    to the next sentinel. Raises ValueError when the pair cannot come from `corrupt`: an id that is
    neither a token nor a sentinel, targets that do not start with a sentinel, a sentinel repeated, a
    sentinel of the inputs missing from the targets, or target tokens no input sentinel refers to.
    """
    inputs = np.asarray(inputs, dtype=np.int64)
    targets = np.asarray(targets, dtype=np.int64)
    limit = sentinel_start + n_sentinels
    for name, ids in (("inputs", inputs), ("targets", targets)):
        if ids.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {ids.shape}")
        bad = ids[(ids < 0) | (ids >= limit)]
        if bad.size:
            raise ValueError(f"{name} hold id {int(bad[0])}, neither a token (< {sentinel_start}) nor a sentinel "
                             f"(< {limit})")

    is_sentinel = targets >= sentinel_start  # (U,)
    if targets.size and not is_sentinel[0]:
        raise ValueError(f"targets must start with a sentinel, got token {int(targets[0])}")
    # the spans of the targets: sentinel id -> the tokens after it, up to the next sentinel
    starts = np.flatnonzero(is_sentinel)
    ends = np.append(starts[1:], targets.size)
    spans: dict[int, np.ndarray] = {}
    for start, end in zip(starts.tolist(), ends.tolist()):
        sentinel = int(targets[start])
        if sentinel in spans:
            raise ValueError(f"targets hold sentinel {sentinel - sentinel_start} twice")
        spans[sentinel] = targets[start + 1:end]

    tokens: list[int] = []
    used: set[int] = set()
    for token in inputs.tolist():
        if token < sentinel_start:
            tokens.append(token)
            continue
        if token in used:
            raise ValueError(f"inputs hold sentinel {token - sentinel_start} twice")
        if token not in spans:
            raise ValueError(f"inputs hold sentinel {token - sentinel_start}, which the targets lack")
        used.add(token)
        tokens.extend(spans[token].tolist())
    lost = [s - sentinel_start for s, span in spans.items() if s not in used and span.size]
    if lost:
        raise ValueError(f"targets hold tokens after sentinel {lost[0]}, which the inputs lack")
    return np.array(tokens, dtype=np.int64)
