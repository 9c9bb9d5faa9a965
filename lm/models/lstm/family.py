"""The recurrent baseline (model.arch lstm): what the transformers are measured against."""

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from lm.errors import ConfigError
from lm.models import next_token
from lm.models.family import Estimates, Family, Parallel, Refusal
from lm.models.lstm.config import LSTMConfig
from lm.models.sizes import logits_bytes, stack_peak_bytes

if TYPE_CHECKING:
    from lm.data.config import DataConfig


def layer_activation_bytes(cfg: LSTMConfig, batch: int, seq: int, act_bytes: int = 2) -> int:
    """Bytes one LSTM layer saves for backward on `batch` sequences of `seq` tokens, what PyTorch's unfused LSTM
    saves: its input, and at every step the previous hidden state, four gates, the previous cell state and
    tanh of the new one (8 values per hidden unit and token).

    This count is exact for the unfused kernel; the fused ones keep their own buffers instead: cuDNN a reserve
    space whose size it does not publish, the CPU's oneDNN kernel a workspace of 64 bytes per token and unit in
    float32, and CPU autocast keeps the cell states in fp32 (4 bytes more per token and unit)."""
    return 8 * act_bytes * batch * seq * cfg.d_model


def build(cfg: LSTMConfig) -> nn.Module:
    from lm.models.lstm.model import LSTMLM

    return LSTMLM(cfg)


def blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.layers)


def check_precision(cfg: LSTMConfig, device_type: str, bf16: bool) -> None:
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


def activation_bytes(cfg: LSTMConfig, data: "DataConfig", micro_batch: int, act_bytes: int, residual_bytes: int,
                     every: int, fused_attention: bool) -> tuple[int, int]:
    """Its layers (`layer_activation_bytes`); checkpointing keeps each checkpointed layer's input (r*t*h for the
    first, which reads the embedding, c*t*h for the others) plus one layer recomputed. Outside the layers: the
    head's input, a 1-byte dropout mask after the embedding and after every layer (dropout > 0), and the logits
    (one chunk's with model.loss_chunk). Every weight is used once per token, so the FLOPs are 6 per parameter
    and nothing more."""
    b, s, h, c = micro_batch, data.seq_len, cfg.d_model, act_bytes
    t = b * s
    full = layer_activation_bytes(cfg, b, s, c)
    layers = stack_peak_bytes(cfg.n_layer, every, full, c * t * h)
    if every:  # the first checkpoint (layer 0 is always one) holds the embedding output, as wide as the residual
        layers += (residual_bytes - c) * t * h
    logits = logits_bytes(min(t, cfg.loss_chunk or t), cfg.padded_vocab_size)
    drop = 1 if cfg.dropout > 0 else 0
    return layers + (c + drop * (cfg.n_layer + 1)) * t * h + logits, logits


FAMILY = Family(
    name="lstm",
    config_class=LSTMConfig,
    build=build,
    blocks=blocks,
    training=next_token.TRAINING,
    parallel=Parallel(
        tensor_problem=Refusal("has no tensor-parallel plan: each LSTM step mixes every hidden unit with every "
                               "other, so splitting units over ranks costs a collective per token; train it with "
                               "parallel.tp=1"),
        pipeline_problem=Refusal("has no pipeline stages yet: a few LSTM layers fit one device; train it with "
                                 "parallel.pp=1")),
    sampler=next_token.SAMPLER,
    estimates=Estimates(activation_bytes, memory_note=(
        "lstm: activ counts what PyTorch's unfused LSTM saves (8 values per hidden unit, token and layer); cuDNN "
        "keeps a reserve space of unpublished size instead, so treat it as approximate")),
    check_precision=check_precision,
)
