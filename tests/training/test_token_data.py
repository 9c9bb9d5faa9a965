"""The training data a run opens (`lm.training.token_data`): its splits checked before the first step, for every
mixture source and every data-parallel rank."""

import hashlib
import json

import pytest
import torch

from lm.config import load_config
from lm.data.config import MixtureSource
from lm.distributed.env import DistEnv
from lm.errors import ConfigError, DataError
from lm.training.token_data import TrainingData, open_training_data
from tests.data.test_loader import make_data_dir

SMALL = ["--data.tokenizer=gpt2", "--model.vocab_size=50257", "--data.seq_len=4", "--model.block_size=8",
         "--model.n_layer=1", "--model.n_head=1", "--model.d_model=8", "--train.eval_batches=5"]


def test_every_mixture_sources_val_split_is_checked_at_the_start(tmp_path):
    # windows of 4 tokens: a's val split of 9 tokens holds 2 (one micro-batch of 2), b's of 5 tokens holds 1 (none)
    a = make_data_dir(tmp_path / "a", [41], val_lengths=(9,))
    b = make_data_dir(tmp_path / "b", [41], val_lengths=(5,), base=100)
    cfg = load_config(None, [*SMALL, f"--data.mixture=[{{dir: {a}}}, {{dir: {b}}}]", "--train.batch_size=2",
                             "--train.micro_batch_size=2"])
    with pytest.raises(DataError, match=rf"{b}: the val split has 1 windows of data.seq_len=4, fewer than "
                                        r"train.micro_batch_size \(2\) x world size \(1\)"):
        open_training_data(cfg, DistEnv(0, 0, 1, torch.device("cpu")))


def test_the_val_split_is_checked_against_every_data_parallel_rank(tmp_path):
    # 1 val window, micro-batches of 1: rank 1 of 2 would have no batch to score
    data = make_data_dir(tmp_path / "data", [41], val_lengths=(5,))
    cfg = load_config(None, [*SMALL, f"--data.dir={data}", "--train.batch_size=2", "--train.micro_batch_size=1"])
    with pytest.raises(DataError, match=r"the val split has 1 windows of data.seq_len=4, fewer than "
                                        r"train.micro_batch_size \(1\) x world size \(2\)"):
        open_training_data(cfg, DistEnv(0, 0, 2, torch.device("cpu")))
    open_training_data(cfg, DistEnv(0, 0, 1, torch.device("cpu")))  # one rank scores it


def manifest(content_hash: str, tokens: int) -> dict:
    return {"content_hash": content_hash, "source": "corpus", "splits": {"train": {"tokens": tokens}}}


def test_a_mixtures_identity_hashes_each_sources_weight_and_counts_all_their_tokens(tmp_path):
    def identity(weights: tuple[float, float]) -> dict:
        sources = [MixtureSource(str(tmp_path / "a"), weights[0]), MixtureSource(str(tmp_path / "b"), weights[1])]
        return TrainingData(sources, True, [manifest("h-a", 100), manifest("h-b", 30)], None, None, []).identity()

    three_to_one = identity((3, 1))
    parts = [["a", 3, "h-a"], ["b", 1, "h-b"]]
    assert three_to_one == {"content_hash": hashlib.sha256(json.dumps(parts).encode()).hexdigest(),
                            "source": "mixture of a (3), b (1)", "train_tokens": 130}
    # the same directories drawn in other shares are other training data: a resume must see the change
    assert identity((1, 1))["content_hash"] != three_to_one["content_hash"]


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused_when_the_data_opens(tmp_path):
    data = make_data_dir(tmp_path / "data", [41], val_lengths=(40,))
    cfg = load_config(None, ["--data.tokenizer=gpt2", "--model.vocab_size=50257", "--data.seq_len=4",
                             "--model.block_size=8", "--model.n_layer=1", "--model.n_head=1", "--model.d_model=8",
                             f"--data.dir={data}", "--train.batch_size=2", "--train.micro_batch_size=2"])
    with pytest.raises(ConfigError, match=r"^train.batch_size: 2 is not a multiple of train.micro_batch_size \(2\) x 2 "
                                          r"data-parallel replica\(s\) \(world size 2\); expected a multiple of 4"):
        open_training_data(cfg, DistEnv(0, 0, 2, torch.device("cpu")))
