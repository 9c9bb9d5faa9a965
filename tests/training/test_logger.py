"""The trainer's metrics logger (`lm.training.logger.MetricLogger`): what it leaves in metrics.jsonl and
TensorBoard when a run diverges, starts over or was killed mid-write."""

import json
import time

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.plugins.hparams import plugin_data_pb2

from lm.config import load_config
from lm.distributed.env import DistEnv
from lm.models.terms import Reduce, Term
from lm.report.metrics import read_metrics
from lm.training import logger as logger_module
from lm.training.logger import MetricLogger, TrainWindow, across_ranks, hparams, val_line
from tests.workers import job_env, pool


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


CPU = torch.device("cpu")
ONE = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU)


def terms(loss: float, count: float, peak: float, weight: float = 64.0) -> dict[str, Term]:
    return {"loss": Term(torch.tensor(loss), Reduce.MEAN, weight), "count": Term(torch.tensor(count), Reduce.SUM),
            "peak": Term(torch.tensor(peak), Reduce.MAX)}


def test_a_window_averages_its_applied_steps_keeps_the_largest_max_and_counts_every_steps_tokens():
    window = TrainWindow(CPU)
    window.add(terms(2.0, 10.0, 1.0), torch.tensor(True), 100)
    window.add(terms(float("nan"), float("nan"), float("nan")), torch.tensor(False), 100)  # skipped: left out
    window.add(terms(4.0, 20.0, 5.0), torch.tensor(True), 100)
    window.add(terms(3.0, 30.0, 2.0), torch.tensor(True), 100)
    values, tokens, _ = window.read(ONE)
    # MEAN and SUM terms: the mean over the 3 applied steps; MAX: the largest of them
    assert values == {"loss": pytest.approx(3.0), "count": pytest.approx(20.0), "peak": 5.0}
    assert tokens == 400  # the skipped step read its tokens too
    # read starts a new window
    window.add(terms(7.0, 1.0, 0.5), torch.tensor(True), 50)
    values, tokens, _ = window.read(ONE)
    assert values == {"loss": 7.0, "count": 1.0, "peak": 0.5} and tokens == 50


def test_a_window_whose_every_step_was_skipped_has_no_terms():
    window = TrainWindow(CPU)
    window.add(terms(float("nan"), 3.0, 1.0), torch.tensor(False), 100)
    window.add(terms(float("inf"), 3.0, 1.0), torch.tensor(False), 100)
    values, tokens, _ = window.read(ONE)
    assert values == {} and tokens == 200  # not a loss of 0, which would read as a perfect model


def test_time_paused_for_evaluation_is_left_out_of_the_windows_training_time():
    window = TrainWindow(CPU)
    window.add(terms(2.0, 1.0, 1.0), torch.tensor(True), 1000)
    with window.paused():
        time.sleep(0.5)
    _, tokens, seconds = window.read(ONE)
    assert tokens == 1000 and 0 < seconds < 0.25  # tokens/s is not diluted by the evaluation's half second


def reduce_two_ranks() -> dict[str, float]:
    """Rank 0 holds 10 targets at a mean of 2, rank 1 30 at a mean of 4; a count of 1 and 2; a max of 7 and 3."""
    rank = dist.get_rank()
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, device=CPU)
    values = {"loss": torch.tensor([2.0, 4.0][rank]), "count": torch.tensor([1.0, 2.0][rank]),
              "peak": torch.tensor([7.0, 3.0][rank])}
    reduces = {"loss": Reduce.MEAN, "count": Reduce.SUM, "peak": Reduce.MAX}
    weights = {"loss": torch.tensor([10.0, 30.0][rank]), "count": None, "peak": None}
    return across_ranks(values, reduces, weights, env)


@pytest.mark.process
def test_terms_over_two_ranks_weigh_a_mean_by_each_ranks_targets_add_a_sum_and_keep_the_largest_max():
    replies = pool(2).run(reduce_two_ranks, env=job_env())
    for reply in replies:  # every rank gets the same values
        assert reply["value"] == {"loss": pytest.approx((2 * 10 + 4 * 30) / 40), "count": 3.0, "peak": 7.0}


