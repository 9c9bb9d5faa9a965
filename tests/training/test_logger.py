"""The trainer's metrics logger (`lm.training.logger.MetricLogger`): what it leaves in metrics.jsonl and
TensorBoard when a run diverges, starts over or was killed mid-write."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lm.report.metrics import read_metrics
from lm.training.logger import MetricLogger


def log(run_dir, losses: dict[int, float], tensorboard: bool = False, resumed_step: int = 0) -> None:
    logger = MetricLogger(run_dir, enabled=True, tensorboard=tensorboard, resumed_step=resumed_step)
    for step, loss in losses.items():
        logger.log(step, step * 8, step * 0.5, {"train/loss": loss, "train/ppl": 2.0}, "step {step}")
    logger.close()


def test_a_non_finite_value_is_written_as_null_so_every_json_reader_takes_the_file(tmp_path):
    log(tmp_path, {1: 3.0, 2: float("nan"), 3: float("inf")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is no JSON")) for line in lines]
    assert [row["train/loss"] for row in rows] == [3.0, None, None]
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]


def test_a_row_cut_short_by_a_killed_run_is_dropped_and_the_next_run_writes_on_a_line_of_its_own(tmp_path):
    log(tmp_path, {1: 3.0, 2: 2.5})
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 3, "tokens": 2')  # killed mid-write
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]  # the reader takes the rows before it
    log(tmp_path, {3: 2.0})  # resumed from step 2
    assert [(row["step"], row["train/loss"]) for row in read_metrics(tmp_path)] == [(1, 3.0), (2, 2.5), (3, 2.0)]
    assert path.read_text().count("\n") == 3


def test_a_cut_short_row_before_others_is_still_an_error_naming_its_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "tok\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not a JSON object"):
        read_metrics(tmp_path)


def test_a_run_that_starts_over_replaces_tensorboards_points_as_the_metrics_reader_does(tmp_path):
    # killed before its first checkpoint (or checkpoint.every=0): the next process starts again from step 0
    log(tmp_path, {5: 3.0, 10: 2.0}, tensorboard=True)
    log(tmp_path, {5: 3.5, 10: 2.5}, tensorboard=True)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(5, 3.5), (10, 2.5)]
    assert [(row["step"], row["train/loss"]) for row in read_metrics(tmp_path)] == [(5, 3.5), (10, 2.5)]


def test_a_resume_drops_every_later_row_of_its_kind_not_only_those_logged_again(tmp_path):
    log(tmp_path, {10: 3.0, 20: 2.5, 30: 2.0})
    log(tmp_path, {20: 2.75}, resumed_step=10)  # resumed from step 10 and stopped again after step 20
    assert [(row["step"], row["train/loss"]) for row in read_metrics(tmp_path)] == [(10, 3.0), (20, 2.75)]
