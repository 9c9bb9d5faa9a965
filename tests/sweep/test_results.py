"""What a sweep's table reads from a run's metrics log (`lm.sweep.results`)."""

import json
import math

from lm.sweep.results import RunResult, csv_text, markdown, read_result, table_rows


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


def test_the_table_derives_rank_tokens_per_second_and_each_losss_own_perplexity():
    fast = RunResult("fast", {"optim.lr": 1e-3}, 1234, "finished", tokens=4000, wall_s=8.0, train_loss=2.0,
                     val_loss=1.0)
    slow = RunResult("slow", {"optim.lr": 3e-3}, 1234, "finished", tokens=4000, wall_s=16.0, train_loss=3.0,
                     val_loss=1.5)
    header, rows = table_rows([slow, fast])
    assert header[:3] == ["rank", "run", "optim.lr"]
    by_column = [dict(zip(header, row)) for row in rows]
    # the best val loss is rank 1, counted from one
    assert [(r["rank"], r["run"]) for r in by_column] == [("1", "fast"), ("2", "slow")]
    # tokens over seconds, not seconds over tokens
    assert [r["tokens/s"] for r in by_column] == ["500", "250"]
    # each perplexity is exp of its own loss: train ppl from the train loss, val ppl from the val loss
    assert by_column[0]["train ppl"] == f"{math.exp(2.0):.2f}" == "7.39"
    assert by_column[0]["val ppl"] == f"{math.exp(1.0):.2f}" == "2.72"
    assert by_column[1]["train ppl"] == "20.09" and by_column[1]["val ppl"] == "4.48"
    assert by_column[0]["params"] == "1,234" and by_column[0]["tokens"] == "4,000"


def test_the_csv_holds_plain_numbers_without_thousands_separators():
    run = RunResult("big", {"optim.lr": 1e-3}, 1_234_567, "finished", tokens=2_000_000, wall_s=1000.0,
                    train_loss=2.0, val_loss=1.0)
    lines = csv_text([run]).splitlines()
    assert lines[0].startswith("rank,run,optim.lr,params,tokens,wall time (s),tokens/s,")
    assert lines[1].startswith("1,big,0.001,1234567,2000000,1000.0,2000,2.0000,7.39,1.0000,2.72,finished")
