"""Build the model a config describes."""

import torch.nn as nn

from lm.models.config import ModelConfig
from lm.models.encdec import EncoderDecoder
from lm.models.encoder import Encoder
from lm.models.gpt import GPT
from lm.models.lstm import LSTMLM

_MODELS = {"gpt": GPT, "encdec": EncoderDecoder, "lstm": LSTMLM, "encoder": Encoder}


def build_model(cfg: ModelConfig) -> nn.Module:
    """GPT for arch gpt, EncoderDecoder for encdec, LSTMLM for lstm, Encoder for encoder, initialised from the
    global torch RNG."""
    return _MODELS[cfg.arch](cfg)
