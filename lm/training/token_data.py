"""The data a run trains on: the prepared directories checked against the config (one, or a mixture's), the
training loader, each source's val windows, and batches moved to the device."""

import hashlib
import json
import logging
from dataclasses import dataclass

import numpy as np
import torch

from lm.config import JobConfig
from lm.data.config import MixtureSource
from lm.data.loader import SplitWindows, TokenLoader, val_batches_per_rank
from lm.data.mixture import exact_shares
from lm.data.objectives import Objective
from lm.data.shards import check_manifest, document_eot, manifest_tokenizer, read_manifest, verify_hashes
from lm.distributed import layout
from lm.distributed.env import DistEnv
from lm.errors import DataError
from lm.models.registry import family_of

log = logging.getLogger("lm.train")


@dataclass
class TrainingData:
    sources: list[MixtureSource]
    """What training draws from: data.mixture's sources, or data.dir alone with weight 1"""
    is_mixture: bool
    """Whether the sources come from data.mixture (then metrics are also reported per source)"""
    manifests: list[dict]
    """Each source's manifest.json, read and checked on every rank"""
    objective: Objective
    loader: TokenLoader
    val_windows: list[SplitWindows]
    """Each source's val split, in the order of `sources`"""

    @property
    def shares(self) -> list[float]:
        """Each source's share of the training samples: its weight over the sum, summed exactly (a float sum
        of weights near 1e308 would overflow to inf)."""
        return [float(share) for share in exact_shares([s.weight for s in self.sources])]

    def identity(self) -> dict:
        """What state.json records of the data a run trains on (`lm.checkpoint.resume.check_data` compares
        it): one directory's content hash, or a hash over each source's content hash and weight."""
        if len(self.manifests) == 1:
            m = self.manifests[0]
            return {"content_hash": m["content_hash"], "source": m["source"],
                    "train_tokens": m["splits"]["train"]["tokens"]}
        parts = [(s.name, s.weight, m["content_hash"]) for s, m in zip(self.sources, self.manifests)]
        return {"content_hash": hashlib.sha256(json.dumps(parts).encode()).hexdigest(),
                "source": "mixture of " + ", ".join(f"{s.name} ({s.weight:g})" for s in self.sources),
                "train_tokens": sum(m["splits"]["train"]["tokens"] for m in self.manifests)}


def open_training_data(cfg: JobConfig, env: DistEnv) -> TrainingData:
    """Check each source directory against the config (tokenizer, vocabulary, shard sizes; sha256 with
    data.verify_hashes; recorded document boundaries with data.document_mask) and open this rank's loader
    over them. Refuses a global batch that does not split evenly over the ranks, and an objective that does
    not fit the model, before any weights exist."""
    check_batch_split(cfg, env)
    sources = cfg.data.sources
    keys = [f"data.mixture[{i}].dir" for i in range(len(sources))] if cfg.data.mixture else ["data.dir"]
    manifests = [read_manifest(s.dir, key) for s, key in zip(sources, keys)]  # shard sizes, on every rank
    _check_shared_tokenizer(sources, manifests)
    for source, manifest in zip(sources, manifests):
        check_manifest(manifest, cfg.data.tokenizer, cfg.model.vocab_size, source.dir)
        if cfg.data.verify_hashes:
            _verify_hashes(source.dir, manifest, env)
    eot = None
    if cfg.data.document_mask:
        # one tokenizer, so one end-of-text id; every source must have recorded its boundaries
        eot = [document_eot(m, s.dir) for s, m in zip(sources, manifests)][0]
    objective = family_of(cfg.model).training.objective(cfg.model, cfg.data, cfg.data.seq_len, cfg.train.seed, eot)
    dirs = [s.dir for s in sources]
    loader = TokenLoader(dirs, "train", cfg.data.seq_len, cfg.train.seed, env.dp_rank, env.dp_size,
                         cfg.train.batch_size, cfg.train.micro_batch_size, objective, [s.weight for s in sources])
    val = [SplitWindows(d, "val", cfg.data.seq_len) for d in dirs]
    for windows in val:  # every run validates (at the end at least): a split too small for it is refused now
        scored = val_batches_per_rank(windows, cfg.train.micro_batch_size, env.dp_size, cfg.train.eval_batches)
        if scored < cfg.train.eval_batches and env.is_main:
            log.info("%s: the val split holds %d micro-batches of %d windows per rank (of %d data-parallel): an "
                     "evaluation scores these, not train.eval_batches=%d", windows.data_dir, scored,
                     cfg.train.micro_batch_size, env.dp_size, cfg.train.eval_batches)
    return TrainingData(sources, bool(cfg.data.mixture), manifests, objective, loader, val)


def check_batch_split(cfg: JobConfig, env: DistEnv) -> None:
    """Every rank's share of a global batch is a whole number of micro-batches (`lm.distributed.layout`'s rule)."""
    layout.check_batch_split(cfg, env.world_size)


def _check_shared_tokenizer(sources: list[MixtureSource], manifests: list[dict]) -> None:
    """All sources of a mixture must hold ids of one tokenizer (a tokenizer.json is known by its hash, wherever
    each source's file was): one error naming two that differ."""
    first, ids = sources[0], (manifests[0]["tokenizer"], manifests[0]["vocab_size"])
    identity = (manifest_tokenizer(manifests[0]), ids[1])
    for source, manifest in zip(sources[1:], manifests[1:]):
        if (manifest_tokenizer(manifest), manifest["vocab_size"]) != identity:
            raise DataError(
                f"data.mixture: {first.dir} was prepared with tokenizer {ids[0]!r} ({ids[1]} ids) "
                f"but {source.dir} with {manifest['tokenizer']!r} "
                f"({manifest['vocab_size']} ids); all sources must share one tokenizer: prepare them with the same "
                "data.tokenizer"
            )


def _verify_hashes(data_dir: str, manifest: dict, env: DistEnv) -> None:
    """Rank 0 hashes every shard and tells the others, so all ranks fail together."""
    error = None
    if env.is_main:
        try:
            verify_hashes(data_dir, manifest)
        except DataError as err:
            error = str(err)
    error = env.broadcast_object(error)
    if error is not None:
        raise DataError(error)
    log.info("%s: every shard matches its sha256 in the manifest", data_dir)


def to_device(batch: tuple[np.ndarray, ...], device: torch.device) -> list[torch.Tensor]:
    """A batch of the loader's arrays as tensors on `device`. On CUDA they are copied from pinned memory:
    a copy from pinned memory is asynchronous, from pageable memory non_blocking would still wait."""
    pin = device.type == "cuda"
    return [(t.pin_memory() if pin else t).to(device, non_blocking=True) for t in map(torch.from_numpy, batch)]
