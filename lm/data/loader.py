"""Training and validation batches read from memory-mapped shards.

A split is cut into samples: shard k of L_k tokens holds n_k = max(0, (L_k - 1) // T) windows of T + 1
tokens, window j starting at token j * T, and global sample ids number shard 0's windows, then shard
1's, and so on. Training order is a pure function of (seed, epoch, position), so the loader's whole
state is one integer, the number of samples consumed since the start of training: resuming, also with
a different number of ranks, is arithmetic on that integer.

The loader reads raw windows; an objective (`lm.data.objectives`) turns them into the model's batch.
Training samples are keyed by their global position and validation samples by their id, so an
objective's randomness (span corruption's noise) is the same for a position whatever the world size.
"""

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from lm.data.mixture import MixtureDraws, sample_order
from lm.data.objectives import NextToken, Objective
from lm.data.shards import check_token_ids, open_shard, read_manifest
from lm.errors import DataError

__all__ = ["SplitWindows", "TokenLoader", "locate", "rank_slice", "sample_id_at", "val_batches", "val_batches_per_rank"]


def sample_id_at(position: int, seed: int, num_samples: int) -> int:
    """The sample read at global `position`: epoch = position // N, then that epoch's order."""
    epoch, index = divmod(position, num_samples)
    return int(sample_order(seed, epoch, num_samples)[index])


def rank_slice(step_start: int, global_batch: int, rank: int, world: int) -> range:
    """Global positions `rank` reads in the optimizer step that starts at `step_start`: the step's
    `global_batch` positions cut into `world` contiguous, equal chunks."""
    if global_batch % world:
        raise ValueError(f"train.batch_size: {global_batch} is not divisible by the world size {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of size {world}")
    per_rank = global_batch // world
    start = step_start + rank * per_rank
    return range(start, start + per_rank)


