"""The decoder-only family (model.arch gpt): GPT-2 by default, Llama, Mistral and Qwen2 by options, mixtures of
experts (Mixtral, OLMoE, Qwen3-MoE) with model.n_experts."""

import dataclasses
import math
from typing import TYPE_CHECKING

from lm.models import next_token
from lm.models.family import (
    PLAIN_LOSS,
    Estimates,
    Family,
    HFAdapter,
    LossOptions,
    Parallel,
    Run,
    TPStyle,
    float8_except,
)
from lm.models.gpt import hf, hf_moe, hf_remote
from lm.models.gpt.config import GPTConfig
from lm.models.sizes import kept_logits_bytes, layer_activation_bytes, logits_bytes, stack_peak_bytes

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.nn as nn

    from lm.data.config import DataConfig
    from lm.models.terms import Losses


def build(cfg: GPTConfig) -> "nn.Module":
    from lm.models.gpt.model import GPT

    return GPT(cfg)


def blocks(model: "nn.Module") -> list["nn.Module"]:
    return list(model.blocks)


def stage(model: "nn.Module", layers: range, sequence_shards: int = 1) -> "nn.Module":
    from lm.models.gpt.model import GPTStage

    return GPTStage(model, layers, sequence_shards)


def tensor_styles(model: "nn.Module") -> dict[str, TPStyle]:
    """Megatron's split with sequence parallelism: each block's q, k, v and first MLP matrices by heads and
    hidden units, its two output projections back to sequence slices; norms on sequence slices; the
    embedding and the head by vocabulary rows. Positions are added while the embedded sequence is whole, and
    the dropout after them cuts it, so learned, sinusoidal and rotary positions all work."""
    plan = {"wte": TPStyle.EMBEDDING, "drop": TPStyle.SCATTER, "lm_head": TPStyle.HEAD}
    if model.cfg.final_norm:
        plan["ln_f"] = TPStyle.SEQUENCE
    if model.cfg.pos == "learned":
        plan["wpe"] = TPStyle.REPLICATE
    for i, block in enumerate(model.blocks):
        b = f"blocks.{i}."
        plan |= {b + "ln_1": TPStyle.SEQUENCE, b + "attn": TPStyle.GATHER, b + "attn.q": TPStyle.COLUMNS,
                 b + "attn.k": TPStyle.COLUMNS, b + "attn.v": TPStyle.COLUMNS, b + "attn.proj": TPStyle.ROWS,
                 b + "ln_2": TPStyle.SEQUENCE}
        if hasattr(block.mlp, "router"):
            plan |= _experts_styles(block.mlp, b + "mlp")
        else:
            plan |= {b + "mlp": TPStyle.GATHER, b + "mlp.fc": TPStyle.COLUMNS, b + "mlp.proj": TPStyle.ROWS}
        if hasattr(block.mlp, "gate"):
            plan[b + "mlp.gate"] = TPStyle.COLUMNS
        if hasattr(block.attn, "q_norm"):
            plan |= {b + "attn.q_norm": TPStyle.HEADS, b + "attn.k_norm": TPStyle.HEADS}
    return plan


def _experts_styles(moe: "nn.Module", name: str) -> dict[str, TPStyle]:
    """A mixture-of-experts sublayer runs whole on every tensor-parallel rank, over the whole sequence: its router's
    balance is measured over the same tokens as on one process, and its experts stay whole (with parallel.ep, the
    ones of this rank's expert-parallel group)."""
    plan = {name: TPStyle.WHOLE, f"{name}.router.gate": TPStyle.REPLICATE, f"{name}.experts": TPStyle.EXPERTS}
    if moe.shared is not None:
        plan[f"{name}.shared"] = TPStyle.REPLICATE
    return plan


def experts(model: "nn.Module") -> list["nn.Module"]:
    from lm.models.gpt.moe import MoE

    return [m.experts for m in model.modules() if isinstance(m, MoE)]


def expert_problem(cfg: GPTConfig, ep: int) -> str | None:
    """Each expert-parallel rank holds n_experts / ep of every mixture-of-experts layer's experts."""
    if not cfg.n_experts:
        return "the model has no experts to split (model.n_experts=0); expected parallel.ep=1 or model.n_experts > 0"
    if cfg.n_experts % ep:
        fits = ", ".join(str(d) for d in range(1, cfg.n_experts + 1) if cfg.n_experts % d == 0)
        return (f"its {cfg.n_experts} experts (model.n_experts) do not split over {ep} expert-parallel ranks; "
                f"expected an ep that divides them: {fits}")
    return None


