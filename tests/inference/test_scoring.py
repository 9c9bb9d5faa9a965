import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lm.inference.scoring import eval_windows, first_tokens, score_stream, unigram_entropy
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT


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

    def forward(self, idx, positions=None):
        return torch.zeros(*idx.shape, 1)  # (B, T, C): the hidden states say nothing

    def logits(self, h):
        return h.new_zeros(*h.shape[:-1], self.vocab)


def test_uniform_model_perplexity_is_vocab_size():
    tokens = np.arange(37) % 10
    nll, count = score_stream(Uniform(10), tokens, seq_len=8, stride=3, batch_size=4, device=torch.device("cpu"))
    assert count == 36
    assert math.exp(nll / count) == pytest.approx(10.0, rel=1e-6)  # float32 log-softmax


def test_perplexity_equals_exp_mean_nll_by_hand():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=2, d_model=16)).eval()
    tokens = np.random.default_rng(0).integers(0, 100, 12)
    nll, count = score_stream(model, tokens, seq_len=16, stride=8, batch_size=2, device=torch.device("cpu"))
    x = torch.as_tensor(tokens[:-1])[None]
    y = torch.as_tensor(tokens[1:])
    logits = model.logits(model(x))[0]  # (T, V)
    logp = torch.log_softmax(logits.double(), dim=-1)
    by_hand = -logp[torch.arange(11), y].mean().item()
    assert count == 11
    assert nll / count == pytest.approx(by_hand, abs=1e-6)
    assert math.exp(nll / count) == pytest.approx(math.exp(F.cross_entropy(logits, y).item()), rel=1e-5)


def test_unigram_entropy_by_hand():
    # the first token of each stream is context only, as in scoring
    assert unigram_entropy([np.array([5, 0, 0]), np.array([9, 1, 1])]) == pytest.approx(math.log(2))
    assert unigram_entropy([np.array([3, 7, 7, 7])]) == 0.0


def test_a_document_masked_stream_scores_as_its_documents_one_by_one():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=32, dropout=0.0)).eval()
    eot, rng = 99, np.random.default_rng(0)
    docs = [rng.integers(0, 99, n) for n in (5, 9, 3)]
    # each document opens with the end-of-text token that closed the one before, and is closed by one
    stream = np.concatenate([[eot], *[np.append(d, eot) for d in docs]])  # (21,)
    cpu = torch.device("cpu")
    packed, count = score_stream(model, stream, seq_len=20, stride=20, batch_size=1, device=cpu, document_eot=eot)
    alone = [score_stream(model, np.concatenate([[eot], d, [eot]]), 20, 20, 1, cpu) for d in docs]
    assert count == sum(n for _, n in alone) == 20
    assert packed == pytest.approx(sum(nll for nll, _ in alone), rel=1e-5)
    unmasked, _ = score_stream(model, stream, seq_len=20, stride=20, batch_size=1, device=cpu)
    assert abs(unmasked - packed) > 1e-3  # without the mask, later documents see earlier ones


def test_first_tokens_cuts_the_streams_and_drops_a_stream_left_with_one_token():
    a, b, c = np.arange(5), np.arange(5, 10), np.arange(10, 15)
    assert [s.tolist() for s in first_tokens([a, b, c], 7)] == [a.tolist(), [5, 6]]
    assert [s.tolist() for s in first_tokens([a, b, c], 6)] == [a.tolist()]  # b's 1 token has nothing to score
