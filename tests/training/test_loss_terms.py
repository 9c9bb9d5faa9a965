"""Named loss terms: a family from outside lm (tests/models/aux_family.py) adds three terms, a token-weighted mean,
a sum and a max, with no file in lm/ naming them. The trainer logs each by name (the log line, metrics.jsonl,
TensorBoard); under ddp on 2 processes and under parallel.pp=2 each reduces to the 1-process value; weighted into
the objective, a term changes the gradients."""

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.distributed.test_engines import SAME_BATCH_REL, train

# untied: a pipeline puts the embedding and the head on different stages
AUX = ["--model.arch=gpt_aux", "--model.n_head=2", "--model.tie_embeddings=false", "--train.steps=2"]
TERMS = ("loss", "hidden_sq", "targets", "hidden_max")
TOKENS_PER_STEP = 8 * 16  # TINY's train.batch_size x data.seq_len

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def aux_runs(tiny_data_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("aux")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LM_FAMILIES", "tests.models.aux_family")
        train(1, root / "one", tiny_data_dir, *AUX, "--log.tensorboard=true")
        train(2, root / "ddp", tiny_data_dir, *AUX)
        train(2, root / "pp2", tiny_data_dir, *AUX, "--parallel.engine=fsdp", "--parallel.pp=2")
        train(1, root / "weighted", tiny_data_dir, *AUX, "--model.aux_weight=5")
    return root


def steps(run: Path) -> dict[int, dict]:
    """The train rows of a run's metrics.jsonl by step."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "train/loss" in row}


def test_every_term_is_logged_by_name(aux_runs):
    rows = steps(aux_runs / "one")
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert row["train/targets"] == TOKENS_PER_STEP  # summed over the step's 4 micro-batches
        assert 0 < row["train/hidden_sq"] and 0 < row["train/hidden_max"]
    line = next(line for line in (aux_runs / "one.log").read_text().splitlines() if "step 1/2 |" in line)
    for name in TERMS:
        assert f" {name} {rows[1][f'train/{name}']:.4f} |" in line, (name, line)
    events = EventAccumulator(str(aux_runs / "one/tb"))
    events.Reload()
    for name in TERMS:
        logged = [event.value for event in events.Scalars(f"train/{name}")]
        assert logged == pytest.approx([rows[1][f"train/{name}"], rows[2][f"train/{name}"]], rel=1e-6)


@pytest.mark.parametrize("layout", ["ddp", "pp2"])
def test_each_term_reduces_to_the_one_process_value(aux_runs, layout):
    one, other = steps(aux_runs / "one"), steps(aux_runs / layout)
    assert sorted(other) == [1, 2]
    for name in TERMS:  # the same weights at step 1: only the reductions' rounding differs
        assert other[1][f"train/{name}"] == pytest.approx(one[1][f"train/{name}"], rel=1e-6, abs=1e-6), name
        assert other[2][f"train/{name}"] == pytest.approx(one[2][f"train/{name}"], rel=SAME_BATCH_REL), name
    assert other[1]["train/targets"] == TOKENS_PER_STEP


def test_a_term_weighted_into_the_objective_changes_the_gradients(aux_runs):
    plain, weighted = steps(aux_runs / "one"), steps(aux_runs / "weighted")
    # the same weights before the first update: the same terms, but another gradient
    assert weighted[1]["train/loss"] == plain[1]["train/loss"]
    assert weighted[1]["train/objective"] == pytest.approx(
        plain[1]["train/loss"] + 5 * plain[1]["train/hidden_sq"], rel=1e-6)
    assert "train/objective" not in plain[1]
    assert weighted[1]["train/grad_norm"] != pytest.approx(plain[1]["train/grad_norm"], rel=1e-3)
    assert weighted[2]["train/loss"] != pytest.approx(plain[2]["train/loss"], rel=1e-4)
