"""Data integrity at training start: shard checksums on request, and a dataset that changed under a run."""

import dataclasses
import json
import logging
import re
import shutil

import numpy as np
import pytest

from lm.checkpoint.store import complete_checkpoints
from lm.data.prepare import prepare
from lm.data.shards import HEADER_BYTES
from lm.distributed.env import init_distributed
from lm.errors import CheckpointError, DataError
from lm.training.trainer import Trainer
from tests.training.test_faults import config, refused_run


def flip_byte(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.fixture
def flipped_data(tiny_data_dir, tmp_path):
    """A copy of the tiny data whose second train shard has one token byte flipped (size unchanged)."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    flip_byte(data / "train_00001.bin", HEADER_BYTES + 101)
    return data


def test_a_flipped_byte_in_a_data_shard_is_named_when_hashes_are_checked(flipped_data, tmp_path):
    with pytest.raises(DataError, match=r"train_00001.bin: sha256 differs from manifest.json"):
        Trainer(config(flipped_data, tmp_path / "run", "--data.verify_hashes=true"), init_distributed("cpu"))
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


@pytest.mark.process
def test_both_ranks_refuse_a_flipped_data_shard_together(flipped_data, tmp_path):
    # rank 0 hashes and broadcasts its finding: rank 1 must fail too, not wait in a collective
    replies = refused_run(2, flipped_data, tmp_path / "run", "--data.verify_hashes=true", "--train.steps=2")
    assert [r["value"] for r in replies] == [2, 2]
    for r in replies:
        assert r["stderr"].count("error: ") == 1, r["stderr"]
        assert "train_00001.bin: sha256 differs from manifest.json" in r["stderr"]


def test_intact_shards_pass_the_check(tiny_data_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="lm.train"):
        Trainer(config(tiny_data_dir, tmp_path / "run", "--data.verify_hashes=true"), init_distributed("cpu"))
    assert "every shard matches its sha256 in the manifest" in caplog.text


@pytest.fixture
def other_data(tiny_data_config, tiny_corpus_dir, tmp_path):
    """The first ten Macbeth scenes prepared like the tiny data: another dataset, same tokenizer."""
    cfg = dataclasses.replace(tiny_data_config, source=str(tiny_corpus_dir / "scene_0*.txt"),
                              dir=str(tmp_path / "other"))
    prepare(cfg)
    return tmp_path / "other"


def test_a_dataset_that_changed_under_a_run_is_refused_on_resume(tiny_data_dir, other_data, tmp_path, caplog):
    run = tmp_path / "run"
    Trainer(config(tiny_data_dir, run, "--train.steps=2"), init_distributed("cpu")).fit()
    state = json.loads((complete_checkpoints(run / "checkpoints")[-1] / "state.json").read_text())
    assert state["data"]["train_tokens"] == 25_450
    with pytest.raises(CheckpointError, match=r"step_00000002 trained on .*\*.txt' \(25,450 train tokens, content "
                                              r"hash [0-9a-f]{12}\), but data.dir=.*other' now holds .*scene_0\*.txt'"
                                              r".*or set checkpoint.allow_data_change=true"):
        Trainer(config(other_data, run, "--train.steps=4"), init_distributed("cpu"))
    # the same data in another directory is the same dataset
    moved = tmp_path / "moved"
    shutil.copytree(tiny_data_dir, moved)
    assert Trainer(config(moved, run, "--train.steps=4"), init_distributed("cpu")).step == 2
    # said explicitly, the run goes on with the new data, and its next checkpoint records that data
    with caplog.at_level(logging.WARNING, logger="lm.checkpoint"):
        Trainer(config(other_data, run, "--train.steps=4", "--checkpoint.allow_data_change=true"),
                init_distributed("cpu")).fit()
    assert "going on with the new data (checkpoint.allow_data_change=true)" in caplog.text
    state = json.loads((complete_checkpoints(run / "checkpoints")[-1] / "state.json").read_text())
    assert state["step"] == 4 and state["data"]["source"].endswith("scene_0*.txt")


@pytest.mark.process
def test_token_ids_beyond_the_vocabulary_stop_training_naming_the_shard(tiny_data_dir, tmp_path):
    """Bytes flipped after preparing (data.verify_hashes off, the default) into ids the embedding does not
    have: the window that holds one stops the run with the file and position, not an IndexError."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    for shard in sorted(data.glob("train_*.bin")):  # every 50th token: the first batch meets one
        tokens = np.memmap(shard, dtype="<u2", mode="r+", offset=HEADER_BYTES)
        tokens[::50] = 65535
        tokens.flush()
    (result,) = refused_run(1, data, tmp_path / "run", "--train.steps=4")
    assert result["value"] == 2
    (line,) = result["stderr"].strip().splitlines()
    assert re.fullmatch(rf"error: {data}/train_\d{{5}}.bin: token 65535 at position [\d,]+ is not below the "
                        r"vocabulary size 50257 \(the file changed since it was prepared\); check it with `python -m "
                        r"lm.prepare --verify` and prepare it again with --force", line), line
    assert not complete_checkpoints(tmp_path / "run/checkpoints")


def test_data_prepared_again_from_a_changed_corpus_of_the_same_name_is_refused_on_resume(tiny_corpus_dir,
                                                                                          tiny_data_config, tmp_path):
    """The data is known by its content hash: prepared again from the same source glob after a file of the corpus
    changed, it records the same source, and a resume on it must still be refused."""
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus_dir, corpus)
    first = dataclasses.replace(tiny_data_config, source=str(corpus / "*.txt"), dir=str(tmp_path / "first"))
    prepare(first)
    run = tmp_path / "run"
    Trainer(config(first.dir, run, "--train.steps=2"), init_distributed("cpu")).fit()
    scene = corpus / "scene_05.txt"
    scene.write_text(scene.read_text().replace("Macbeth", "Banquo"))
    again = dataclasses.replace(first, dir=str(tmp_path / "again"))
    prepare(again)
    manifests = [json.loads((tmp_path / name / "manifest.json").read_text()) for name in ("first", "again")]
    assert manifests[0]["source"] == manifests[1]["source"]
    assert manifests[0]["content_hash"] != manifests[1]["content_hash"]
    with pytest.raises(CheckpointError, match=r"step_00000002 trained on .* content hash [0-9a-f]{12}\), but data.dir="
                                              r".*again' now holds .*or set checkpoint.allow_data_change=true"):
        Trainer(config(again.dir, run, "--train.steps=4"), init_distributed("cpu"))
