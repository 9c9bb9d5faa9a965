"""The recurrent baseline (model.arch lstm): what the transformers are measured against."""

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from lm.errors import ConfigError
from lm.models.lstm.config import LSTMConfig
from lm.models.next_token import NextTokenFamily
from lm.models.sizes import checkpointed_blocks, embedding_params, logits_bytes, stack_bytes

if TYPE_CHECKING:
    from lm.data.config import DataConfig


def layer_params(cfg: LSTMConfig) -> int:
    """One LSTM layer: weight_ih and weight_hh (4h x h), and with `bias` bias_ih and bias_hh (4h each)."""
    h = cfg.d_model
    return 2 * 4 * h * h + (2 * 4 * h if cfg.bias else 0)


def layer_activation_bytes(cfg: LSTMConfig, batch: int, seq: int, act_bytes: int = 2) -> int:
    """Bytes one LSTM layer saves for backward on `batch` sequences of `seq` tokens, what PyTorch's unfused LSTM
    saves: its input, and at every step the previous hidden state, four gates, the previous cell state and
    tanh of the new one (8 values per hidden unit and token).

    This count is exact for the unfused kernel; the fused ones keep their own buffers instead: cuDNN a reserve
    space whose size it does not publish, the CPU's oneDNN kernel a workspace of 64 bytes per token and unit in
    float32, and CPU autocast keeps the cell states in fp32 (4 bytes more per token and unit)."""
    return 8 * act_bytes * batch * seq * cfg.d_model


class LSTMFamily(NextTokenFamily):
    name = "lstm"
    config_class = LSTMConfig
    memory_note = ("lstm: activ counts what PyTorch's unfused LSTM saves (8 values per hidden unit, token and "
                   "layer); cuDNN keeps a reserve space of unpublished size instead, so treat it as approximate")

    def build(self, cfg: LSTMConfig) -> nn.Module:
        from lm.models.lstm.model import LSTMLM

        return LSTMLM(cfg)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.layers)

    def check_precision(self, cfg: LSTMConfig, device_type: str, bf16: bool) -> None:
        """Refuse bf16 autocast on a CPU whose oneDNN cannot run an LSTM in it, before the first step would.

        CPU autocast hands nn.LSTM to oneDNN in bf16, which CPUs without bf16 support reject with an opaque
        "could not create a primitive descriptor"; a one-unit LSTM tells which kind of CPU this is.
        """
        if device_type != "cpu" or not bf16:
            return
        with torch.device("meta"):  # uninitialised weights: the probe draws nothing from the RNG the run seeded
            probe = nn.LSTM(1, 1)
        probe.to_empty(device="cpu")
        try:
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                probe(torch.zeros(1, 1, 1))
        except RuntimeError:
            raise ConfigError("train.dtype: bfloat16 autocasts model.arch=lstm to bf16, which this CPU's LSTM kernel "
                              "(oneDNN) cannot run; use train.dtype=float32 (or auto) on the CPU") from None

    # ---- sizes -----------------------------------------------------------------------------------

    def root_params(self, cfg: LSTMConfig) -> int:
        """The token embedding and an untied head: no positions and no norms."""
        return embedding_params(cfg) * (1 if cfg.tie_embeddings else 2)

    def unit_params(self, cfg: LSTMConfig) -> int:
        return layer_params(cfg)

    def num_params(self, cfg: LSTMConfig, non_embedding: bool = False) -> int:
        """Every parameter, a tied head counted once (an LSTM has no position table to leave out)."""
        return self.root_params(cfg) + cfg.n_layer * layer_params(cfg)

    def activation_bytes(self, cfg: LSTMConfig, data: "DataConfig", micro_batch: int, act_bytes: int,
                         residual_bytes: int, every: int, fused_attention: bool) -> tuple[int, int]:
        """Its layers (`layer_activation_bytes`); checkpointing keeps each checkpointed layer's input (r*t*h for
        the first, which reads the embedding, c*t*h for the others) plus one layer recomputed. Outside the
        layers: the head's input, a 1-byte dropout mask after the embedding and after every layer (dropout > 0),
        and the logits (one chunk's with model.loss_chunk). Every weight is used once per token, so the FLOPs are
        6 per parameter and nothing more."""
        b, s, h, c = micro_batch, data.seq_len, cfg.d_model, act_bytes
        t = b * s
        full = layer_activation_bytes(cfg, b, s, c)
        k = checkpointed_blocks(cfg.n_layer, every)
        layers = stack_bytes(cfg.n_layer, k, full, c * t * h)
        if k:  # one layer recomputed; the first checkpoint holds the embedding output, as wide as the residual
            layers += full + (residual_bytes - c) * t * h
        logits = logits_bytes(min(t, cfg.loss_chunk or t), cfg.padded_vocab_size)
        drop = 1 if cfg.dropout > 0 else 0
        return layers + (c + drop * (cfg.n_layer + 1)) * t * h + logits, logits
