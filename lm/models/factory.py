"""Build the model a config describes."""

import torch.nn as nn

from lm.models.config import ModelConfig
from lm.models.encdec import EncoderDecoder
from lm.models.gpt import GPT


def build_model(cfg: ModelConfig) -> nn.Module:
    """GPT for arch gpt, EncoderDecoder for arch encdec, initialised from the global torch RNG."""
    return EncoderDecoder(cfg) if cfg.arch == "encdec" else GPT(cfg)
