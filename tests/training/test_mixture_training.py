"""Training on a weighted mixture of two prepared directories, on real 2-process gloo groups: per-source
validation and token counts, and a run interrupted 2 -> 1 -> 2 ranks that reads the uninterrupted run's stream."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lm.data.config import DataConfig
from lm.data.prepare import prepare
from tests.workers import job_env, train_in_pool

# every test here runs lm.train in processes of its own (torchrun for 2): the full tier only
pytestmark = pytest.mark.process

TINY = [
    "--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32",
    "--data.seq_len=16", "--train.batch_size=8", "--train.micro_batch_size=2", "--train.device=cpu",
    "--train.eval_every=2", "--train.eval_batches=2", "--log.every=1", "--log.tensorboard=false",
    "--log.sample_every=0", "--checkpoint.every=2", "--checkpoint.keep=5", "--optim.lr=3e-3",
    "--schedule.warmup_steps=2", "--schedule.decay_steps=6",
]


@pytest.fixture(scope="module")
def second_data_dir(tiny_corpus_dir, tmp_path_factory) -> Path:
    """The first 8 scenes of the tiny corpus as a source of their own (the gpt2 tokenizer, like tiny_data_dir)."""
    files = ",".join(str(p) for p in sorted(tiny_corpus_dir.glob("*.txt"))[:8])
    cfg = DataConfig(source=files, dir=str(tmp_path_factory.mktemp("second") / "data"), val_fraction=0.25,
                     shard_tokens=4096, seq_len=16)
    prepare(cfg)
    return Path(cfg.dir)


def train(nproc: int, out: Path, mixture: str, steps: int, *extra: str) -> list[dict]:
    """Run lm.train on `nproc` ranks of this session's pool (`tests.workers`) up to `steps`; returns every
    metrics row so far."""
    args = [*TINY, f"--data.mixture={mixture}", f"--train.out_dir={out}", f"--train.steps={steps}", *extra]
    train_in_pool(nproc, args, job_env())
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.fixture(scope="module")
def whole_run(tiny_data_dir, second_data_dir, tmp_path_factory) -> tuple[Path, list[dict]]:
    """6 uninterrupted steps on 2 ranks of Macbeth and the second source weighted 3 to 1: the run directory
    (read-only) and its metrics rows."""
    out = tmp_path_factory.mktemp("mixture") / "whole"
    mixture = f"[{{dir: {tiny_data_dir}, weight: 3, name: macbeth}}, {{dir: {second_data_dir}, weight: 1}}]"
    return out, train(2, out, mixture, 6)


def test_a_mixture_resumed_2_1_2_ranks_reads_the_uninterrupted_stream(tiny_data_dir, second_data_dir, tmp_path,
                                                                      whole_run):
    mixture = f"[{{dir: {tiny_data_dir}, weight: 3, name: macbeth}}, {{dir: {second_data_dir}, weight: 1}}]"
    whole = whole_run[1]
    for nproc, steps in ((2, 2), (1, 4), (2, 6)):  # each process resumes the last one's checkpoint
        parts = train(nproc, tmp_path / "parts", mixture, steps)
    # the samples of every step are the same: the tokens each source served match exactly, and the losses
    # to the rounding of another reduction order (a different sample would move them by far more)
    for key in ("data/macbeth/tokens", "data/data/tokens", "data/macbeth/epochs"):
        assert by_step(parts, key) == by_step(whole, key), key
    tokens = by_step(whole, "data/macbeth/tokens")
    assert tokens[6] + by_step(whole, "data/data/tokens")[6] == 6 * 8 * 16
    assert abs(tokens[6] / 16 - 0.75 * 48) <= 3
    assert by_step(parts, "train/loss") == pytest.approx(by_step(whole, "train/loss"), rel=1e-5)

    # validation per source, and their mean by the weights as val/loss
    val = [r for r in whole if "val/loss" in r]
    assert [r["step"] for r in val] == [2, 4, 6]
    for r in val:
        assert r["val/loss"] == pytest.approx(0.75 * r["val/macbeth/loss"] + 0.25 * r["val/data/loss"], rel=1e-12)
        assert r["val/macbeth/ppl"] == pytest.approx(math.exp(r["val/macbeth/loss"]))
        assert r["val/ppl"] == pytest.approx(math.exp(r["val/loss"]))
        assert r["val/macbeth/loss"] != r["val/data/loss"]
    assert val[-1]["val/macbeth/loss"] < val[0]["val/macbeth/loss"]
    state = json.loads((tmp_path / "parts/checkpoints/step_00000006/state.json").read_text())
    assert state["data"]["source"] == "mixture of macbeth (3), data (1)"


def test_changing_the_weights_is_refused_on_resume(tiny_data_dir, second_data_dir, whole_run):
    run = whole_run[0]  # trained on weights 3 and 1; the refusal must leave it as it is
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")}
    mixture = f"[{{dir: {tiny_data_dir}, name: macbeth, weight: 1}}, {{dir: {second_data_dir}, weight: 1}}]"
    cmd = [sys.executable, "-m", "lm.train", *TINY, f"--train.out_dir={run}", "--train.steps=8",
           f"--data.mixture={mixture}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "trained on 'mixture of macbeth (3), data (1)'" in line
    assert "but data.mixture now holds 'mixture of macbeth (1), data (1)'" in line
    assert before == {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")}