def test_a_row_holds_the_tokens_and_the_elapsed_seconds_to_the_millisecond_and_is_on_disk_at_once(tmp_path):
    metrics = MetricLogger(tmp_path, enabled=True, tensorboard=True)
    metrics.log(7, 4096, 12.34567, {"train/loss": 2.5}, "step {step}")
    # readable before close: a killed run keeps every row it logged, TensorBoard its points
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row == {"step": 7, "tokens": 4096, "elapsed_s": 12.346, "train/loss": 2.5}
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(7, 2.5)]
    metrics.close()


def test_a_window_keeps_a_negative_max_term():
    window = TrainWindow(torch.device("cpu"))
    for peak in (-3.0, -2.0):
        window.add({"peak": Term(torch.tensor(peak), Reduce.MAX)}, torch.tensor(True), 1)
    values, _, _ = window.read(DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    assert values == {"peak": -2.0}


def test_a_skipped_steps_targets_are_left_out_of_the_weight_a_mean_is_reduced_by(monkeypatch):
    seen = {}
    real = logger_module.across_ranks

    def recording(values, reduces, weights, env):
        seen.update({name: None if w is None else w.item() for name, w in weights.items()})
        return real(values, reduces, weights, env)

    monkeypatch.setattr(logger_module, "across_ranks", recording)
    window = TrainWindow(torch.device("cpu"))
    window.add({"loss": Term(torch.tensor(2.0), Reduce.MEAN, 64.0)}, torch.tensor(True), 1)
    window.add({"loss": Term(torch.tensor(float("nan")), Reduce.MEAN, 32.0)}, torch.tensor(False), 1)
    values, _, _ = window.read(DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    assert values == {"loss": 2.0} and seen == {"loss": 64.0}


def sum_over_a_context_parallel_pair() -> dict[str, float]:
    """Two ranks of one context-parallel group: each holds the group's count, 1.5."""
    rank = dist.get_rank()
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), cp=2)
    return across_ranks({"count": torch.tensor(1.5)}, {"count": Reduce.SUM}, {"count": None}, env)


@pytest.mark.process
def test_a_sum_term_is_counted_once_per_context_parallel_group():
    replies = pool(2).run(sum_over_a_context_parallel_pair, env=job_env())
    assert [reply["value"] for reply in replies] == [{"count": 1.5}, {"count": 1.5}]


def test_the_hparams_hold_the_parameter_count_and_every_key_with_a_list_as_its_text():
    cfg = load_config(None, [])
    flat = hparams(cfg, 1234)
    assert flat["params"] == 1234
    assert flat["train.batch_size"] == cfg.train.batch_size
    assert flat["data.mixture"] == str(cfg.data.mixture) and isinstance(flat["data.mixture"], str)


def test_the_val_line_shows_each_reported_metric_in_order_with_its_precision_then_each_source():
    val = {"val/loss": 1.234567, "val/ppl": 3.43678, "val/accuracy": 0.5, "val/f1": None, "val/mse": 0.25,
           "val/pearson": 0.75, "val/web/loss": 1.5, "val/code/loss": 0.98765}
    assert val_line(val, ["web", "code"]).format(step=12) == (
        "step 12 | val loss 1.2346 | val ppl 3.44 | accuracy 0.5000 | F1 n/a | MSE 0.2500 | Pearson r 0.7500 | "
        "web 1.5000 | code 0.9877")


def test_the_hparams_view_lists_the_metrics_the_run_logs_beside_its_settings(tmp_path):
    metrics = MetricLogger(tmp_path, enabled=True, tensorboard=True)
    metrics.log_hparams({"optim.lr": 0.003}, ["train/loss", "val/loss"])
    metrics.close()
    experiments = [plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content).experiment
                   for path in sorted((tmp_path / "tb").glob("events.out.tfevents.*"))
                   for event in EventFileLoader(str(path)).Load() for value in event.summary.value
                   if value.tag == "_hparams_/experiment"]
    assert len(experiments) == 1
    assert [info.name.tag for info in experiments[0].metric_infos] == ["train/loss", "val/loss"]
    assert [info.name for info in experiments[0].hparam_infos] == ["optim.lr"]
