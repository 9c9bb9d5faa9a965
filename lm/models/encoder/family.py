"""The encoder (model.arch encoder): masked-LM pretraining on token shards, then a classify or regress head
fine-tuned on labelled rows (`lm.finetune`), its trunk loaded from the pretrained checkpoint."""

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.data.masking import IGNORE, target_count
from lm.data.objectives import MaskedLM, Objective
from lm.models.encoder import hf, hf_remote
from lm.models.encoder.config import EncoderConfig
from lm.models.family import (
    PLAIN_LOSS,
    Estimates,
    Family,
    HFAdapter,
    LossOptions,
    Parallel,
    Refusal,
    Run,
    Scored,
    TaskHead,
    Training,
    float8_except,
)
from lm.models.loss import cross_entropy_terms
from lm.models.sizes import (
    embedding_params,
    layer_activation_bytes,
    linear_params,
    logits_bytes,
    norm_params,
    stack_peak_bytes,
)
from lm.models.terms import Losses

if TYPE_CHECKING:
    from lm.data.config import DataConfig


def head_params(cfg: EncoderConfig) -> int:
    """The head modules: mlm, the dense layer, its norm and the output layer (its weight only when untied; its
    bias, the one parameter tying leaves it, with `bias`); classify and regress, `score`."""
    d, vocab = cfg.d_model, cfg.padded_vocab_size
    if cfg.head != "mlm":
        return linear_params(d, cfg.num_classes or 1, True)
    output = (0 if cfg.tie_embeddings else vocab * d) + (vocab if cfg.bias else 0)
    return linear_params(d, d, cfg.bias) + norm_params(cfg) + output


def build(cfg: EncoderConfig) -> nn.Module:
    from lm.models.encoder.model import Encoder

    return Encoder(cfg)


def blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks)


# ---- training ------------------------------------------------------------------------------------

def objective(cfg: EncoderConfig, data: "DataConfig", seq_len: int, seed: int,
              document_eot: int | None = None) -> Objective:
    """Masked LM with data's mlm_* keys (the run's, so evaluation masks as training did)."""
    return MaskedLM(seed, cfg.vocab_size, cfg.mask_id, cfg.cls_id, data.mlm_rate, data.mlm_mask_fraction,
                    data.mlm_random_fraction, document_eot)


