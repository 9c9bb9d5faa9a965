"""Which objective trains which model: the one place that joins a model config to a data objective."""

from lm.data.config import DataConfig
from lm.data.objectives import MaskedLM, NextToken, Objective, SpanCorruption
from lm.errors import ConfigError
from lm.models.config import ModelConfig


def build_objective(model: ModelConfig, seq_len: int, seed: int, document_eot: int | None = None,
                    data: DataConfig | None = None) -> Objective:
    """Next-token prediction for a GPT or LSTM (with `document_eot`, data.document_mask, each token's
    position inside its document too; the config refuses the key for the LSTM and the encoder-decoder); span
    corruption of
    windows of seq_len + 1 tokens for an encoder-decoder, with the sentinel and padding ids of its
    vocabulary; masked-LM for an encoder, with `data`'s mlm_* keys (required: they are the run's, so
    evaluation masks as training did). Refuses, before any weights exist, windows whose corrupted source or
    target is longer than the model's positions."""
    if model.arch == "encoder":
        if data is None:
            raise ValueError("build_objective: an encoder's masking comes from the run's data section; pass data=")
        return MaskedLM(seed, model.vocab_size, model.mask_id, model.cls_id, data.mlm_rate, data.mlm_mask_fraction,
                        data.mlm_random_fraction, document_eot)
    if model.arch != "encdec":
        return NextToken(document_eot)
    objective = SpanCorruption(seed, model.sentinel_start, model.n_sentinels, model.pad_id, seq_len + 1)
    if max(objective.lengths) > model.block_size:
        raise ConfigError(
            f"model.block_size: {model.block_size} is shorter than the corrupted windows of "
            f"data.seq_len={seq_len} (source, target lengths {objective.lengths})"
        )
    return objective
