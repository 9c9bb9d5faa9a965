"""What a sweep's table reads from a run's metrics log (`lm.sweep.results`)."""

import json
import math

from lm.sweep.results import RunResult, markdown, read_result, table_rows


def test_a_last_window_of_skipped_steps_leaves_the_last_loss_trained_to(tmp_path):
    rows = [{"step": 2, "tokens": 64, "elapsed_s": 1.0, "train/loss": 5.5, "train/skipped_steps": 0},
            {"step": 2, "tokens": 64, "elapsed_s": 1.5, "val/loss": 5.75},
            # every step of this window was skipped: the trainer logs no loss for it
            {"step": 4, "tokens": 128, "elapsed_s": 2.0, "train/grad_norm": float("nan"), "train/skipped_steps": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = read_result(tmp_path, {"optim.lr": 1e-3}, 10, "finished")
    assert (result.train_loss, result.val_loss, result.tokens, result.wall_s) == (5.5, 5.75, 128, 2.0)


def result(name: str, val_loss: float | None, status: str = "finished") -> RunResult:
    return RunResult(name, {"optim.lr": 1e-3}, 10, status, val_loss=val_loss)


def test_the_table_ranks_finished_runs_by_val_loss_a_diverged_one_last_then_the_unfinished():
    results = [result("a", 3.0), result("nan", math.nan), result("b", 1.0), result("c", 2.0),
               result("failed", 0.5, "failed (exit 2; see train.log)"), result("none", None)]
    _, rows = table_rows(results)
    assert [row[1] for row in rows] == ["b", "c", "a", "nan", "none", "failed"]
    assert rows[3][-3:-1] == ["nan", "nan"]  # its loss and perplexity, no ppl of inf


def test_a_run_that_failed_before_its_first_log_row_has_no_numbers(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")  # the logger opened it; the run failed at its first step
    failed = read_result(tmp_path, {"optim.lr": 1e6}, 10, "failed (exit 2; see train.log)")
    assert failed.status == "failed (exit 2; see train.log)" and failed.val_loss is failed.tokens is None


def test_an_unreadable_metrics_log_is_named_in_the_status_and_the_table_is_still_written(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "to\n{"step": 2}\n')
    unreadable = read_result(tmp_path, {"optim.lr": 1e-3}, 10, "finished")
    assert unreadable.status.startswith("finished; its metrics are unreadable: ")
    assert "metrics.jsonl:1: not a JSON object" in unreadable.status and unreadable.val_loss is None
    assert markdown([unreadable]).count("its metrics are unreadable") == 1


def test_the_table_reads_the_last_rows_and_keeps_four_digits(tmp_path):
    rows = [{"step": 2, "tokens": 64, "elapsed_s": 1.0, "train/loss": 5.5},
            {"step": 2, "tokens": 64, "elapsed_s": 1.5, "val/loss": 5.75},
            {"step": 4, "tokens": 128, "elapsed_s": 2.0, "train/loss": 4.5},
            {"step": 4, "tokens": 128, "elapsed_s": 2.5, "val/loss": 2.34514}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    last = read_result(tmp_path, {"optim.lr": 1e-3}, 10, "finished")
    assert (last.train_loss, last.val_loss, last.tokens, last.wall_s) == (4.5, 2.34514, 128, 2.5)
    near = result("near", 2.34494)  # runs 2e-4 apart print apart
    _, table = table_rows([last, near])
    assert [row[1] for row in table] == ["near", tmp_path.name] and [row[-3] for row in table] == ["2.3449", "2.3451"]
