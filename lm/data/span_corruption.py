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

__all__ = ["corrupt", "corrupt_rows", "corrupted_lengths", "noise_mask", "noise_masks", "reconstruct", "span_counts"]


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


def noise_mask(
    length: int, rng: np.random.Generator, noise_density: float = 0.15, mean_span_length: float = 3.0
) -> np.ndarray:
    """Which tokens of a `length`-token window are noise: (L,) bool.

    Exactly num_noise True tokens in exactly num_spans runs; the window starts with kept tokens and
    kept and noise runs alternate (so it ends with a noise run). Draws L - 2 uniforms from `rng` only.
    """
    uniforms = rng.random((1, max(length - 2, 0)))  # (1, L - 2)
    return noise_masks(length, uniforms, noise_density, mean_span_length)[0]


def noise_masks(
    length: int, uniforms: np.ndarray, noise_density: float = 0.15, mean_span_length: float = 3.0
) -> np.ndarray:
    """The noise masks (B, L) bool that rows of uniform draws `uniforms` (B, L - 2) pick.

    As in T5, the noise tokens are split into num_spans random positive parts, likewise the kept
    tokens, and the parts interleave, kept first. A split of n items into k parts is a choice of k - 1
    of the n - 1 gaps between items to cut at: row b cuts at the gaps whose uniforms are the smallest,
    the first num_noise - 1 uniforms serving the noise tokens and the other num_kept - 1 the kept ones.
    iid uniforms rank in a uniformly random order, so every split is equally likely. Taking the draws
    as input leaves only them to do row by row (one generator per row); the rest runs on the batch.
    """
    num_noise, num_spans = span_counts(length, noise_density, mean_span_length)
    uniforms = np.asarray(uniforms, dtype=np.float64)
    if uniforms.ndim != 2 or uniforms.shape[1] != length - 2:
        raise ValueError(f"noise masks of {length} tokens take uniforms (B, {length - 2}), got {uniforms.shape}")
    batch = len(uniforms)
    noise_cuts = smallest(uniforms[:, :num_noise - 1], num_spans - 1)  # (B, num_noise - 1)
    kept_cuts = smallest(uniforms[:, num_noise - 1:], num_spans - 1)  # (B, num_kept - 1)

    # noise run of each noise token: the cuts before it
    noise_run = np.pad(np.cumsum(noise_cuts, axis=1), ((0, 0), (1, 0)))  # (B, num_noise)
    # kept tokens up to the end of kept run s (every row has num_spans - 1 cuts, so they reshape)
    cut_gaps = np.nonzero(kept_cuts)[1].reshape(batch, num_spans - 1)  # (B, num_spans - 1) ascending
    kept_ends = np.pad(cut_gaps + 1, ((0, 0), (0, 1)), constant_values=length - num_noise)  # (B, num_spans)
    # noise run s follows kept runs 0..s, so a noise token sits after the kept tokens up to kept_ends[s]
    position = np.arange(num_noise) + np.take_along_axis(kept_ends, noise_run, axis=1)  # (B, num_noise)
    mask = np.zeros((batch, length), dtype=bool)
    mask[np.arange(batch)[:, None], position] = True
    return mask


def smallest(values: np.ndarray, k: int) -> np.ndarray:
    """(B, n) bool: True at the k smallest entries of each row of `values` (B, n)."""
    chosen = np.zeros(values.shape, dtype=bool)
    np.put_along_axis(chosen, np.argsort(values, axis=1)[:, :k], True, axis=1)
    return chosen


def corrupt(tokens: np.ndarray, mask: np.ndarray, sentinel_start: int) -> tuple[np.ndarray, np.ndarray]:
    """Encoder inputs and decoder targets of `tokens` (L,) with noise `mask` (L,) bool.

    inputs (L - num_noise + num_spans,): the tokens with the i-th noise run replaced by sentinel i
    (id sentinel_start + i). targets (num_noise + num_spans + 1,): sentinel i then run i, for every run,
    then sentinel num_spans as the end marker. Both int64.
    """
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    if tokens.ndim != 1 or tokens.shape != mask.shape:
        raise ValueError(f"tokens {tokens.shape} and mask {mask.shape} must be 1-D and of the same length")
    inputs, targets = corrupt_rows(tokens[None], mask[None], sentinel_start)
    return inputs[0], targets[0]


def corrupt_rows(tokens: np.ndarray, mask: np.ndarray, sentinel_start: int) -> tuple[np.ndarray, np.ndarray]:
    """`corrupt` of every row of `tokens` (B, L) with its `mask` (B, L): inputs (B, S), targets (B, U).

    Every mask must have the same numbers of noise tokens and runs, so that the rows line up; one pass
    of array operations over the batch is much faster than B calls of `corrupt`.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    mask = np.asarray(mask, dtype=bool)
    if tokens.ndim != 2 or tokens.shape != mask.shape:
        raise ValueError(f"tokens {tokens.shape} and mask {mask.shape} must be 2-D and of the same shape")
    batch = len(tokens)
    starts = mask & ~np.pad(mask, ((0, 0), (1, 0)))[:, :-1]  # (B, L) True where a noise run begins
    num_noise, num_spans = mask.sum(axis=1), starts.sum(axis=1)  # (B,), (B,)
    if batch and (np.any(num_noise != num_noise[0]) or np.any(num_spans != num_spans[0])):
        raise ValueError("every row's mask must have the same number of noise tokens and of noise runs")
    num_noise, num_spans = (int(n[0]) if batch else 0 for n in (num_noise, num_spans))
    run_index = np.cumsum(starts, axis=1) - 1  # (B, L) the latest run begun at or before each token

    # each run start becomes its run's sentinel and the rest of the run is dropped; every row keeps
    # the same number of tokens, so the row-major selection reshapes back into rows
    keep = ~mask | starts
    source_len = mask.shape[1] - num_noise + num_spans
    inputs = np.where(starts, sentinel_start + run_index, tokens)[keep].reshape(batch, source_len)

    # the k-th noise token (from 0), of run i, lands after the k noise tokens and i + 1 sentinels before it
    slot = np.cumsum(mask, axis=1) - 1 + run_index + 1  # (B, L), meaningful where mask
    row = np.broadcast_to(np.arange(batch)[:, None], mask.shape)  # (B, L)
    targets = np.empty((batch, num_noise + num_spans + 1), dtype=np.int64)
    targets[row[mask], slot[mask]] = tokens[mask]
    targets[row[starts], slot[starts] - 1] = sentinel_start + run_index[starts]  # sentinel i just before run i
    targets[:, -1] = sentinel_start + num_spans  # the end marker
    return inputs, targets


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
