"""lm.eval through its command line on the session's trained run: val shards, text files, and what it refuses."""

import dataclasses

import pytest

from lm.cli import run
from lm.data.prepare import prepare
from lm.eval import main
from lm.tokenizer import load_tokenizer


def test_cli_on_val_shards_and_text(trained_run, tmp_path, capsys):
    assert run(main, ["--checkpoint", str(trained_run), "--max-tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert "tokens scored: 199" in out and "perplexity:" in out and "unigram" in out
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n")
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(text)]) == 0
    out = capsys.readouterr().out
    # an end-of-text token goes in front, so every token of the file is scored
    n_tokens = len(load_tokenizer("gpt2").encode_ordinary(text.read_text()))
    assert "bits per byte:" in out and f"tokens scored: {n_tokens}\n" in out


def test_bits_per_byte_only_for_a_whole_text(trained_run, tmp_path, capsys):
    """--max-tokens cutting a text would charge the whole file's bytes to the tokens of its start."""
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n")
    n_tokens = len(load_tokenizer("gpt2").encode_ordinary(text.read_text()))
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(text)]) == 0
    whole = capsys.readouterr().out
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(text), "--max-tokens", str(n_tokens + 1)]) == 0
    assert capsys.readouterr().out == whole  # the prefix token and every token of the text: nothing cut
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(text), "--max-tokens", "5"]) == 0
    cut = capsys.readouterr().out
    assert f"data: {text} (its first 5 tokens: no bits per byte)" in cut and "tokens scored: 4\n" in cut
    assert "bits per byte:" not in cut and "unigram baseline:" in cut


@pytest.mark.parametrize("content, message", [
    (b"", "the file is empty"), (b"ok \xff\xfe", "not UTF-8: byte 0xff at offset 3"),
])
def test_cli_bad_text(trained_run, tmp_path, capsys, content, message):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and message in err


def test_cli_no_checkpoint(tmp_path, capsys):
    assert run(main, ["--checkpoint", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["--stride", "17"], "--stride: must be in [1, 16]"),
                                            (["--seq-len", "64"], "--seq-len: must be in [1, 32]")])
def test_cli_bad_window_flags(trained_run, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_shards_of_another_tokenizer_are_named_as_such_not_as_damaged(trained_run, tiny_data_config, tmp_path,
                                                                      capsys):
    other = tmp_path / "cl100k"
    prepare(dataclasses.replace(tiny_data_config, tokenizer="cl100k_base", dir=str(other)))
    capsys.readouterr()
    assert run(main, ["--checkpoint", str(trained_run), "--data-dir", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {other}: prepared with tokenizer 'cl100k_base', but "
                                               "data.tokenizer='gpt2'"), err