def locate(sample_ids: np.ndarray, cum_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map global sample ids (n,) to (shard index (n,), window index within that shard (n,)).

    `cum_counts` (num_shards + 1,) holds 0 and the running totals of windows per shard.
    """
    shard = np.searchsorted(cum_counts, sample_ids, side="right") - 1
    return shard, sample_ids - cum_counts[shard]


class SplitWindows:
    """The samples of one split: every shard mapped once, windows read by global sample id."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int) -> None:
        manifest = read_manifest(data_dir)
        entries = manifest["splits"][split]["shards"]
        if not entries:
            raise DataError(
                f"{data_dir}: the {split} split is empty"
                + ("; prepare with data.val_fraction > 0" if split == "val" else "")
            )
        self.data_dir, self.split, self.seq_len = Path(data_dir), split, seq_len
        self.vocab_size = int(manifest["vocab_size"])
        self.files = [e["file"] for e in entries]
        self.shards = [open_shard(Path(data_dir) / name) for name in self.files]
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.cum_counts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # (num_shards + 1,)
        self.num_samples = int(self.cum_counts[-1])
        if self.num_samples == 0:
            longest = max(len(s) for s in self.shards)
            raise DataError(
                f"{data_dir}: the {split} split has no window of data.seq_len + 1 = {seq_len + 1} tokens "
                f"(its longest shard holds {longest}); lower data.seq_len or prepare with larger data.shard_tokens"
            )

    def read_rows(self, sample_ids: np.ndarray) -> np.ndarray:
        """The windows of the samples `sample_ids` (B,): (B, T + 1) int64.

        Every id is checked against the manifest's vocabulary size here, where the window is read (one max
        over the batch, ~1 us a window: docs/benchmarks.md), so that a shard damaged after it was prepared
        stops the run with its name instead of an index error deep in the embedding."""
        shard, window = locate(np.asarray(sample_ids, dtype=np.int64), self.cum_counts)
        t = self.seq_len
        rows = np.empty((len(shard), t + 1), dtype=np.int64)  # (B, T + 1)
        for i, (k, j) in enumerate(zip(shard.tolist(), window.tolist())):
            rows[i] = self.shards[k][j * t:j * t + t + 1]
        if rows.size and rows.max() >= self.vocab_size:
            i = int(np.argmax(rows.max(axis=1) >= self.vocab_size))
            k = int(shard[i])
            check_token_ids(rows[i], self.vocab_size, self.data_dir / self.files[k], start=int(window[i]) * t)
        return rows


class TokenLoader:
    """Shuffled training batches for one rank; `state_dict()` is the global position only.

    Each `next_batch()` is one optimizer step: the step's `global_batch` samples are split into
    contiguous equal chunks per rank, and each rank's chunk into micro-batches. The union over ranks
    is the same set of samples for any world size, so a run can resume on a different number of ranks.
    `objective` (default NextToken) makes each micro-batch from its windows and their global positions.
    `data_dir` is one prepared directory, or the directories of a mixture with one weight each in `weights`:
    then each position's source is drawn by `lm.data.mixture`, as a function of (seed, position) too.
    """

    def __init__(
        self, data_dir: str | Path | Sequence[str | Path], split: str, seq_len: int, seed: int, rank: int,
        world_size: int, global_batch: int, micro_batch: int, objective: Objective | None = None,
        weights: Sequence[float] | None = None,
    ) -> None:
        if global_batch % (world_size * micro_batch):
            raise ValueError(
                f"train.batch_size: {global_batch} is not a multiple of train.micro_batch_size "
                f"({micro_batch}) x world size ({world_size})"
            )
        dirs = [data_dir] if isinstance(data_dir, (str, Path)) else list(data_dir)
        weights = [1.0] if weights is None else list(weights)
        if len(weights) != len(dirs):
            raise ValueError(f"{len(dirs)} data directories but {len(weights)} weights")
        self.sources = [SplitWindows(d, split, seq_len) for d in dirs]
        self.draws = MixtureDraws(weights, [w.num_samples for w in self.sources], seed)
        self.objective = objective if objective is not None else NextToken()
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.grad_accum = global_batch // (world_size * micro_batch)
        self.position = 0
        self.step_tokens = global_batch * seq_len
        """Token positions one step reads over every rank (throughput, `tokens` in the metrics)"""

    @property
    def windows(self) -> SplitWindows:
        """The one source's windows (a loader over one directory)."""
        (windows,) = self.sources
        return windows

    @property
    def num_samples(self) -> int:
        """Samples (windows) in one epoch of the split (a loader over one directory)."""
        return self.windows.num_samples

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def draws_per_source(self) -> np.ndarray:
        """Samples each source has served since the start of training, (S,) int64."""
        return self.draws.draws_before(self.position)

    def sample_ids(self, positions: range) -> np.ndarray:
        """Sample ids at consecutive global positions (n,) of a loader over one directory."""
        return self.draws.locate(positions)[1]

    def read(self, source: np.ndarray, window: np.ndarray) -> np.ndarray:
        """The windows (B, T + 1) int64 of the samples `window` (B,) of the sources `source` (B,)."""
        if len(self.sources) == 1:
            return self.sources[0].read_rows(window)
        rows = np.empty((len(window), self.sources[0].seq_len + 1), dtype=np.int64)  # (B, T + 1)
        for s in np.unique(source).tolist():
            mine = source == s
            rows[mine] = self.sources[s].read_rows(window[mine])
        return rows

    def next_batch(self) -> list[tuple[np.ndarray, ...]]:
        """This rank's `grad_accum` micro-batches for one optimizer step, each the objective's tuple
        (NextToken: x, y each (micro_batch, T) int64)."""
        positions = rank_slice(self.position, self.global_batch, self.rank, self.world_size)
        source, window = self.draws.locate(positions)
        # keyed by position, not sample id: a sample seen again in a later epoch gets fresh noise
        keys = np.arange(positions.start, positions.stop, dtype=np.int64)
        self.position += self.global_batch
        b = self.micro_batch
        return [self.objective(self.read(source[i:i + b], window[i:i + b]), keys[i:i + b])
                for i in range(0, len(keys), b)]


def val_batches_per_rank(windows: SplitWindows, micro_batch: int, world: int, max_batches: int) -> int:
    """The full batches each rank scores of a split's windows: min(max_batches, full batches // world). DataError
    for a split with fewer windows than one micro-batch on every rank, which the trainer asks before its first
    step, not at its first evaluation."""
    per_rank = min(max_batches, windows.num_samples // micro_batch // world)
    if per_rank == 0:
        raise DataError(
            f"{windows.data_dir}: the {windows.split} split has {windows.num_samples} windows of "
            f"data.seq_len={windows.seq_len}, fewer than train.micro_batch_size ({micro_batch}) x world size "
            f"({world}); prepare with a larger data.val_fraction"
        )
    return per_rank


def val_batches(
    windows: SplitWindows, micro_batch: int, rank: int, world: int, max_batches: int,
    objective: Objective | None = None,
) -> Iterator[tuple[np.ndarray, ...]]:
    """Validation batches of a split's windows in order, each the objective's tuple keyed by sample id
    (default NextToken: x, y each (micro_batch, T) int64).

    Batch b holds windows [b * micro_batch, (b + 1) * micro_batch); rank r takes batches r, r + world, ...
    Every rank yields the same number of full batches, min(max_batches, full batches // world), so
    ranks that average their losses with a collective stay in step. `windows` is opened once by the
    caller and reused for every evaluation.
    """
    per_rank = val_batches_per_rank(windows, micro_batch, world, max_batches)
    objective = objective if objective is not None else NextToken()
    starts = [(rank + i * world) * micro_batch for i in range(per_rank)]
    batches = [np.arange(start, start + micro_batch, dtype=np.int64) for start in starts]  # sample ids, each (B,)
    # a generator expression, so the checks above run when val_batches is called, not at first next()
    return (objective(windows.read_rows(ids), ids) for ids in batches)
