"""The mixture report's judge on the tiny trained run: every sample is put to the two single-source models."""

import pytest

from experiments import mixture_samples
from lm.cli import run


def test_each_run_prints_how_its_samples_read(trained_run, capsys):
    assert run(mixture_samples.main, [str(trained_run), str(trained_run), "--samples=3", "--tokens=4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].startswith(f"{trained_run}: ")
    # one model judging against itself: every sample's two losses are equal, so none reads as the Bible
    assert "3 of 3 samples read as Shakespeare, 0 as the Bible" in lines[0]
    assert lines[1].startswith("  first sample: ")


def test_help_and_bad_arguments_are_usage_not_tracebacks(capsys):
    with pytest.raises(SystemExit) as done:
        mixture_samples.main(["--help"])
    assert done.value.code == 0 and "--samples" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        mixture_samples.main(["runs/only-one"])
    assert done.value.code == 2 and "at least the two single-source runs" in capsys.readouterr().err
