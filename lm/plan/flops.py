"""Training FLOPs per token and the peak FLOP/s of known GPUs: what tokens/s, TFLOP/s and MFU are made of."""

import torch

from lm.data.config import DataConfig
from lm.data.masking import target_count
from lm.data.span_corruption import corrupted_lengths
from lm.models.config import ModelConfig
from lm.plan.param_count import head_params, num_params, stack_params

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, matched against
# torch.cuda.get_device_name(); order matters where one name contains another.
PEAK_FLOPS = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("V100", 125e12),
]


def flops_per_token(cfg: ModelConfig, seq_len: int, mlm_rate: float = DataConfig.mlm_rate) -> float:
    """Training FLOPs per token of windows of `seq_len` tokens: 6 per parameter (forward + backward) plus
    attention scores.

    The parameters leave out position tables (no matmul) but count the tied output head. The attention
    term 12 * n_layer * d_model * seq_len covers QK^T and AV in forward and backward (the PaLM appendix B
    estimate), counted for full rather than causal attention. An LSTM has no attention: every weight, its
    gates' and the head's, is used once per token, so 6 per parameter is all. An encoder-decoder: see
    `encdec_flops_per_token`; an encoder (`mlm_rate`: data.mlm_rate): see `encoder_flops_per_token`.
    """
    if cfg.arch == "encdec":
        return encdec_flops_per_token(cfg, seq_len)
    if cfg.arch == "encoder":
        return encoder_flops_per_token(cfg, seq_len, mlm_rate)
    attention = 0 if cfg.arch == "lstm" else 12 * cfg.n_layer * cfg.d_model * seq_len
    return 6 * num_params(cfg, non_embedding=True) + attention


def encdec_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per window token of an encoder-decoder trained by span corruption of windows of
    seq_len + 1 tokens, each a source of S and a target of T tokens (`corrupted_lengths`).

    Per sample: 6 per parameter per token it touches (encoder blocks on the source tokens; decoder
    blocks and the output head on the target tokens) plus the attention scores, 12 * n_layer * d_model
    times (S^2 encoder + T^2 decoder + T*S cross). Divided by the seq_len tokens the sample was cut
    from, so tokens/s and MFU compare with the GPT's at the same data rate.
    """
    S, T = corrupted_lengths(seq_len + 1)
    encoder = stack_params(cfg)
    decoder = stack_params(cfg, cross=True) + cfg.padded_vocab_size * cfg.d_model  # and the output head
    per_sample = 6 * (encoder * S + decoder * T) + 12 * cfg.n_layer * cfg.d_model * (S * S + T * T + T * S)
    return per_sample / seq_len


def encoder_flops_per_token(cfg: ModelConfig, seq_len: int, mlm_rate: float) -> float:
    """Training FLOPs per token of an encoder on sequences of `seq_len` tokens.

    The trunk (blocks, norms) runs on every token: 6 per parameter plus the attention scores (full, as
    the encoder's attention is). The head runs on fewer: head mlm on the k targets of each window
    (`lm.data.masking.target_count`: the model runs its head on those alone), a classify or regress
    head once per sequence on the pooled vector. The output layer's weight counts whether tied or not:
    the embedding lookup does no matmul, the head does.
    """
    vocab_weight = cfg.padded_vocab_size * cfg.d_model if cfg.head == "mlm" and cfg.tie_embeddings else 0
    head = head_params(cfg) + vocab_weight
    trunk = num_params(cfg, non_embedding=True) - cfg.padded_vocab_size * cfg.d_model - head_params(cfg)
    per_sequence = 1 if cfg.head != "mlm" else target_count(seq_len, mlm_rate)
    attention = 12 * cfg.n_layer * cfg.d_model * seq_len
    return 6 * trunk + attention + 6 * head * per_sequence / seq_len


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a known GPU, or None (CPUs and unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS:
        if key in name:
            return value
    return None
