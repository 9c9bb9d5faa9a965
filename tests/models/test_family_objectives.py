"""Which objective each family trains on (`Training.objective`), with its vocabulary's ids."""

import numpy as np
import pytest

from lm.data.config import DataConfig
from lm.data.objectives import MaskedLM, NextToken, SpanCorruption
from lm.data.span_corruption import corrupted_lengths
from lm.errors import ConfigError
from lm.models.config import ModelConfig
from lm.models.encdec.config import EncDecConfig
from lm.models.encoder.config import EncoderConfig
from lm.models.gpt.config import GPTConfig
from lm.models.lstm.config import LSTMConfig
from lm.models.registry import family_of

VOCAB = 50257


def encdec(**overrides) -> EncDecConfig:
    return EncDecConfig(**{"vocab_size": VOCAB, "pos": "sinusoidal", **overrides})


def build_objective(cfg: ModelConfig, seq_len: int, seed: int, document_eot: int | None = None):
    return family_of(cfg).training.objective(cfg, DataConfig(), seq_len, seed, document_eot)


def test_each_architecture_gets_its_objective():
    objective = build_objective(encdec(n_sentinels=20), 128, seed=3)
    assert isinstance(objective, SpanCorruption)
    # the sentinels follow the tokenizer's ids, then the padding id: the model's vocabulary layout
    assert (objective.seed, objective.sentinel_start, objective.n_sentinels, objective.pad_id) == (
        3, VOCAB, 20, VOCAB + 20)
    assert objective.window_len == 129 and objective.lengths == corrupted_lengths(129)
    assert isinstance(build_objective(GPTConfig(), 128, 3), NextToken)
    assert isinstance(build_objective(LSTMConfig(), 128, 3), NextToken)
    masked = build_objective(EncoderConfig(), 128, 3)
    assert isinstance(masked, MaskedLM) and (masked.mask_id, masked.cls_id) == (VOCAB, VOCAB + 1)
    assert masked.rate == DataConfig().mlm_rate  # the run's data section sets the masking


def test_too_few_sentinels_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.n_sentinels: 5 sentinels do not fit data.seq_len=128"):
        build_objective(encdec(n_sentinels=5), 128, 0)


def test_block_size_shorter_than_the_source_is_a_config_error():
    # windows of 5 tokens: 1 noise token in 1 span, so the source is as long as the window
    with pytest.raises(ConfigError, match=r"model.block_size: 4 is shorter .* data.seq_len=4 \(source, target "
                                          r"lengths \(5, 3\)\)"):
        build_objective(encdec(block_size=4), 4, 0)


def test_a_document_mask_adds_each_tokens_position_in_its_document():
    rows = np.array([[5, 50256, 7, 8, 50256, 9]])  # (1, T + 1)
    x, y, positions = build_objective(GPTConfig(), 5, 3, document_eot=50256)(rows, np.zeros(1, dtype=np.int64))
    assert x.tolist() == [[5, 50256, 7, 8, 50256]] and y.tolist() == [[50256, 7, 8, 50256, 9]]
    assert positions.tolist() == [[0, 0, 1, 2, 0]]  # the end-of-text token opens the next document
    assert len(build_objective(GPTConfig(), 5, 3)(rows, np.zeros(1, dtype=np.int64))) == 2


def test_a_document_mask_gives_the_encoder_each_tokens_position_and_no_padding():
    # masked LM with data.document_mask: the batch adds keep (no padding) and the positions of the window's own
    # tokens, so the encoder attends within each document
    rows = np.array([[5, 50256, 7, 8, 50256, 9]])  # (1, T + 1)
    ids, labels, keep, positions = build_objective(EncoderConfig(), 5, 3, document_eot=50256)(
        rows, np.zeros(1, dtype=np.int64))
    assert ids.shape == labels.shape == keep.shape == positions.shape == (1, 5)
    assert keep.all() and positions.tolist() == [[0, 0, 1, 2, 0]]
    assert len(build_objective(EncoderConfig(), 5, 3)(rows, np.zeros(1, dtype=np.int64))) == 2
