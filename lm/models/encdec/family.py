"""The encoder-decoder (model.arch encdec), trained by span corruption and sampled by filling masks."""

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.data.objectives import Objective, SpanCorruption
from lm.data.span_corruption import corrupted_lengths
from lm.errors import ConfigError, PromptError
from lm.models.encdec import hf_remote
from lm.models.encdec.config import EncDecConfig
from lm.models.family import (
    PLAIN_LOSS,
    Estimates,
    Family,
    HFAdapter,
    LossOptions,
    Parallel,
    Refusal,
    Run,
    SampleOptions,
    Sampler,
    Scored,
    Training,
)
from lm.models.loss import cross_entropy_terms
from lm.models.sizes import (
    checkpointed_blocks,
    embedding_params,
    layer_activation_bytes,
    linear_params,
    logits_bytes,
    stack_bytes,
    stack_params,
    stack_peak_bytes,
)
from lm.models.terms import Losses

if TYPE_CHECKING:
    from lm.data.config import DataConfig


def cross_memory_bytes(cfg: EncDecConfig, batch: int, memory_len: int, c: int, residual: int) -> int:
    """All decoder layers' cross-attention inputs, computed outside the blocks: the keys and values of the
    encoder output, and the encoder output their projection saves. Under autocast (a wider residual
    stream than the matmuls) every layer casts and saves its own copy; otherwise they share one."""
    m = batch * memory_len
    keys_values = 2 * c * m * cfg.kv_heads * cfg.head_dim * cfg.n_layer
    copies = cfg.n_layer if residual > c else 1
    return keys_values + copies * c * m * cfg.d_model


def build(cfg: EncDecConfig) -> nn.Module:
    from lm.models.encdec.model import EncoderDecoder

    return EncoderDecoder(cfg)


def blocks(model: nn.Module) -> list[nn.Module]:
    return [*model.encoder, *model.decoder]


# ---- training ------------------------------------------------------------------------------------

def objective(cfg: EncDecConfig, data: "DataConfig", seq_len: int, seed: int,
              document_eot: int | None = None) -> Objective:
    """Span corruption of windows of seq_len + 1 tokens, with the sentinel and padding ids of its vocabulary;
    refuses windows whose corrupted source or target is longer than the model's positions."""
    objective = SpanCorruption(seed, cfg.sentinel_start, cfg.n_sentinels, cfg.pad_id, seq_len + 1)
    if max(objective.lengths) > cfg.block_size:
        raise ConfigError(
            f"model.block_size: {cfg.block_size} is shorter than the corrupted windows of "
            f"data.seq_len={seq_len} (source, target lengths {objective.lengths})"
        )
    return objective


def _cross_entropy(model: nn.Module, run: Run, batch: list[torch.Tensor]) -> torch.Tensor:
    """Mean float32 cross-entropy over the non-padding targets of a batch (src, tgt_in, tgt_out)."""
    src, tgt_in, tgt_out = batch
    logits = model.logits(run(src, tgt_in))  # (B, T, padded_vocab_size)
    # float32 softmax over the ~50k vocabulary, as in the GPT
    return F.cross_entropy(logits.float().flatten(0, 1), tgt_out.reshape(-1), ignore_index=model.cfg.pad_id)


def loss(model: nn.Module, run: Run, batch: list[torch.Tensor], optim: LossOptions = PLAIN_LOSS) -> Losses:
    # a mean over the non-padding targets, of which a micro-batch of full windows has the same number
    return cross_entropy_terms(_cross_entropy(model, run, batch), batch[2].numel())


def score(model: nn.Module, run: Run, batch: list[torch.Tensor]) -> Scored:
    # a full window holds no padding: every target counts
    return Scored(_cross_entropy(model, run, batch).float(), batch[2].numel())


# ---- sizes ---------------------------------------------------------------------------------------

