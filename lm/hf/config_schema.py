"""What each config.json setting that lm reads may hold, checked once before any family reads the file.

A transformers config.json is hand-edited and written by many tools, so a value of the wrong type or range
(`"num_hidden_layers": "2"`, `"rope_scaling": "linear"`, a negative epsilon) is named here with its file and
key, as one CheckpointError, instead of failing later inside a family's reader or the model's config.
Settings lm does not read are not checked: transformers' own config classes carry dozens of them.
"""

from pathlib import Path
from typing import Any

from lm.errors import CheckpointError
from lm.schema import (
    Spec,
    Table,
    count,
    flag,
    fraction,
    ints,
    name,
    names,
    nonnegative,
    or_null,
    positive,
    table,
    token_ids,
)
from lm.schema import check as check_schema

__all__ = ["KEYS", "ROPE_KEYS", "check_config_json"]

# The rotary tables: transformers 5's rope_parameters and 4.x's rope_scaling hold the same keys.
ROPE_KEYS: dict[str, Spec] = {
    "rope_type": name, "type": name, "rope_theta": positive, "factor": positive,
    "partial_rotary_factor": positive, "original_max_position_embeddings": count,
    "low_freq_factor": positive, "high_freq_factor": positive,
}

KEYS: dict[str, Spec] = {
    "architectures": names, "model_type": name,
    "vocab_size": count, "tie_word_embeddings": flag,
    "bos_token_id": or_null(token_ids), "eos_token_id": or_null(token_ids), "pad_token_id": or_null(token_ids),
    "rope_scaling": or_null(Table(ROPE_KEYS)), "rope_parameters": or_null(Table(ROPE_KEYS)),
    "quantization_config": or_null(table),
    # GPT-2
    "n_positions": count, "n_embd": count, "n_layer": count, "n_head": count, "n_inner": or_null(count),
    "activation_function": name, "resid_pdrop": fraction, "embd_pdrop": fraction, "attn_pdrop": fraction,
    "layer_norm_epsilon": positive, "scale_attn_weights": flag, "scale_attn_by_inverse_layer_idx": flag,
    "add_cross_attention": flag,
    # Llama, Mistral, Qwen2
    "hidden_size": count, "num_attention_heads": count, "num_key_value_heads": or_null(count),
    "num_hidden_layers": count, "intermediate_size": count, "max_position_embeddings": count,
    "head_dim": or_null(count), "hidden_act": name, "rms_norm_eps": positive, "rope_theta": positive,
    "partial_rotary_factor": positive, "original_max_position_embeddings": count, "pretraining_tp": count,
    "attention_dropout": fraction, "attention_bias": flag, "mlp_bias": flag, "sliding_window": or_null(count),
    "use_sliding_window": flag, "layer_types": names,
    # SmolLM3
    "no_rope_layer_interval": count, "no_rope_layers": ints,
    # Mixtral, OLMoE, Qwen3-MoE
    "num_local_experts": count, "num_experts": count, "num_experts_per_tok": count,
    "moe_intermediate_size": count, "decoder_sparse_step": count, "mlp_only_layers": or_null(ints),
    "norm_topk_prob": flag, "router_aux_loss_coef": nonnegative, "router_z_loss_coef": nonnegative,
    "router_jitter_noise": nonnegative, "clip_qkv": or_null(positive),
}


def check_config_json(hf: dict[str, Any], origin: Path) -> None:
    """Raise CheckpointError naming `origin` and the first setting lm reads whose value has the wrong type or
    range (see KEYS); settings lm does not read pass unchecked."""
    check_schema(hf, KEYS, origin, CheckpointError)
