import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lm.cli import run
from lm.eval import eval_windows, main, score_stream
from lm.models.config import ModelConfig
from lm.models.gpt import GPT
from lm.tokenizer import load_tokenizer


@pytest.mark.parametrize("n, seq_len, stride", [(2, 4, 2), (10, 4, 4), (11, 4, 1), (50, 8, 3), (7, 16, 8)])
def test_every_target_scored_exactly_once(n, seq_len, stride):
    scored = []
    for start, end, first in eval_windows(n, seq_len, stride):
        assert 0 <= start < first <= end < n and end - start <= seq_len
        targets = range(start + 1, end + 1)
        scored += [j for j in targets if j >= first]
        if start > 0:  # later windows keep at least seq_len - stride tokens of context
            assert first - 1 - start >= seq_len - stride
    assert scored == list(range(1, n))


class Uniform(torch.nn.Module):
    """Equal logits over `vocab` ids: every token costs ln(vocab) nats, so perplexity is vocab."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx):
        return torch.zeros(*idx.shape, self.vocab), None


def test_uniform_model_perplexity_is_vocab_size():
    tokens = np.arange(37) % 10
    nll, count = score_stream(Uniform(10), tokens, seq_len=8, stride=3, batch_size=4, device=torch.device("cpu"))
    assert count == 36
    assert math.exp(nll / count) == pytest.approx(10.0, rel=1e-6)  # float32 log-softmax


def test_perplexity_equals_exp_mean_nll_by_hand():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=100, block_size=16, n_layer=2, n_head=2, d_model=16)).eval()
    tokens = np.random.default_rng(0).integers(0, 100, 12)
    nll, count = score_stream(model, tokens, seq_len=16, stride=8, batch_size=2, device=torch.device("cpu"))
    x = torch.as_tensor(tokens[:-1])[None]
    y = torch.as_tensor(tokens[1:])
    logp = torch.log_softmax(model(x)[0][0].double(), dim=-1)
    by_hand = -logp[torch.arange(11), y].mean().item()
    assert count == 11
    assert nll / count == pytest.approx(by_hand, abs=1e-6)
    assert math.exp(nll / count) == pytest.approx(math.exp(F.cross_entropy(model(x)[0][0], y).item()), rel=1e-5)


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


@pytest.mark.parametrize("content, message", [(b"", "the file is empty"), (b"ok \xff\xfe", "not UTF-8 (invalid byte at offset 3)")])
def test_cli_bad_text(trained_run, tmp_path, capsys, content, message):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and message in err


def test_cli_no_checkpoint(tmp_path, capsys):
    assert run(main, ["--checkpoint", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_unigram_entropy_by_hand():
    from lm.eval import unigram_entropy

    # the first token of each stream is context only, as in scoring
    assert unigram_entropy([np.array([5, 0, 0]), np.array([9, 1, 1])]) == pytest.approx(math.log(2))
    assert unigram_entropy([np.array([3, 7, 7, 7])]) == 0.0


@pytest.mark.parametrize("flags, message", [(["--stride", "17"], "--stride: must be in [1, 16]"),
                                            (["--seq-len", "64"], "--seq-len: must be in [1, 32]")])
def test_cli_bad_window_flags(trained_run, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
