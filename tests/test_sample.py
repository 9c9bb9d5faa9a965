import subprocess
import sys

import pytest

from lm import sample as sample_tool
from lm.checkpoint.store import resolve_checkpoint
from lm.cli import run
from lm.models.family import SampleOptions
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
    greedy = sample(trained_run, capsys, "--prompt-file", str(prompt), "--temperature", "0")
    assert greedy == sample(trained_run, capsys, "--prompt", "KING:", "--temperature", "0")
    for ignored in (["--seed", "2"], ["--top-k", "5"], ["--top-p", "0.5"], ["--num-samples", "2"]):
        with pytest.raises(SystemExit):  # each would change nothing of greedy text: refused, not ignored
            run(main, ["--checkpoint", str(trained_run), "--temperature", "0", *ignored])
        assert f"error: {ignored[0]}: greedy decoding (--temperature 0)" in capsys.readouterr().err


def test_the_extreme_seeds_and_temperatures_sample(trained_run, capsys):
    """The ends of each range run: the largest seed (plus a second sample's index) and the temperatures 1e-4, which
    is nearly greedy, and 1e4."""
    two = sample(trained_run, capsys, "--prompt", "KING:", "--seed", str(2**63 - 1), "--num-samples", "2")
    assert two.count("--- sample") == 2
    near_greedy = sample(trained_run, capsys, "--prompt", "KING:", "--temperature", "1e-4", "--seed", "5")
    assert near_greedy == sample(trained_run, capsys, "--prompt", "KING:", "--temperature", "0")
    assert sample(trained_run, capsys, "--prompt", "KING:", "--temperature", "1e4").startswith("KING:")


def test_compile_gives_the_same_text_or_one_error_line(trained_run, capsys, monkeypatch):
    """--compile reaches the static cache (its step left eager here: test_generate compiles it for real), and a
    model without a static cache is one error line."""
    from lm.models import generate
    from lm.models.gpt.model import GPT

    monkeypatch.setattr(generate, "compiled_step", lambda device_type: generate.next_logits)
    for flags in (["--temperature", "0"], ["--seed", "2", "--num-samples", "2"]):
        eager = sample(trained_run, capsys, "--prompt", "KING:", *flags)
        assert sample(trained_run, capsys, "--prompt", "KING:", *flags, "--compile") == eager
    monkeypatch.delattr(GPT, "new_static_cache")
    assert run(main, ["--checkpoint", str(trained_run), "--max-new-tokens", "4", "--compile"]) == 2
    assert capsys.readouterr().err == ("error: --compile: a decoder-only GPT (model.arch=gpt) has no static KV cache, "
                                       "which compiled decoding needs; sample without --compile\n")


def test_long_prompt_cli(trained_run):
    # as a command: stdout holds the sample alone, the log's warning goes to stderr (`lm.sample > out.txt`)
    result = subprocess.run([sys.executable, "-m", "lm.sample", "--checkpoint", str(trained_run), "--max-new-tokens",
                             "4", "--prompt", "word " * 100], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("word word") and "keeping its last" not in result.stdout
    assert "keeping its last" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--top-k", "0"], "argument --top-k: expected a positive integer, got 0"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: expected a positive integer, got -1"),
    (["--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    (["--temperature", "-1"], "argument --temperature: expected a number in [0, 10000], got '-1'"),
    (["--temperature", "nan"], "argument --temperature: expected a number in [0, 10000], got 'nan'"),
    (["--temperature", "1e-39"], "--temperature: 1e-39 is too close to 0: the logits divided by it overflow; 0 for "
                                 "greedy, or at least 0.0001"),
    (["--seed", "-1"], "argument --seed: expected an integer in [0, 9223372036854775807], got '-1'"),
    (["--seed", str(2**64)], "argument --seed: expected an integer in [0, 9223372036854775807], got "
                             "'18446744073709551616'"),
])
def test_bad_flags_are_usage_errors(trained_run, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_each_of_num_samples_takes_the_next_seed(trained_run, capsys):
    """Sample i of --num-samples is the one --seed seed + i gives alone (not the same text repeated)."""
    two = sample(trained_run, capsys, "--prompt", "KING:", "--seed", "3", "--num-samples", "2")
    first, second = (sample(trained_run, capsys, "--prompt", "KING:", "--seed", seed) for seed in ("3", "4"))
    assert first != second
    assert two == f"--- sample 1 ---\n{first}--- sample 2 ---\n{second}"


def test_top_k_1_and_a_tiny_top_p_are_greedy(trained_run, capsys):
    """Keeping one token leaves the sampler no choice at any temperature: --top-k 1, or a --top-p below the top
    token's probability, writes the greedy text; at the same seed without them the text differs."""
    greedy = sample(trained_run, capsys, "--prompt", "KING:", "--temperature", "0")
    free = sample(trained_run, capsys, "--prompt", "KING:", "--temperature", "2", "--seed", "1")  # differs
    assert free != greedy
    hot = ["--prompt", "KING:", "--temperature", "2", "--seed", "1"]
    assert sample(trained_run, capsys, *hot, "--top-k", "1") == greedy
    assert sample(trained_run, capsys, *hot, "--top-p", "1e-6") == greedy


def sampled_text(trained_run, capsys, *args):
    assert run(main, ["--checkpoint", str(trained_run), "--max-new-tokens", "12", "--prompt", "KING:", *args]) == 0
    return capsys.readouterr().out


def test_the_default_seed_is_1337_and_the_default_top_k_is_200(trained_run, capsys):
    hot = ["--temperature", "3"]
    default = sampled_text(trained_run, capsys, *hot)
    assert default == sampled_text(trained_run, capsys, *hot, "--seed", "1337", "--top-k", "200")
    assert default != sampled_text(trained_run, capsys, *hot, "--seed", "1338")
    assert default != sampled_text(trained_run, capsys, *hot, "--top-k", "50")


def test_a_top_p_of_1_keeps_every_token(trained_run, capsys):
    hot = ["--temperature", "3", "--seed", "7"]
    assert sampled_text(trained_run, capsys, *hot, "--top-p", "1") == sampled_text(trained_run, capsys, *hot)


def test_a_top_p_of_0_is_a_usage_error(trained_run, capsys):
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), "--top-p", "0"])
    assert exit_.value.code == 2
    assert "error: --top-p: must be in (0, 1], got 0.0" in capsys.readouterr().err


def test_an_encoder_checkpoint_writes_no_text_and_says_so_in_one_line(encoder_run, capsys):
    assert run(main, ["--checkpoint", str(encoder_run), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --checkpoint: {resolve_checkpoint(encoder_run)} is ") and err.count("\n") == 1
    assert ("(model.arch=encoder), which generates no text; score it with python -m lm.eval, or a fine-tuned head "
            "with python -m lm.predict\n") in err


def test_the_defaults_reach_the_sampler(trained_run, capsys, monkeypatch):
    """200 new tokens at temperature 0.8, top-k 200, no top-p, seed 1337, not compiled: more new tokens than the
    32 positions of this model hold, which is one usage error naming the default."""
    seen = []
    monkeypatch.setattr(sample_tool, "SampleOptions", lambda *a, **k: seen.append(SampleOptions(*a, **k)) or seen[-1])
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run)])
    assert exit_.value.code == 2
    assert seen == [SampleOptions(200, 0.8, 200, None, 1337, compiled=False)]
    assert capsys.readouterr().err.endswith(
        "error: --max-new-tokens: 200 leaves no room for a prompt in the model's context of 32 tokens\n")
