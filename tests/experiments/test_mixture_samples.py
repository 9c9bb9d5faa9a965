"""The mixture report's judge on the tiny trained run: every sample is put to the two single-source models."""

from experiments import mixture_samples


def test_each_run_prints_how_its_samples_read(trained_run, capsys):
    mixture_samples.main([str(trained_run), str(trained_run)], samples=3, tokens=4)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].startswith(f"{trained_run}: ")
    # one model judging against itself: every sample's two losses are equal, so none reads as the Bible
    assert "3 of 3 samples read as Shakespeare, 0 as the Bible" in lines[0]
    assert lines[1].startswith("  first sample: ")