def loss(model: "nn.Module", run: Run, batch: list["torch.Tensor"], optim: LossOptions = PLAIN_LOSS) -> "Losses":
    """The next-token loss (`lm.models.next_token`), and with model.n_experts the routers' terms
    (`lm.models.gpt.moe.with_router_terms`)."""
    from lm.models.gpt.moe import router_stats, with_router_terms

    losses = next_token.loss(model, run, batch, optim)
    cfg = model.cfg
    return with_router_terms(_local_terms(losses), router_stats(model), batch[1].numel(), cfg.aux_loss_coef,
                             cfg.router_z_loss_coef) if cfg.n_experts else losses


def _local_terms(losses: "Losses") -> "Losses":
    """`losses` with each value as this rank holds it. Under tensor parallelism the cross-entropy over vocabulary
    slices is a replicated DTensor (the same on every rank), and the routers' terms, plain tensors, cannot join it
    in one graph; its local value can, and its backward hands the gradient back to the DTensor. Duck-typed: model
    code imports no torch.distributed."""
    local = {name: dataclasses.replace(term, value=term.value.to_local()) if hasattr(term.value, "to_local") else term
             for name, term in losses.terms.items()}
    return dataclasses.replace(losses, terms=local)


def after_step(model: "nn.Module", reduce: "Callable[[torch.Tensor], torch.Tensor]", size: "torch.Tensor") -> None:
    """The routers' balancing biases (model.router_bias_rate) move toward an even load (`balance_routers`); a model
    without them (a dense one, or a pipeline engine's stages) is left alone, with no collective."""
    from lm.models.gpt.moe import balance_routers

    balance_routers(model, reduce, size)


def _experts_problem(cfg: GPTConfig, layout: str) -> str | None:
    if cfg.n_experts:
        return (f"model.n_experts: mixtures of experts train on the data-parallel engines (ddp, fsdp, deepspeed) and "
                f"under parallel.tp and parallel.ep so far, not under {layout}")
    return None


def tensor_problem(cfg: GPTConfig, tp: int) -> str | None:
    """Each rank keeps n_head / tp query heads, n_kv_head / tp key/value heads, d_ff / tp hidden units and a 1/tp
    slice of the (padded) vocabulary, so tp must divide all four. A mixture-of-experts sublayer is not split: every
    tensor-parallel rank runs it whole (`_experts_styles`)."""
    sizes = {"query heads (model.n_head)": cfg.n_head, "key/value heads (model.n_kv_head)": cfg.kv_heads,
             "feed-forward units (model.d_ff)": cfg.ff_dim, "padded vocabulary rows": cfg.padded_vocab_size}
    for what, n in sizes.items():
        if n % tp:
            common = math.gcd(*sizes.values())
            fits = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
            found = f"{tp} tensor-parallel ranks are more than its {n} {what}" if tp > n else \
                f"its {n} {what} do not split over {tp} tensor-parallel ranks"
            return f"{found}; a tp that splits this model: {fits}"
    if cfg.qk_norm and cfg.qk_norm_scope == "all":
        return ("model.qk_norm_scope=all normalises every head's queries together, and each tensor-parallel "
                "rank holds some heads only; set model.qk_norm_scope=head or parallel.tp=1")
    if cfg.loss_chunk:
        return ("model.loss_chunk cuts the positions into chunks, and the vocabulary-parallel loss needs "
                "each rank's whole slice of logits; set model.loss_chunk=0 (the logits are 1/tp per rank)")
    return None


def pipeline_problem(cfg: GPTConfig, stages: int) -> str | None:
    """Every stage holds one block or more; the embedding sits on the first stage and the head on the last, so
    they cannot share one weight. The routers' loss terms are not gathered across stages yet."""
    if problem := _experts_problem(cfg, "pipeline parallelism (parallel.pp)"):
        return problem
    if stages > cfg.n_layer:
        return (f"{stages} pipeline stages (parallel.pp x parallel.pp_stages_per_rank) are more than the "
                f"model's {cfg.n_layer} layers (model.n_layer); use at most {cfg.n_layer}")
    if cfg.tie_embeddings:
        return ("the token embedding sits on the first pipeline stage and the output head on the last, so "
                "they cannot share one weight; set model.tie_embeddings=false")
    return None


