"""A local transformers checkpoint directory as our model config, or a refusal naming every field in the way.

Supported classes, each because its forward is one of our GPT configurations exactly:
- `GPT2LMHeadModel`: learned positions, LayerNorm, tanh-GELU, biases (the GPT-2 defaults).
- `LlamaForCausalLM`: the Llama block (rotary, RMSNorm, SwiGLU), grouped-query attention, biases on every
  projection or on none.
- `MistralForCausalLM`: the Llama block without biases; its sliding window only when it cannot bind (no
  window, or one at least max_position_embeddings long), since our attention is full causal.
- `Qwen2ForCausalLM`: the Llama block with biases on q/k/v alone (`model.qkv_bias`), every layer full
  attention.

Everything that would change the forward and that we do not reproduce (rope scaling, a partial rotary
factor, a head_dim other than hidden_size / num_attention_heads, another activation, a binding sliding
window, quantized weights, ...) is refused here, from config.json alone, before any weight is read.
Reading needs neither transformers nor torch: only JSON.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm.errors import CheckpointError

__all__ = ["FAMILIES", "HFModel", "is_hf_checkpoint", "read_hf_model"]

CONFIG_NAME = "config.json"
FAMILIES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2"}
"""Supported transformers classes -> the family whose weight names they use (`lm.hf.mapping.weight_plan`); each
family is also its classes' config.json `model_type`."""


@dataclass(frozen=True)
class HFModel:
    """What a transformers checkpoint directory holds, in our terms."""

    directory: Path
    hf_class: str
    family: str
    fields: dict[str, Any]
    """`model.*` keys of our config that reproduce it (ModelConfig keyword arguments)."""


def is_hf_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a transformers checkpoint directory (it holds a config.json)."""
    return (Path(path) / CONFIG_NAME).is_file()


def _family(hf: dict, origin: Path) -> tuple[str, str]:
    archs = hf.get("architectures") or []
    supported = ", ".join(FAMILIES)
    if archs:
        if len(archs) != 1 or archs[0] not in FAMILIES:
            raise CheckpointError(f"{origin}: architectures={archs} is not one lm imports; supported: {supported}")
        return archs[0], FAMILIES[archs[0]]
    model_type = hf.get("model_type")
    by_type = {family: cls for cls, family in FAMILIES.items()}
    if model_type not in by_type:
        raise CheckpointError(f"{origin}: model_type={model_type!r} (and no architectures) is not one lm imports; "
                              f"supported: {supported}")
    return by_type[model_type], model_type


def _rope_theta(hf: dict, problems: list[str]) -> float:
    """The rotary base, from transformers 5's rope_parameters or 4.x's rope_theta/rope_scaling; anything
    but plain rotary positions is a problem."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    if params.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.rope_type={params['rope_type']!r} (lm has unscaled rotary positions)")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) != "default":
        problems.append(f"rope_scaling={scaling} (lm has unscaled rotary positions)")
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        problems.append(f"partial_rotary_factor={factor} (lm rotates every channel of a head)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _gpt2_fields(hf: dict, problems: list[str]) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={act!r} (lm's GELU is the tanh approximation: gelu_new)")
    for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        if hf.get(key, wanted) != wanted:
            problems.append(f"{key}={hf[key]} (lm needs {wanted})")
    drops = {key: hf.get(key, 0.1) for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(drops.values())) > 1:
        problems.append(f"{', '.join(f'{k}={v}' for k, v in drops.items())} (lm has one model.dropout for all three)")
    d = hf.get("n_embd", 768)
    return dict(vocab_size=hf.get("vocab_size", 50257), block_size=hf.get("n_positions", 1024),
                n_layer=hf.get("n_layer", 12), n_head=hf.get("n_head", 12), d_model=d,
                d_ff=hf.get("n_inner") or 4 * d, dropout=drops["resid_pdrop"], bias=True, pos="learned",
                norm="layernorm", mlp="gelu",
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), tie_embeddings=hf.get("tie_word_embeddings", True))


def _rotary_fields(hf: dict, family: str, problems: list[str]) -> dict[str, Any]:
    """The Llama-shaped families: one block, with biases and windows as the family has them."""
    d, n_head = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (lm's SwiGLU gates with silu)")
    if hf.get("head_dim") is not None and (d % n_head or hf["head_dim"] != d // n_head):
        problems.append(f"head_dim={hf['head_dim']} (lm's heads are hidden_size / num_attention_heads = "
                        f"{d}/{n_head} wide)")
    if hf.get("pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={hf['pretraining_tp']} (lm needs 1)")
    if hf.get("attention_dropout", 0.0):
        problems.append(f"attention_dropout={hf['attention_dropout']} (lm's model.dropout also drops residuals; "
                        "import with 0)")
    bias, qkv_bias = False, family == "qwen2"
    if family == "llama":
        attn, mlp = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        if attn != mlp:
            problems.append(f"attention_bias={attn} with mlp_bias={mlp} (lm's model.bias puts biases on every "
                            "projection or on none)")
        bias = bool(attn)
    block = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window")
    if family == "mistral" and window is not None and window < block:
        problems.append(f"sliding_window={window} below max_position_embeddings={block} (lm attends to every "
                        "earlier position)")
    if family == "qwen2":
        if hf.get("use_sliding_window", False):
            problems.append("use_sliding_window=true (lm attends to every earlier position)")
        if any(kind != "full_attention" for kind in hf.get("layer_types") or []):
            problems.append(f"layer_types={hf['layer_types']} (lm has full attention in every layer)")
    return dict(vocab_size=hf.get("vocab_size", 32000), block_size=block, n_layer=hf.get("num_hidden_layers", 32),
                n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head, d_model=d,
                d_ff=hf.get("intermediate_size", 11008), dropout=0.0, bias=bias, qkv_bias=qkv_bias,
                pos="rope", rope_theta=_rope_theta(hf, problems), norm="rmsnorm",
                norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu",
                tie_embeddings=hf.get("tie_word_embeddings", False))


def read_hf_model(directory: str | Path) -> HFModel:
    """Our model config for the transformers checkpoint in `directory`, from its config.json alone.

    Raises CheckpointError naming the file and every field lm cannot reproduce exactly, so nothing is
    read or written for a checkpoint that would not give its own logits.
    """
    directory = Path(directory)
    origin = directory / CONFIG_NAME
    try:
        hf = json.loads(origin.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: not a Hugging Face checkpoint directory (no {CONFIG_NAME})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{origin}: not readable JSON: {err}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{origin}: expected a JSON object of settings")
    hf_class, family = _family(hf, origin)
    problems: list[str] = []
    if hf.get("quantization_config"):
        problems.append("quantization_config (lm imports full-precision weights)")
    fields = _gpt2_fields(hf, problems) if family == "gpt2" else _rotary_fields(hf, family, problems)
    if problems:
        raise CheckpointError(f"{origin}: {hf_class} with settings lm cannot reproduce exactly: "
                              + "; ".join(problems))
    # the checkpoint's own embedding rows: padding them would add logits to every softmax
    return HFModel(directory, hf_class, family, {"arch": "gpt", **fields, "vocab_multiple": 1})
