"""The data a run trains on: the prepared directory checked against the config, the training loader, the
val windows, and batches moved to the device."""

import logging
from dataclasses import dataclass

import numpy as np
import torch

from lm.config import JobConfig
from lm.data.loader import SplitWindows, TokenLoader
from lm.data.objectives import Objective
from lm.data.shards import check_manifest, read_manifest, verify_hashes
from lm.distributed.env import DistEnv
from lm.errors import ConfigError, DataError
from lm.training.objective import build_objective

log = logging.getLogger("lm.train")


@dataclass
class TrainingData:
    manifest: dict
    """data.dir's manifest.json, read and checked on every rank"""
    objective: Objective
    loader: TokenLoader
    val_windows: SplitWindows


def open_training_data(cfg: JobConfig, env: DistEnv) -> TrainingData:
    """Check data.dir against the config (tokenizer, vocabulary, shard sizes; sha256 with
    data.verify_hashes) and open this rank's loader over it. Refuses a global batch that does not split
    evenly over the ranks, and an objective that does not fit the model, before any weights exist."""
    if cfg.train.batch_size % (cfg.train.micro_batch_size * env.world_size):
        raise ConfigError(
            f"train.batch_size: {cfg.train.batch_size} is not a multiple of train.micro_batch_size "
            f"({cfg.train.micro_batch_size}) x world size ({env.world_size})"
        )
    manifest = read_manifest(cfg.data.dir)  # shard sizes, on every rank
    check_manifest(manifest, cfg.data.tokenizer, cfg.model.vocab_size, cfg.data.dir)
    if cfg.data.verify_hashes:
        _verify_hashes(cfg.data.dir, manifest, env)
    objective = build_objective(cfg.model, cfg.data.seq_len, cfg.train.seed)
    loader = TokenLoader(
        cfg.data.dir, "train", cfg.data.seq_len, cfg.train.seed, env.rank, env.world_size,
        cfg.train.batch_size, cfg.train.micro_batch_size, objective,
    )
    return TrainingData(manifest, objective, loader, SplitWindows(cfg.data.dir, "val", cfg.data.seq_len))


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
