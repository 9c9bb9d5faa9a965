import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lm.data.shards import HEADER_BYTES, read_manifest
from lm.errors import DataError
from lm.inference.scoring import (
    eval_windows,
    first_tokens,
    score_stream,
    stream_windows,
    text_tokens,
    unigram_entropy,
    val_streams,
)
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
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


def test_a_text_starts_with_the_bos_or_else_an_end_of_text(tokenizer_jsons, tmp_path):
    """Every token of the file is a target: a tokenizer with a BOS puts its BOS in front (as its documents began in
    training), one without puts its end-of-text token; the byte count is the file's."""
    path = tmp_path / "t.txt"
    path.write_text("Fair is foul, and foul is fair.\n")
    bos = load_tokenizer(str(tokenizer_jsons["bos"]))
    ids, n_bytes = text_tokens(path, bos)
    assert ids.tolist() == [bos.bos_token, *bos.encode_ordinary(path.read_text())] and bos.bos_token == 0
    assert n_bytes == len(path.read_bytes())
    gpt2 = load_tokenizer("gpt2")
    assert text_tokens(path, gpt2)[0].tolist() == [50256, *gpt2.encode_ordinary(path.read_text())]


@pytest.mark.parametrize("bad", [0, 1])
def test_a_val_shard_holding_an_id_of_vocab_size_or_more_is_refused_by_name(tiny_data_dir, tmp_path, bad):
    """The first id past the vocabulary (== vocab_size) is refused as such, not left to an index error inside the
    model."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    manifest = read_manifest(data)
    vocab_size = manifest["vocab_size"]
    shard = data / manifest["splits"]["val"]["shards"][0]["file"]
    tokens = np.memmap(shard, dtype=np.dtype("<u2"), mode="r+", offset=HEADER_BYTES)
    assert tokens.max() < vocab_size
    tokens[5] = vocab_size + bad
    tokens.flush()
    del tokens
    with pytest.raises(DataError, match=f"token {vocab_size + bad} at position 5 is not below the vocabulary size"):
        val_streams(data, "gpt2", vocab_size)


def test_window_k_gets_the_noise_of_key_k_whatever_the_batch_size():
    """score_windows numbers the windows across batches and streams (window k put through the objective with key
    k, as validation does): the sums are the same in batches of 2 as in one batch, and equal those of the
    objective applied to all windows at once with keys 0..n-1."""
    from lm.config import load_config
    from lm.inference.scoring import score_windows
    from lm.models.registry import family_of

    cfg = load_config(None, ["--model.arch=encdec", "--model.pos=sinusoidal", "--model.n_sentinels=8",
                             "--model.n_layer=1", "--model.n_head=2", "--model.d_model=32", "--model.block_size=64",
                             "--data.seq_len=48"])
    family = family_of(cfg.model)
    torch.manual_seed(0)
    model = family.build(cfg.model)
    model.init_weights()
    model.eval()
    objective = family.training.objective(cfg.model, cfg.data, 48, cfg.train.seed)
    rng = np.random.default_rng(0)
    streams = [rng.integers(0, 1000, 48 * 2 + 1), rng.integers(0, 1000, 48 * 2 + 5)]  # 2 windows each
    rows = [s[j * 48:(j + 1) * 48 + 1] for s in streams for j in range(2)]
    a, b = objective(np.stack(rows[:2]), np.array([0, 1])), objective(np.stack(rows[:2]), np.array([2, 3]))
    assert not np.array_equal(a[0], b[0])  # the noise depends on the key
    cpu = torch.device("cpu")
    whole = score_windows(family, model, streams, objective, 48, 4, cpu)
    pairs = score_windows(family, model, streams, objective, 48, 2, cpu)
    scored = family.training.score(model, model, [torch.from_numpy(t) for t in objective(np.stack(rows),
                                                                                        np.arange(4))])
    assert whole[1] == pairs[1] == scored.count
    assert pairs[0] == pytest.approx(whole[0], rel=1e-6)
    assert whole[0] == pytest.approx(scored.loss.item() * scored.count, rel=1e-6)


def test_the_first_window_is_a_whole_seq_len_and_the_next_ones_step_by_stride():
    # 10 tokens (targets 1..9), seq_len 8, stride 4: one window of 8 inputs scores targets 1-8, then one more
    # window of 8 inputs ending at the last input scores target 9 alone
    assert eval_windows(10, 8, 4) == [(0, 8, 1), (1, 9, 9)]
    assert eval_windows(20, 8, 4) == [(0, 8, 1), (4, 12, 9), (8, 16, 13), (11, 19, 17)]


def test_stream_windows_are_only_whole_windows_of_seq_len_plus_one_tokens():
    # a window needs seq_len + 1 tokens (inputs and the shifted targets): 8 tokens with seq_len 4 hold one window
    # (tokens 0-4), not a second one of tokens 4-7 that lacks its last target
    stream = np.arange(8)
    assert [w.tolist() for w in stream_windows([stream], 4)] == [[0, 1, 2, 3, 4]]
    assert [w.tolist() for w in stream_windows([np.arange(9)], 4)] == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]]