def context_problem(cfg: GPTConfig, ranks: int) -> str | None:
    """Context parallelism splits every config but a mixture of experts, whose routers would see a slice of
    each sequence on each rank."""
    return _experts_problem(cfg, "context parallelism (parallel.cp)")


def idle_expert_params(cfg: GPTConfig) -> int:
    """The parameters of the experts a token does not go through: (n_experts - experts_per_token) experts in
    every mixture-of-experts block."""
    per_expert = (3 if cfg.mlp == "swiglu" else 2) * cfg.d_model * cfg.expert_ff
    return cfg.moe_layers * (cfg.n_experts - cfg.experts_per_token) * per_expert


def flops_per_token(cfg: GPTConfig, seq_len: int, data: "DataConfig", params: int) -> float:
    """6 per active parameter (forward + backward; `params` leaves out a mixture of experts' idle experts,
    `idle_expert_params`, and an untied token embedding, which is only looked up) plus the attention scores:
    12 * n_layer * n_head * head_dim * seq_len for QK^T and AV in forward and backward (the PaLM appendix B
    estimate), counted for full rather than causal attention."""
    return 6 * params + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len


def activation_bytes(cfg: GPTConfig, data: "DataConfig", micro_batch: int, act_bytes: int, residual_bytes: int,
                     every: int, fused_attention: bool) -> tuple[int, int]:
    """The blocks (`lm.models.sizes.stack_peak_bytes`: checkpointed ones recomputed in backward); then the final norm's
    and the head's inputs and the embedding's dropout mask; then the logits (with model.loss_chunk, one
    chunk's: forward keeps none and backward recomputes one chunk at a time)."""
    b, s, h = micro_batch, data.seq_len, cfg.d_model
    t = b * s
    full = layer_activation_bytes(cfg, b, s, act_bytes, residual_bytes, fused_attention)
    if cfg.n_experts:
        # an upper estimate for every block: the larger of a dense one and a mixture of experts, whose k routed
        # and the shared experts keep their hidden units for each token, beside each token's k copies
        experts = dataclasses.replace(cfg, d_ff=(cfg.experts_per_token + cfg.n_shared_experts) * cfg.expert_ff)
        routed = layer_activation_bytes(experts, b, s, act_bytes, residual_bytes, fused_attention)
        full = max(full, routed + (cfg.experts_per_token * act_bytes * h + 4 * cfg.n_experts) * t)
    stack = stack_peak_bytes(cfg.n_layer, every, full, residual_bytes * t * h)
    final_norm = residual_bytes if cfg.final_norm else 0
    tail = (final_norm + act_bytes + (1 if cfg.dropout > 0 else 0)) * t * h
    positions = min(t, cfg.loss_chunk or t)
    # a soft-cap's tanh saves its fp32 output for backward
    logits = logits_bytes(positions, cfg.padded_vocab_size) + (4 * positions * cfg.padded_vocab_size
                                                                if cfg.logit_softcap else 0)
    return stack + tail + logits, logits


def kept_logits(cfg: GPTConfig, data: "DataConfig", micro_batch: int) -> int:
    """The log-softmax (and a soft-cap's tanh) that the loss keeps for backward; with model.loss_chunk none,
    since backward recomputes each chunk's."""
    if cfg.loss_chunk:
        return 0
    t, vocab = micro_batch * data.seq_len, cfg.padded_vocab_size
    return kept_logits_bytes(t, vocab) + (4 * t * vocab if cfg.logit_softcap else 0)


FAMILY = Family(
    name="gpt",
    config_class=GPTConfig,
    build=build,
    blocks=blocks,
    training=dataclasses.replace(next_token.TRAINING, loss=loss, after_step=after_step),
    parallel=Parallel(tensor_styles=tensor_styles, tensor_problem=tensor_problem, context_problem=context_problem,
                      stage=stage, pipeline_problem=pipeline_problem, experts=experts,
                      expert_problem=expert_problem),  # GPT.forward takes a SequenceShard
    sampler=next_token.SAMPLER,
    # the native classes first, lm's own code last
    hf=HFAdapter((*hf.TARGETS, *hf_moe.TARGETS, hf_remote.TARGET), {**hf.READERS, **hf_moe.READERS}),
    estimates=Estimates(activation_bytes, flops_per_token, idle_params=idle_expert_params, kept_logits=kept_logits,
                        context_kv=lambda cfg: 2 * cfg.kv_heads * cfg.head_dim),  # every block's k and v
    # a router's few scores decide which experts a token reaches: kept out of float8 like the head
    float8_linears=float8_except("lm_head", "router.gate"),
)
