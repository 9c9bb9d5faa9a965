import numpy as np
import pytest

from lm.data.objectives import NextToken, SpanCorruption
from lm.data.span_corruption import corrupted_lengths
from lm.errors import ConfigError
from lm.models.config import ModelConfig
from lm.training.objective import build_objective

VOCAB = 50257


def encdec(**overrides) -> ModelConfig:
    return ModelConfig(**{"arch": "encdec", "vocab_size": VOCAB, "pos": "sinusoidal", **overrides})


def test_each_architecture_gets_its_objective():
    objective = build_objective(encdec(n_sentinels=20), 128, seed=3)
    assert isinstance(objective, SpanCorruption)
    # the sentinels follow the tokenizer's ids, then the padding id: the model's vocabulary layout
    assert (objective.seed, objective.sentinel_start, objective.n_sentinels, objective.pad_id) == (
        3, VOCAB, 20, VOCAB + 20)
    assert objective.window_len == 129 and objective.lengths == corrupted_lengths(129)
    assert isinstance(build_objective(ModelConfig(), 128, 3), NextToken)
    assert isinstance(build_objective(ModelConfig(arch="lstm"), 128, 3), NextToken)


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
    x, y, positions = build_objective(ModelConfig(), 5, 3, document_eot=50256)(rows, np.zeros(1, dtype=np.int64))
    assert x.tolist() == [[5, 50256, 7, 8, 50256]] and y.tolist() == [[50256, 7, 8, 50256, 9]]
    assert positions.tolist() == [[0, 0, 1, 2, 0]]  # the end-of-text token opens the next document
    assert len(build_objective(ModelConfig(), 5, 3)(rows, np.zeros(1, dtype=np.int64))) == 2