def _masked(model: nn.Module, run: Run, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked LM on a batch (ids, labels) or (ids, labels, keep, positions): the logits (N, V) of the N predicted
    positions in row-major order, their targets (N,) and the mean cross-entropy. Selecting the positions reads
    their count back from the device (one synchronisation per batch); the head then runs on them alone."""
    ids, labels, *rest = batch
    h = run(ids, *rest)  # (B, T, C)
    predicted = labels != IGNORE  # (B, T)
    logits = model.mlm_logits(h[predicted])  # (N, padded_vocab_size)
    targets = labels[predicted]
    # float32 softmax over the vocabulary, as in the GPT
    return logits, targets, F.cross_entropy(logits.float(), targets)


def _task_loss(out: torch.Tensor, labels: torch.Tensor, head: str) -> torch.Tensor:
    """Cross-entropy of (B, n) logits against classes, or mean squared error of (B,) predictions."""
    if head == "regress":
        return F.mse_loss(out.float(), labels.float())
    return F.cross_entropy(out.float(), labels)


def task_outputs(model: nn.Module, run: Run, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return model.task_outputs(run(ids, keep), keep)


def loss(model: nn.Module, run: Run, batch: list[torch.Tensor], optim: LossOptions = PLAIN_LOSS) -> Losses:
    """Masked LM on shards' windows, weighted by the masked tokens; a fine-tuning head on labelled rows (ids,
    labels, keep), weighted by the rows."""
    head = model.cfg.task_head
    if head is None:
        _, targets, masked = _masked(model, run, batch)
        return cross_entropy_terms(masked, targets.numel())
    ids, labels, keep = batch
    return cross_entropy_terms(_task_loss(task_outputs(model, run, ids, keep), labels, head), labels.shape[0])


def score(model: nn.Module, run: Run, batch: list[torch.Tensor]) -> Scored:
    """Masked LM: the loss over the masked tokens and how many of them the argmax predicts."""
    logits, targets, masked = _masked(model, run, batch)
    return Scored(masked.float(), targets.numel(), (logits.argmax(-1) == targets).sum())


def is_head_param(name: str) -> bool:
    return name.startswith("score.")


def output_layers(model: nn.Module) -> list[nn.Module]:
    """The layers whose rows score one token or class: the masked-token head, or a fine-tuning head (`score`),
    which Muon leaves to AdamW."""
    return [layer for layer in (getattr(model, "lm_head", None), getattr(model, "score", None)) if layer is not None]


# ---- sizes ---------------------------------------------------------------------------------------

def flops_per_token(cfg: EncoderConfig, seq_len: int, data: "DataConfig", params: int) -> float:
    """The trunk (blocks, norms) runs on every token: 6 per parameter plus the attention scores (full, as the
    encoder's attention is). The head runs on fewer: head mlm on the k targets of each window
    (`lm.data.masking.target_count` of data.mlm_rate: the loss runs the head on those alone), a classify or
    regress head once per sequence on the pooled vector. The output layer's weight counts whether tied or not
    (`params` holds it only when tied): the embedding lookup does no matmul, the head does."""
    vocab_weight = embedding_params(cfg) if cfg.head == "mlm" and cfg.tie_embeddings else 0
    head = head_params(cfg) + vocab_weight
    trunk = params - head
    per_sequence = 1 if cfg.head != "mlm" else target_count(seq_len, data.mlm_rate)
    attention = 12 * cfg.n_layer * cfg.d_model * seq_len
    return 6 * trunk + attention + 6 * head * per_sequence / seq_len


def activation_bytes(cfg: EncoderConfig, data: "DataConfig", micro_batch: int, act_bytes: int, residual_bytes: int,
                     every: int, fused_attention: bool) -> tuple[int, int]:
    """Its blocks as the GPT's, on all s tokens of each sequence; outside them the embedding norm's input r*t*h,
    the final norm's (pre-norm) and a dropout mask. The masked-LM head runs on the n = b*k targets only: the
    inputs of its dense layer, GELU, norm and output layer, (3c + r)*n*h (autocast runs the norm in fp32, as wide
    as the stream), and the logits of n positions. A classify or regress head saves only its pooled input, c*b*h
    (a fine-tuning sequence counted as data.seq_len tokens, an upper bound of padded examples)."""
    b, s, h, c, r = micro_batch, data.seq_len, cfg.d_model, act_bytes, residual_bytes
    t = b * s
    full = layer_activation_bytes(cfg, b, s, c, r, fused_attention)
    stack = stack_peak_bytes(cfg.n_layer, every, full, r * t * h)
    final_norm = r if cfg.final_norm else 0
    trunk = (r + final_norm + (1 if cfg.dropout > 0 else 0)) * t * h  # embedding norm, final norm, mask
    if cfg.head != "mlm":
        return stack + trunk + c * b * h, 0
    n = b * target_count(s, data.mlm_rate)
    logits = logits_bytes(n, cfg.padded_vocab_size)
    return stack + trunk + (3 * c + r) * n * h + logits, logits


FAMILY = Family(
    name="encoder",
    config_class=EncoderConfig,
    build=build,
    blocks=blocks,
    output_layers=output_layers,
    training=Training(objective, loss, score,
                      head=TaskHead(("head", "num_classes", "pooling"), is_head_param, task_outputs)),
    parallel=Parallel(
        tensor_problem=Refusal("has no tensor-parallel plan yet: its fine-tuning heads and masked-token scoring "
                               "are not split; train it with parallel.tp=1 (FSDP2 shards it over every rank)"),
        pipeline_problem=Refusal("has no pipeline stages yet: its heads read the padding mask, which would have to "
                                 "reach every stage; train it with parallel.pp=1")),
    hf=HFAdapter((*hf.TARGETS, hf_remote.TARGET)),  # BERT first, lm's own code last
    estimates=Estimates(activation_bytes, flops_per_token),
    # the masked-token head (its dense layer too) and a fine-tuning head stay out of float8
    float8_linears=float8_except("lm_head", "mlm_dense", "score"),
)
