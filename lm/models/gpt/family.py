"""The decoder-only family (model.arch gpt): GPT-2 by default, Llama, Mistral and Qwen2 by options."""

from typing import TYPE_CHECKING

import torch.nn as nn

from lm.models.family import TPStyle
from lm.models.gpt import hf, hf_remote
from lm.models.gpt.config import GPTConfig
from lm.models.next_token import NextTokenFamily
from lm.models.sizes import (
    block_params,
    checkpointed_blocks,
    embedding_params,
    final_norm_params,
    layer_activation_bytes,
    logits_bytes,
    position_params,
    stack_bytes,
)

if TYPE_CHECKING:
    from lm.data.config import DataConfig


class GPTFamily(NextTokenFamily):
    name = "gpt"
    config_class = GPTConfig
    hf_targets = (*hf.TARGETS, hf_remote.TARGET)  # the native classes first, lm's own code last
    hf_readers = hf.READERS

    def build(self, cfg: GPTConfig) -> nn.Module:
        from lm.models.gpt.model import GPT

        return GPT(cfg)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def pipeline_stage(self, model: nn.Module, layers: range, sequence_shards: int = 1) -> nn.Module:
        from lm.models.gpt.model import GPTStage

        return GPTStage(model, layers, sequence_shards)

    def tensor_parallel(self, model: nn.Module) -> dict[str, TPStyle]:
        """Megatron's split with sequence parallelism: each block's q, k, v and first MLP matrices by heads and
        hidden units, its two output projections back to sequence slices; norms on sequence slices; the
        embedding and the head by vocabulary rows. Positions are added while the embedded sequence is whole,
        and the first block cuts it, so learned, sinusoidal and rotary positions all work."""
        plan = {"wte": TPStyle.EMBEDDING, "blocks.0": TPStyle.SCATTER, "lm_head": TPStyle.HEAD}
        if model.cfg.final_norm:
            plan["ln_f"] = TPStyle.SEQUENCE
        if model.cfg.pos == "learned":
            plan["wpe"] = TPStyle.REPLICATE
        for i, block in enumerate(model.blocks):
            b = f"blocks.{i}."
            plan |= {b + "ln_1": TPStyle.SEQUENCE, b + "attn": TPStyle.GATHER, b + "attn.q": TPStyle.COLUMNS,
                     b + "attn.k": TPStyle.COLUMNS, b + "attn.v": TPStyle.COLUMNS, b + "attn.proj": TPStyle.ROWS,
                     b + "ln_2": TPStyle.SEQUENCE, b + "mlp": TPStyle.GATHER, b + "mlp.fc": TPStyle.COLUMNS,
                     b + "mlp.proj": TPStyle.ROWS}
            if hasattr(block.mlp, "gate"):
                plan[b + "mlp.gate"] = TPStyle.COLUMNS
            if hasattr(block.attn, "q_norm"):
                plan |= {b + "attn.q_norm": TPStyle.HEADS, b + "attn.k_norm": TPStyle.HEADS}
        return plan

    # ---- sizes -----------------------------------------------------------------------------------

    def root_params(self, cfg: GPTConfig) -> int:
        """Token embedding, untied head, final norm, learned positions."""
        untied = 0 if cfg.tie_embeddings else embedding_params(cfg)
        return embedding_params(cfg) + untied + final_norm_params(cfg) + position_params(cfg)

    def unit_params(self, cfg: GPTConfig) -> int:
        return block_params(cfg)

    def num_params(self, cfg: GPTConfig, non_embedding: bool = False) -> int:
        """Every parameter, a tied head counted once; `non_embedding` leaves out the position table (it does no
        matmul) but keeps the token embedding, which tied is also the output layer (as in GPT-2's counts)."""
        n = self.root_params(cfg) + cfg.n_layer * block_params(cfg)
        return n - position_params(cfg) if non_embedding else n

    def flops_per_token(self, cfg: GPTConfig, seq_len: int, data: "DataConfig") -> float:
        """6 per parameter (forward + backward) plus the attention scores: 12 * n_layer * n_head * head_dim *
        seq_len for QK^T and AV in forward and backward (the PaLM appendix B estimate), counted for full rather
        than causal attention."""
        return 6 * self.num_params(cfg, non_embedding=True) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len

    def activation_bytes(self, cfg: GPTConfig, data: "DataConfig", micro_batch: int, act_bytes: int,
                         residual_bytes: int, every: int, fused_attention: bool) -> tuple[int, int]:
        """The blocks (`lm.models.sizes`), one of them recomputed when any is checkpointed; then the final norm's
        and the head's inputs and the embedding's dropout mask; then the logits (with model.loss_chunk, one
        chunk's: forward keeps none and backward recomputes one chunk at a time)."""
        b, s, h = micro_batch, data.seq_len, cfg.d_model
        t = b * s
        full = layer_activation_bytes(cfg, b, s, act_bytes, residual_bytes, fused_attention)
        k = checkpointed_blocks(cfg.n_layer, every)
        blocks = stack_bytes(cfg.n_layer, k, full, residual_bytes * t * h) + (full if k else 0)
        final_norm = residual_bytes if cfg.final_norm else 0
        tail = (final_norm + act_bytes + (1 if cfg.dropout > 0 else 0)) * t * h
        positions = min(t, cfg.loss_chunk or t)
        # a soft-cap's tanh saves its fp32 output for backward
        logits = logits_bytes(positions, cfg.padded_vocab_size) + (4 * positions * cfg.padded_vocab_size
                                                                    if cfg.logit_softcap else 0)
        return blocks + tail + logits, logits
