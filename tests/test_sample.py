
import pytest

from lm.cli import run
from lm.sample import main


def sample(trained_run, capsys, *args):
    assert run(main, ["--checkpoint", str(trained_run), "--max-new-tokens", "12", *args]) == 0
    return capsys.readouterr().out


def test_same_seed_same_text(trained_run, capsys):
    a = sample(trained_run, capsys, "--prompt", "ROMEO:", "--seed", "3")
    b = sample(trained_run, capsys, "--prompt", "ROMEO:", "--seed", "3")
    c = sample(trained_run, capsys, "--prompt", "ROMEO:", "--seed", "4", "--temperature", "1.5")
    assert a == b and a.startswith("ROMEO:") and len(a) > len("ROMEO:\n")
    assert a != c


def test_prompt_file_and_greedy(trained_run, capsys, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("KING:")
    greedy = sample(trained_run, capsys, "--prompt-file", str(prompt), "--temperature", "0", "--seed", "1")
    assert greedy == sample(trained_run, capsys, "--prompt", "KING:", "--temperature", "0", "--seed", "2")


def test_long_prompt_cli(trained_run, capsys):
    out = sample(trained_run, capsys, "--prompt", "word " * 100)
    assert out.startswith("word word")


@pytest.mark.parametrize("flags, message", [
    (["--top-k", "0"], "argument --top-k: expected a positive integer, got 0"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: expected a positive integer, got -1"),
    (["--top-p", "1.5"], "--top-p: must be in (0, 1]"), (["--temperature", "-1"], "--temperature: must be >= 0"),
])
def test_bad_flags_are_usage_errors(trained_run, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
