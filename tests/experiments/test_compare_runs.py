import json

import pytest

from experiments.compare_runs import compare, main, read_metrics


def write_run(path, losses, speeds):
    path.mkdir()
    rows = [{"step": 0, "val/loss": 9.0}]  # a validation row: no training loss, left out
    rows += [{"step": s, "train/loss": loss, "perf/tokens_per_s": tok} for s, loss, tok in zip([1, 2, 3, 4], losses,
                                                                                                speeds)]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_the_largest_loss_difference_and_the_speedup_after_the_warmup_steps(tmp_path):
    base = write_run(tmp_path / "bf16", [4.0, 3.0, 2.0, 1.0], [10.0, 100.0, 100.0, 100.0])
    other = write_run(tmp_path / "f8", [4.0, 3.03, 2.01, 1.0], [5.0, 100.0, 130.0, 120.0])
    result = compare(read_metrics(base), read_metrics(other), skip=1)
    assert result["steps"] == 4 and result["at_step"] == 2
    assert result["max_rel_loss_diff"] == pytest.approx(0.01)
    assert result["baseline_tokens_per_s"] == 100.0 and result["other_tokens_per_s"] == 120.0
    assert result["speedup"] == pytest.approx(1.2)


def test_the_command_prints_one_line_and_a_missing_run_is_one_error(tmp_path, capsys):
    base = write_run(tmp_path / "bf16", [4.0, 3.0, 2.0, 1.0], [1.0] * 4)
    assert main([str(base), str(base)]) == 0
    assert "largest relative difference 0.00% (step 1)" in capsys.readouterr().out
    from lm.cli import run

    assert run(main, [str(base), str(tmp_path / "nosuch")]) == 2
    assert f"{tmp_path / 'nosuch' / 'metrics.jsonl'}: unreadable" in capsys.readouterr().err
