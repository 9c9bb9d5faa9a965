import json
import math

import pytest
from matplotlib.image import imread

from lm.errors import PlotError
from lm.report import figures
from lm.report.metrics import perplexity, read_metrics, row_kind
from lm.training.logger import MetricLogger

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOKENS_PER_STEP = 64


def log_run(run_dir, steps, val_steps=(), loss_offset=0.0):
    """Log train rows at `steps` and val rows at `val_steps` through the real logger; returns the rows."""
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = MetricLogger(run_dir, enabled=True, tensorboard=False)
    rows = []
    for step in steps:
        train_loss = 6.0 - step / 10 + loss_offset
        metrics = {"train/loss": train_loss, "train/ppl": perplexity(train_loss), "train/lr": 1e-3}
        row = {"step": step, "tokens": step * TOKENS_PER_STEP, "elapsed_s": step * 0.5, **metrics}
        logger.log(step, row["tokens"], row["elapsed_s"], metrics, "step {step}")
        rows.append(row)
        if step in val_steps:
            val_loss = 6.5 - step / 10 + loss_offset
            val = {"val/loss": val_loss, "val/ppl": perplexity(val_loss)}
            row = {"step": step, "tokens": step * TOKENS_PER_STEP, "elapsed_s": step * 0.5 + 0.25, **val}
            logger.log(step, row["tokens"], row["elapsed_s"], val, "val {step}")
            rows.append(row)
    logger.close()
    return rows


def lines_by_label(ax):
    return {line.get_label(): line for line in ax.lines}


def test_rows_logged_are_read_back_and_a_resume_supersedes_later_steps(tmp_path):
    first = log_run(tmp_path, [10, 20, 30], val_steps=[20])
    assert read_metrics(tmp_path) == first
    # resumed from the step-10 checkpoint: steps 20 and 30 are trained and logged again
    second = log_run(tmp_path, [20, 30], val_steps=[20], loss_offset=0.125)
    assert read_metrics(tmp_path) == [first[0], *second]


def test_a_tasks_row_is_a_kind_of_its_own_and_leaves_the_train_row_of_its_step(tmp_path):
    rows = log_run(tmp_path, [10, 20], val_steps=[20])
    logger = MetricLogger(tmp_path, enabled=True, tensorboard=False)
    logger.log(20, 20 * TOKENS_PER_STEP, 10.5, {"tasks/piqa/acc": 0.5, "tasks/core": 0.0}, "tasks {step}")
    logger.close()
    history = read_metrics(tmp_path)
    assert history[:3] == rows and history[3]["tasks/piqa/acc"] == 0.5
    assert [r["train/loss"] for r in history if row_kind(r) == "train"] == [5.0, 4.0]


def test_two_runs_draw_train_and_val_on_every_axis(tmp_path):
    runs = {"a": log_run(tmp_path / "a", [10, 20], [20]), "b": log_run(tmp_path / "b", [10, 20], [10, 20])}
    fig = figures.curves_figure(runs)
    assert len(fig.axes) == 4
    for ax in fig.axes:
        assert sorted(lines_by_label(ax)) == ["a train", "a val", "b train", "b val"]
        assert lines_by_label(ax)["a val"].get_marker() == "o"
    assert [ax.get_yscale() for ax in fig.axes] == ["linear", "linear", "log", "log"]


def test_a_run_without_val_rows_draws_only_its_train_line(tmp_path):
    runs = {"a": log_run(tmp_path / "a", [10, 20], [20]), "b": log_run(tmp_path / "b", [10, 20])}
    for ax in figures.curves_figure(runs).axes:
        assert sorted(lines_by_label(ax)) == ["a train", "a val", "b train"]


def test_lines_hold_the_logged_values_by_step_and_by_tokens(tmp_path):
    rows = log_run(tmp_path, [10, 20, 30], val_steps=[10, 30])
    loss_step, loss_tokens, ppl_step, ppl_tokens = figures.curves_figure({"r": rows}).axes
    train, val = [r for r in rows if "train/loss" in r], [r for r in rows if "val/loss" in r]
    assert [r["step"] for r in train] == [10, 20, 30] and [r["step"] for r in val] == [10, 30]
    for ax, x_key, y_key in [(loss_step, "step", "loss"), (loss_tokens, "tokens", "loss"),
                             (ppl_step, "step", "ppl"), (ppl_tokens, "tokens", "ppl")]:
        lines = lines_by_label(ax)
        for kind, kind_rows in [("train", train), ("val", val)]:
            assert list(lines[f"r {kind}"].get_xdata()) == [r[x_key] for r in kind_rows]
            assert list(lines[f"r {kind}"].get_ydata()) == [r[f"{kind}/{y_key}"] for r in kind_rows]
    assert list(lines_by_label(loss_tokens)["r train"].get_xdata()) == [640, 1280, 1920]
    assert list(lines_by_label(ppl_step)["r val"].get_ydata()) == pytest.approx([math.exp(5.5), math.exp(3.5)])


