import json

import pytest
from matplotlib.image import imread

from lm import plot
from lm.cli import run
from tests.report.test_figures import PNG_SIGNATURE, log_run


def test_cli_writes_curves_png_into_the_run_dir_by_default(tmp_path, capsys):
    log_run(tmp_path / "r", [10, 20], [20])
    assert run(plot.main, [str(tmp_path / "r")]) == 0
    out = tmp_path / "r" / "curves.png"
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_cli_plots_several_runs_into_out(tmp_path, capsys):
    log_run(tmp_path / "a", [10, 20], [20])
    log_run(tmp_path / "b", [10, 20])
    out = tmp_path / "both.png"
    assert run(plot.main, [str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert imread(out).shape[:2] == (800, 1200)


@pytest.mark.parametrize("case, expected", [
    ("no_metrics", "bad/metrics.jsonl: no metrics log"),
    ("empty", "bad/metrics.jsonl: the metrics log is empty"),
    ("malformed", "bad/metrics.jsonl:2: not a JSON object"),
    ("not_utf8", "bad/metrics.jsonl: "),  # was a UnicodeDecodeError traceback
    ("a_text_loss", "bad/metrics.jsonl:1: 'train/loss' is 'abc'; expected a number (or null)"),  # drawn as an axis
    ("a_bool_step", "bad/metrics.jsonl:1: expected a JSON object with an integer 'step'"),
    ("several_without_out", "--out is required with several run directories (2 given)"),
    ("not_png", "the figure is written as PNG; name the file *.png"),
    ("below_a_file", "curves.png/x.png: {tmp}/curves.png is a file, not a directory"),
    ("a_directory", "good.png: is a directory; name the file to write"),
])
def test_cli_bad_input_is_one_error_line_and_writes_nothing(tmp_path, capsys, case, expected):
    good, bad = tmp_path / "good", tmp_path / "bad"
    log_run(good, [10, 20], [20])
    bad.mkdir()
    if case == "empty":
        (bad / "metrics.jsonl").write_text("\n")
    if case == "malformed":
        (bad / "metrics.jsonl").write_text('{"step": 1, "train/loss": 5.0}\n{"step": 2, "train/lo\n')
    if case == "not_utf8":
        (bad / "metrics.jsonl").write_bytes(b'{"step": 1, "train/loss": 5.0}\n\xff\xfe\n')
    if case == "a_text_loss":
        (bad / "metrics.jsonl").write_text('{"step": 1, "tokens": 8, "train/loss": "abc"}\n')
    if case == "a_bool_step":
        (bad / "metrics.jsonl").write_text('{"step": true, "tokens": 8, "train/loss": 1.0}\n')
    out = tmp_path / "curves.png"
    out.write_bytes(PNG_SIGNATURE + b"a good old figure")
    argv = {
        "several_without_out": [str(good), str(good)],
        "not_png": [str(good), "--out", str(tmp_path / "curves.jpg")],
        "below_a_file": [str(good), "--out", str(out / "x.png")],  # was a traceback after drawing
        "a_directory": [str(good), "--out", str(good.with_suffix(".png"))],
    }.get(case, [str(good), str(bad), "--out", str(out)])
    if case == "a_directory":
        good.with_suffix(".png").mkdir()
    assert run(plot.main, argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    expected = expected.replace("{tmp}", str(tmp_path))
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and expected in captured.err
    assert out.read_bytes() == PNG_SIGNATURE + b"a good old figure"
    made = ["good.png"] if case == "a_directory" else []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["bad", "curves.png", "good", *made])
    assert sorted(p.name for p in good.iterdir()) == ["metrics.jsonl"]


def test_a_log_without_any_loss_draws_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "tokens": 8}\n{"step": 2, "tokens": 16}\n')
    assert run(plot.main, [str(run_dir)]) == 2  # it wrote four empty axes as the curves
    assert capsys.readouterr().err == f"error: {run_dir}: no loss or perplexity logged yet; nothing to draw\n"
    assert not (run_dir / "curves.png").exists()


def test_an_upper_case_png_suffix_is_a_png(tmp_path, capsys):
    # the suffix is compared without case: CURVES.PNG names a PNG as curves.png does
    log_run(tmp_path / "r", [10, 20], [20])
    out = tmp_path / "CURVES.PNG"
    assert run(plot.main, [str(tmp_path / "r"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_a_log_of_perplexity_alone_is_drawn(tmp_path):
    # "nothing to draw" is for a log with neither loss nor perplexity; a perplexity alone draws
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": 1, "tokens": 8, "train/ppl": 100.0}, {"step": 2, "tokens": 16, "train/ppl": 50.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run(plot.main, [str(run_dir)]) == 0
    assert (run_dir / "curves.png").read_bytes().startswith(PNG_SIGNATURE)


def test_a_log_whose_losses_are_all_null_draws_nothing(tmp_path, capsys):
    # a null loss (a window of skipped steps) is no point: a log of only those has nothing to draw
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "tokens": 8, "train/loss": null, "train/ppl": null}\n')
    assert run(plot.main, [str(run_dir)]) == 2
    assert capsys.readouterr().err == f"error: {run_dir}: no loss or perplexity logged yet; nothing to draw\n"
    assert not (run_dir / "curves.png").exists()
