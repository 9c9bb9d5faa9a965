"""A prepare builds in <data.dir>.partial, one at a time, and a rerun goes on from the shards a killed one
finished: tried with a real SIGKILL of `python -m lm.prepare`, and piece by piece on the staging directory."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lm.data.config import DataConfig
from lm.data.corpora import find_corpus
from lm.data.prepare import prepare
from lm.data.shards import open_shard
from lm.data.staging import Staging
from lm.errors import DataError

REPO = Path(__file__).resolve().parents[2]
SPLITS = ("train", "val")


def tree_digest(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.process
def test_a_prepare_killed_with_sigkill_goes_on_from_its_finished_shards(tmp_path, caplog):
    # 12 plays (0.5 M tokens) on one thread into shards of 10,000 tokens: ~0.2 s of tokenizing, ~50 shards,
    # and the kill lands right after the second shard is recorded
    plays = ",".join(str(path) for path in find_corpus("shakespeare").files[:12])
    settings = dict(source=plays, shard_tokens=10_000, val_fraction=0.1, num_workers=1)
    reference = prepare(DataConfig(dir=str(tmp_path / "reference"), **settings))
    argv = [f"--data.{key}={value}" for key, value in settings.items()] + [f"--data.dir={tmp_path / 'data'}"]
    proc = subprocess.Popen([sys.executable, "-m", "lm.prepare", *argv], env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    progress = tmp_path / "data.partial" / "progress.json"
    try:
        while proc.poll() is None and not (progress.is_file() and _finished(json.loads(progress.read_text())) >= 2):
            time.sleep(0.002)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()  # killed mid-run, not finished
    assert not (tmp_path / "data").exists()

    saved = json.loads(progress.read_text())
    finished = [e["file"] for w in saved["writers"].values() for e in w["shards"]]
    inodes = {name: (tmp_path / "data.partial" / name).stat().st_ino for name in finished}
    kept = sum(e["tokens"] for w in saved["writers"].values() for e in w["shards"]) + sum(
        w["open"]["tokens"] for w in saved["writers"].values() if w["open"])
    with caplog.at_level(logging.INFO):
        manifest = prepare(DataConfig(dir=str(tmp_path / "data"), **settings))
    assert f"{len(finished)} finished shards" in caplog.text
    total = sum(s["tokens"] for s in manifest["splits"].values())
    tokenized = int(re.search(r", (\d+) of them tokenized in this run", caplog.text).group(1))
    assert tokenized == total - kept  # what the kept shards hold was not tokenized again
    assert {name: (tmp_path / "data" / name).stat().st_ino for name in finished} == inodes  # kept, not rewritten
    assert manifest == reference
    assert tree_digest(tmp_path / "data") == tree_digest(tmp_path / "reference")  # byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "reference"]


def _finished(saved: dict) -> int:
    return sum(len(w["shards"]) for w in saved["writers"].values())


def _tokens(directory: Path, writers: dict, split: str) -> list[int]:
    return np.concatenate([open_shard(directory / s["file"]) for s in writers[split].close()]).tolist()


def test_staging_goes_on_from_saved_progress_and_cuts_back_what_came_after(tmp_path, caplog):
    out = tmp_path / "data"
    with Staging(out, "hash") as staging:
        progress, writers = staging.start(SPLITS, 4, np.dtype(np.uint16))
        writers["train"].add(np.arange(10, dtype=np.uint16))  # two shards finished, two tokens open
        writers["val"].add(np.arange(3, dtype=np.uint16))
        progress.position, progress.documents = (2, 7), {"train": 5, "val": 1}
        staging.save(progress, writers)
        # after the save, and lost with a kill: the open shard is finished and renamed, the next one begun
        writers["train"].add(np.arange(100, 107, dtype=np.uint16))
        (staging.dir / ".train_00009.bin.0000.tmp").write_bytes(b"not named in the progress")
    with caplog.at_level(logging.INFO), Staging(out, "hash") as staging:
        progress, writers = staging.start(SPLITS, 4, np.dtype(np.uint16))
        assert "2 finished shards (8 tokens) kept, 6 documents done" in caplog.text
        assert progress.position == (2, 7) and progress.documents == {"train": 5, "val": 1}
        assert not (staging.dir / ".train_00009.bin.0000.tmp").exists()
        writers["train"].add(np.array([50, 51], dtype=np.uint16))
        assert _tokens(staging.dir, writers, "train") == [*range(10), 50, 51]
        assert _tokens(staging.dir, writers, "val") == [0, 1, 2]


@pytest.mark.parametrize("damage", ["other input", "flipped byte", "missing shard", "short open shard", "bad json"])
def test_staging_starts_over_when_its_progress_does_not_check_out(tmp_path, caplog, damage):
    out = tmp_path / "data"
    with Staging(out, "hash") as staging:
        progress, writers = staging.start(SPLITS, 4, np.dtype(np.uint16))
        writers["train"].add(np.arange(6, dtype=np.uint16))
        staging.save(progress, writers)
        state = writers["train"].state()
    shard, open_shard_file = staging.dir / "train_00000.bin", staging.dir / state["open"]["file"]
    if damage == "flipped byte":
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 1
        shard.write_bytes(bytes(raw))
    elif damage == "missing shard":
        shard.unlink()
    elif damage == "short open shard":
        os.truncate(open_shard_file, open_shard_file.stat().st_size - 2)
    elif damage == "bad json":
        (staging.dir / "progress.json").write_text("{")
    with caplog.at_level(logging.INFO), Staging(out, "other" if damage == "other input" else "hash") as staging:
        progress, writers = staging.start(SPLITS, 4, np.dtype(np.uint16))
        assert "starting" in caplog.text and "over" in caplog.text
        assert progress.position == (0, 0) and writers["train"].shards == []
        assert [p.name for p in staging.dir.iterdir()] == [".lock"]


def test_two_prepares_cannot_share_a_staging_directory(tmp_path):
    with Staging(tmp_path / "data", "hash"):
        with pytest.raises(DataError, match=r"another lm.prepare is writing .*data.partial"):
            Staging(tmp_path / "data", "hash").__enter__()
    with Staging(tmp_path / "data", "hash"):  # the lock went with the block that held it
        pass
