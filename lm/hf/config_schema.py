"""What each config.json setting that lm reads may hold, checked once before any family reads the file.

A transformers config.json is hand-edited and written by many tools, so a value of the wrong type or range
(`"num_hidden_layers": "2"`, `"rope_scaling": "linear"`, a negative epsilon) is named here with its file and
key, as one CheckpointError, instead of failing later inside a family's reader or the model's config.
Settings lm does not read are not checked: transformers' own config classes carry dozens of them.
"""

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm.errors import CheckpointError

__all__ = ["check_config_json"]

# A check takes a value and returns what was expected, or "" when the value is fine.
Check = Callable[[Any], str]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a count


# Sizes beyond this are typos, and they would overflow a float or a tensor dimension long before they fit.
MAX_COUNT = 2**31 - 1


def _is_number(value: Any) -> bool:
    if _is_int(value):
        return abs(value) <= MAX_COUNT
    return isinstance(value, float) and math.isfinite(value)


def count(value: Any) -> str:
    return "" if _is_int(value) and 1 <= value <= MAX_COUNT else f"a positive integer up to {MAX_COUNT}"


def positive(value: Any) -> str:
    return "" if _is_number(value) and value > 0 else "a finite number above 0"


def fraction(value: Any) -> str:
    return "" if _is_number(value) and 0 <= value <= 1 else "a number from 0 to 1"


def flag(value: Any) -> str:
    return "" if isinstance(value, bool) else "true or false"


def name(value: Any) -> str:
    return "" if isinstance(value, str) else "a string"


def names(value: Any) -> str:
    return "" if isinstance(value, list) and all(isinstance(v, str) for v in value) else "a list of strings"


def token_ids(value: Any) -> str:
    ok = _is_int(value) and 0 <= value <= MAX_COUNT or isinstance(value, list) and all(
        _is_int(v) and 0 <= v <= MAX_COUNT for v in value)
    return "" if ok else "a token id or a list of token ids"


def ints(value: Any) -> str:
    return "" if isinstance(value, list) and all(_is_int(v) for v in value) else "a list of integers"


def table(value: Any) -> str:
    return "" if isinstance(value, dict) else "an object of settings"


def or_null(check: Check) -> Check:
    def checked(value: Any) -> str:
        expected = check(value) if value is not None else ""
        return f"{expected} or null" if expected else ""
    return checked


# The rotary tables: transformers 5's rope_parameters and 4.x's rope_scaling hold the same keys.
ROPE_KEYS: dict[str, Check] = {
    "rope_type": name, "type": name, "rope_theta": positive, "factor": positive,
    "partial_rotary_factor": positive, "original_max_position_embeddings": count,
    "low_freq_factor": positive, "high_freq_factor": positive,
}

KEYS: dict[str, Check] = {
    "architectures": names, "model_type": name,
    "vocab_size": count, "tie_word_embeddings": flag,
    "bos_token_id": or_null(token_ids), "eos_token_id": or_null(token_ids), "pad_token_id": or_null(token_ids),
    "rope_scaling": or_null(table), "rope_parameters": or_null(table), "quantization_config": or_null(table),
    # GPT-2
    "n_positions": count, "n_embd": count, "n_layer": count, "n_head": count, "n_inner": or_null(count),
    "activation_function": name, "resid_pdrop": fraction, "embd_pdrop": fraction, "attn_pdrop": fraction,
    "layer_norm_epsilon": positive, "scale_attn_weights": flag, "scale_attn_by_inverse_layer_idx": flag,
    "add_cross_attention": flag,
    # Llama, Mistral, Qwen2
    "hidden_size": count, "num_attention_heads": count, "num_key_value_heads": or_null(count),
    "num_hidden_layers": count, "intermediate_size": count, "max_position_embeddings": count,
    "head_dim": or_null(count), "hidden_act": name, "rms_norm_eps": positive, "rope_theta": positive,
    "partial_rotary_factor": positive, "pretraining_tp": count, "attention_dropout": fraction,
    "attention_bias": flag, "mlp_bias": flag, "sliding_window": or_null(count), "use_sliding_window": flag,
    "layer_types": names,
    # SmolLM3
    "no_rope_layer_interval": count, "no_rope_layers": ints,
}


def _problem(origin: Path, key: str, value: Any, expected: str) -> CheckpointError:
    shown = value if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
    return CheckpointError(f"{origin}: {key}: expected {expected}, got {shown!r}")


def check_config_json(hf: dict[str, Any], origin: Path) -> None:
    """Raise CheckpointError naming `origin` and the first setting lm reads whose value has the wrong type or
    range (see KEYS); settings lm does not read pass unchecked."""
    for key, check in KEYS.items():
        if key in hf and (expected := check(hf[key])):
            raise _problem(origin, key, hf[key], expected)
    for outer in ("rope_scaling", "rope_parameters"):
        for key, value in (hf.get(outer) or {}).items():
            if key in ROPE_KEYS and (expected := ROPE_KEYS[key](value)):
                raise _problem(origin, f"{outer}.{key}", value, expected)