def test_a_mixture_run_draws_each_source_val_line_beside_the_weighted_one():
    rows = [{"step": 10, "tokens": 640, "train/loss": 6.0, "train/ppl": math.exp(6.0)}]
    for step, (a, b) in ((10, (5.0, 4.0)), (20, (4.5, 3.0))):
        rows.append({"step": step, "tokens": step * 64, "val/loss": 0.75 * a + 0.25 * b, "val/ppl": 1.0,
                     "val/plays/loss": a, "val/plays/ppl": math.exp(a), "val/kjv/loss": b, "val/kjv/ppl": math.exp(b)})
    assert figures.mixture_sources(rows) == ["plays", "kjv"]
    loss_step, _, ppl_step, _ = figures.curves_figure({"r": rows}).axes
    lines = lines_by_label(loss_step)
    assert sorted(lines) == ["r train", "r val", "r val kjv", "r val plays"]
    assert list(lines["r val kjv"].get_ydata()) == [4.0, 3.0] and lines["r val kjv"].get_linestyle() == ":"
    assert list(lines_by_label(ppl_step)["r val plays"].get_ydata()) == [math.exp(5.0), math.exp(4.5)]


def test_png_has_the_signature_and_the_figure_pixel_size(tmp_path):
    fig = figures.curves_figure({"r": log_run(tmp_path / "r", [10, 20], [20])})
    width, height = fig.get_size_inches() * fig.dpi
    out = tmp_path / "sub" / "curves.png"
    figures.save_png(fig, out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert imread(out).shape[:2] == (round(height), round(width))
    assert [p.name for p in out.parent.iterdir()] == ["curves.png"]


def test_a_failed_save_leaves_the_old_png_and_no_temporary_file(tmp_path):
    out = tmp_path / "curves.png"
    out.write_bytes(PNG_SIGNATURE + b"old")
    fig = figures.val_time_figure({})

    def half_written(f, **kwargs):
        f.write(PNG_SIGNATURE)
        raise OSError("disk full")

    fig.savefig = half_written
    with pytest.raises(OSError, match="disk full"):
        figures.save_png(fig, out)
    assert out.read_bytes() == PNG_SIGNATURE + b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]


def test_val_time_figure_has_one_line_per_run_over_elapsed_seconds(tmp_path):
    a = log_run(tmp_path / "a", [10, 20], [10, 20])
    b = log_run(tmp_path / "b", [10, 20, 30], [30], loss_offset=1.0)
    (ax,) = figures.val_time_figure({"a": a, "b": b, "no val yet": log_run(tmp_path / "c", [10])}).axes
    lines = lines_by_label(ax)
    assert sorted(lines) == ["a", "b"]
    assert list(lines["a"].get_xdata()) == [5.25, 10.25] and list(lines["a"].get_ydata()) == [5.5, 4.5]
    assert list(lines["b"].get_xdata()) == [15.25] and list(lines["b"].get_ydata()) == [4.5]


def write_old_run(run_dir, config=True):
    """A run logged before rows carried tokens and elapsed_s."""
    run_dir.mkdir()
    rows = [{"step": 10, "train/loss": 5.0}, {"step": 10, "val/loss": 5.5}, {"step": 20, "train/loss": 4.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config:
        (run_dir / "config.yaml").write_text("data:\n  seq_len: 16\ntrain:\n  batch_size: 4\n")


def test_rows_without_tokens_count_them_from_the_run_config(tmp_path):
    write_old_run(tmp_path / "old")
    rows = figures.load_run(tmp_path / "old")
    assert [r["tokens"] for r in rows] == [640, 640, 1280]
    with pytest.raises(PlotError, match="run 'old': val rows without 'elapsed_s'"):
        figures.val_time_figure({"old": rows})
    write_old_run(tmp_path / "no_config", config=False)
    with pytest.raises(PlotError, match=r"no_config/config.yaml cannot supply train.batch_size \* data.seq_len"):
        figures.load_run(tmp_path / "no_config")


def test_run_labels_are_directory_names_made_unique(tmp_path):
    dirs = [tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "other", tmp_path / "z" / "run"]
    assert figures.run_labels(dirs) == ["run", "run (2)", "other", "run (3)"]


def test_perplexity_saturates_only_where_exp_overflows():
    assert perplexity(100.0) == math.exp(100.0) and perplexity(700.0) == math.inf
    assert math.isnan(perplexity(float("nan")))


def test_a_row_without_the_value_leaves_no_point(tmp_path):
    # a window whose every step was skipped logs no loss: its row draws nothing, rather than a gap or a 0
    rows = [{"step": 1, "tokens": 64, "train/loss": 5.0}, {"step": 2, "tokens": 128, "train/grad_norm": 1.0},
            {"step": 3, "tokens": 192, "train/loss": 4.0, "train/ppl": None}]
    assert figures._series(rows, "train", "step", "train/loss") == ([1, 3], [5.0, 4.0])
    assert figures._series(rows, "train", "step", "train/ppl") == ([], [])


def test_val_time_figure_refuses_a_run_where_only_some_val_rows_lack_elapsed_s():
    # a run begun by an older trainer and resumed by a newer one: one val row without elapsed_s is enough to refuse
    rows = [{"step": 10, "tokens": 640, "val/loss": 5.5},
            {"step": 20, "tokens": 1280, "elapsed_s": 10.0, "val/loss": 4.5}]
    with pytest.raises(PlotError, match="run 'mixed': val rows without 'elapsed_s'"):
        figures.val_time_figure({"mixed": rows})


def test_a_run_config_of_zero_tokens_per_step_is_refused(tmp_path):
    # rows without tokens count step * batch_size * seq_len; a batch of 0 would put every point at 0 tokens
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 10, "train/loss": 5.0}\n')
    (run_dir / "config.yaml").write_text("data:\n  seq_len: 16\ntrain:\n  batch_size: 0\n")
    with pytest.raises(PlotError, match=r"config.yaml: train.batch_size \* data.seq_len should be a positive "
                                        r"integer, got 0"):
        figures.load_run(run_dir)