def flops_per_token(cfg: EncDecConfig, seq_len: int, data: "DataConfig", params: int) -> float:
    """Training FLOPs per window token of span corruption of windows of seq_len + 1 tokens, each a source of S
    and a target of T tokens (`corrupted_lengths`). The stacks run on different tokens, so it counts each one's
    parameters itself and leaves `params` aside.

    Per sample: 6 per parameter per token it touches (encoder blocks, and the cross-attention's key and value
    projections of the encoder output, on the source tokens; the rest of the decoder blocks and the output head on
    the target tokens) plus the attention scores, 12 * n_layer * d_model times (S^2 encoder + T^2 decoder + T*S
    cross). Divided by the seq_len tokens the sample was cut from, so tokens/s and MFU compare with the GPT's at
    the same data rate.
    """
    S, T = corrupted_lengths(seq_len + 1)
    memory_kv = cfg.n_layer * linear_params(cfg.d_model, 2 * cfg.kv_heads * cfg.head_dim, cfg.bias)
    encoder = stack_params(cfg) + memory_kv
    decoder = stack_params(cfg, cross=True) - memory_kv + embedding_params(cfg)  # and the output head
    per_sample = 6 * (encoder * S + decoder * T) + 12 * cfg.n_layer * cfg.d_model * (S * S + T * T + T * S)
    return per_sample / seq_len


def activation_bytes(cfg: EncDecConfig, data: "DataConfig", micro_batch: int, act_bytes: int, residual_bytes: int,
                     every: int, fused_attention: bool) -> tuple[int, int]:
    """The encoder runs on the corrupted source (S tokens), the decoder on the target (U tokens); cross-attention
    adds a norm, q and output and, outside the block, each layer's keys and values of the encoder output and that
    output itself (`cross_memory_bytes`). Checkpointing counts blocks in model order, the encoder's first."""
    b, h, c, r = micro_batch, cfg.d_model, act_bytes, residual_bytes
    src, tgt = corrupted_lengths(data.seq_len + 1)  # the span-corruption objective's source and target lengths
    enc = layer_activation_bytes(cfg, b, src, c, r, fused_attention)
    dec = layer_activation_bytes(cfg, b, tgt, c, r, fused_attention, memory_len=src)
    k_enc = checkpointed_blocks(cfg.n_layer, every)
    # backward goes through the decoder first, the encoder's blocks all kept meanwhile, then the encoder
    stacks = max(stack_bytes(cfg.n_layer, k_enc, enc, r * b * src * h)
                 + stack_peak_bytes(cfg.n_layer, every, dec, r * b * tgt * h, start=cfg.n_layer),
                 stack_peak_bytes(cfg.n_layer, every, enc, r * b * src * h))
    memory = cross_memory_bytes(cfg, b, src, c, r)
    final_norm = r if cfg.final_norm else 0
    drop = 1 if cfg.dropout > 0 else 0

    def tail(tokens: int) -> int:  # final norm and head input, embedding dropout mask
        return (final_norm + c + drop) * tokens * h

    logits = logits_bytes(b * tgt, cfg.padded_vocab_size)
    return stacks + memory + tail(b * src) + tail(b * tgt) + logits, logits


# ---- inference -----------------------------------------------------------------------------------

def sample(model: nn.Module, tokenizer, prompt: str, options: SampleOptions) -> str:
    """The prompt with each `<mask>` filled (one at its end when it has none: a continuation)."""
    from lm.models.encdec.sampling import fill_masks

    cfg = model.cfg
    if options.max_new_tokens > cfg.block_size:
        raise PromptError(f"--max-new-tokens: {options.max_new_tokens} exceeds the decoder's positions "
                          f"(model.block_size={cfg.block_size})")
    return fill_masks(model, tokenizer, prompt, options)


FAMILY = Family(
    name="encdec",
    config_class=EncDecConfig,
    build=build,
    blocks=blocks,
    training=Training(objective, loss, score),
    parallel=Parallel(
        tensor_problem=Refusal("has no tensor-parallel plan yet: its two stacks and cross-attention are not split; "
                               "train it with parallel.tp=1 (FSDP2 shards it over every rank)"),
        pipeline_problem=Refusal("has no pipeline stages yet: its encoder output would have to reach every decoder "
                                 "stage; train it with parallel.pp=1")),
    sampler=Sampler(sample, outside_forward=True),  # encode, then decode step by step
    hf=HFAdapter((hf_remote.TARGET,)),
    estimates=Estimates(activation_bytes, flops_per_token),
)
