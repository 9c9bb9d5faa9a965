"""Which transformers class reproduces a model config, its config.json, and its weights under its names.

- GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, GELU, biases, multi-head attention, pre-norm.
- Llama (`LlamaForCausalLM`): rotary positions, RMSNorm, SwiGLU, pre-norm; any number of key/value
  heads, with or without biases.

Any other combination is refused (`ExportError`) before anything is loaded or written, naming the keys
that differ. The functions are pure, so the parity tests feed the same tensors to transformers that the
export writes.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lm.errors import ExportError
from lm.models.config import ModelConfig
from lm.models.gpt import GPT

__all__ = ["TARGETS", "gpt2_state_dict", "hf_config", "hf_state_dict", "hf_target", "llama_state_dict", "unmet"]


@dataclass(frozen=True)
class Need:
    """One condition a target puts on the model config: `key` must be `wanted` (as one writes it on the CLI)."""

    key: str
    wanted: str
    ok: Callable[[ModelConfig], bool]


def _yaml(value: object) -> str:
    """A config value as it is written in YAML or on the command line (`false`, not `False`)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _equals(key: str, value: object) -> Need:
    return Need(key, _yaml(value), lambda cfg: getattr(cfg, key) == value)


@dataclass(frozen=True)
class Target:
    """A transformers causal LM class, and what our model config must be for its forward to equal ours."""

    name: str
    hf_class: str
    needs: tuple[Need, ...]


# Only options a transformers class reproduces exactly are accepted. Knobs the class has in its config
# (GPT-2's n_inner and tie_word_embeddings, Llama's biases and key/value heads) are passed through; options
# it has no knob for (a post-norm block, rmsnorm with learned positions) are refused rather than approximated.
TARGETS: dict[str, Target] = {
    "gpt2": Target("GPT-2", "GPT2LMHeadModel", (
        _equals("arch", "gpt"), _equals("pos", "learned"), _equals("norm", "layernorm"), _equals("mlp", "gelu"),
        _equals("norm_position", "pre"), _equals("bias", True), _equals("qk_norm", False),
        _equals("logit_softcap", 0.0),
        # GPT-2 attention has no grouped-query option: every query head has its own key/value head.
        Need("n_kv_head", "0 (one key/value head per query head)", lambda cfg: cfg.kv_heads == cfg.n_head),
    )),
    "llama": Target("Llama", "LlamaForCausalLM", (
        _equals("arch", "gpt"), _equals("pos", "rope"), _equals("norm", "rmsnorm"), _equals("mlp", "swiglu"),
        _equals("norm_position", "pre"), _equals("qk_norm", False), _equals("logit_softcap", 0.0),
    )),
}


def unmet(cfg: ModelConfig, target: Target) -> list[Need]:
    """The conditions of `target` that `cfg` does not meet, in the target's order."""
    return [need for need in target.needs if not need.ok(cfg)]


def hf_target(cfg: ModelConfig) -> str:
    """The key of TARGETS that reproduces `cfg` ("gpt2" or "llama"); ExportError when none does.

    The message lists the model keys in the way of an export and, per target, the values it needs.
    """
    if cfg.arch == "lstm":  # it ignores the position, norm and MLP keys, so listing them would mislead
        raise ExportError("cannot export to Hugging Face: model.arch=lstm is a recurrent model and the targets are "
                          "transformers (GPT2LMHeadModel and LlamaForCausalLM need model.arch=gpt)")
    misses = {name: unmet(cfg, target) for name, target in TARGETS.items()}
    for name, missed in misses.items():
        if not missed:
            return name
    keys = list(dict.fromkeys(need.key for missed in misses.values() for need in missed))
    have = ", ".join(f"model.{key}={_yaml(getattr(cfg, key))}" for key in keys)
    per_target = "; ".join(
        f"{TARGETS[name].hf_class} ({TARGETS[name].name}) needs "
        + ", ".join(f"model.{need.key}={need.wanted}" for need in missed)
        for name, missed in misses.items()
    )
    raise ExportError(f"cannot export to Hugging Face: no transformers model has this combination "
                      f"({have}): {per_target}")


def _require(cfg: ModelConfig, name: str) -> None:
    found = hf_target(cfg)
    if found != name:
        raise ExportError(f"this model maps to {TARGETS[found].hf_class}, not {TARGETS[name].hf_class}")


def hf_config(cfg: ModelConfig, eos_token_id: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json for the transformers class that reproduces `cfg`, as a JSON-ready dict.

    `eos_token_id` (our end-of-text id) also serves as the start token, as in GPT-2. The vocabulary is
    the tokenizer's (`cfg.vocab_size`): our embedding's padding rows are never produced by the
    tokenizer, so dropping them leaves the logits of every real id unchanged.
    """
    name = hf_target(cfg)
    common = {
        "architectures": [TARGETS[name].hf_class],
        "vocab_size": cfg.vocab_size,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if name == "gpt2":
        return {
            "model_type": "gpt2",
            **common,
            "n_positions": cfg.block_size,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": cfg.ff_dim,
            "activation_function": "gelu_new",  # the tanh approximation our MLP uses
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": cfg.norm_eps,
            "scale_attn_weights": True,
        }
    return {
        "model_type": "llama",
        **common,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ff_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters; 4.x reads the top-level rope_theta and ignores the dict.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        # Llama has dropout on attention weights only; ours also drops residuals and embeddings in training.
        "attention_dropout": cfg.dropout,
        "pretraining_tp": 1,
    }


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with its own storage: safetensors refuses tensors that share memory, such as
    the row slices of our fused q/k/v matrix."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def _head(model: GPT, prefix: str) -> dict[str, torch.Tensor]:
    """Embedding (and an untied output head) cut to the tokenizer's vocabulary."""
    cfg, V = model.cfg, model.cfg.vocab_size
    out = {f"{prefix}.weight": model.wte.weight[:V]}
    if not cfg.tie_embeddings:  # tied: transformers re-ties lm_head to the embedding on load
        out["lm_head.weight"] = model.lm_head.weight[:V]
    return out


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """`GPT2LMHeadModel` weights of a GPT-2-style `model`, each a standalone contiguous tensor.

    transformers' GPT-2 uses Conv1D layers, whose weights are stored (in, out): our nn.Linear weights
    (out, in) are transposed. The fused q/k/v rows [q; k; v] become c_attn's columns in the same order.
    """
    cfg = model.cfg
    _require(cfg, "gpt2")
    sd = model.state_dict()
    out = {**_head(model, "transformer.wte"), "transformer.wpe.weight": sd["wpe.weight"]}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln_1", "ln_1"), ("ln_2", "ln_2"), ("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                     ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            weight = sd[ours + a + ".weight"]
            out[theirs + b + ".weight"] = weight if a.startswith("ln") else weight.t()
            out[theirs + b + ".bias"] = sd[ours + a + ".bias"]
    out["transformer.ln_f.weight"] = sd["ln_f.weight"]
    out["transformer.ln_f.bias"] = sd["ln_f.bias"]
    return {k: _own(v) for k, v in out.items()}


def llama_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """`LlamaForCausalLM` weights of a Llama-style `model`, each a standalone contiguous tensor.

    Our fused q/k/v rows [q heads; k heads; v heads] split into q_proj, k_proj and v_proj, and the SwiGLU
    rows [gate; up] into gate_proj and up_proj. Both use rotary's half-split layout, so no row is permuted.
    """
    cfg = model.cfg
    _require(cfg, "llama")
    sd = model.state_dict()
    q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    params = ("weight", "bias") if cfg.bias else ("weight",)
    out = _head(model, "model.embed_tokens")
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for p in params:
            q, k, v = sd[f"{ours}attn.qkv.{p}"].split([q_rows, kv_rows, kv_rows])
            gate, up = sd[f"{ours}mlp.fc.{p}"].chunk(2)
            out.update({
                f"{theirs}self_attn.q_proj.{p}": q, f"{theirs}self_attn.k_proj.{p}": k,
                f"{theirs}self_attn.v_proj.{p}": v, f"{theirs}self_attn.o_proj.{p}": sd[f"{ours}attn.proj.{p}"],
                f"{theirs}mlp.gate_proj.{p}": gate, f"{theirs}mlp.up_proj.{p}": up,
                f"{theirs}mlp.down_proj.{p}": sd[f"{ours}mlp.proj.{p}"],
            })
        out[f"{theirs}input_layernorm.weight"] = sd[f"{ours}ln_1.weight"]
        out[f"{theirs}post_attention_layernorm.weight"] = sd[f"{ours}ln_2.weight"]
    out["model.norm.weight"] = sd["ln_f.weight"]
    return {k: _own(v) for k, v in out.items()}


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The transformers weights of `model`, for whichever target its config maps to."""
    return gpt2_state_dict(model) if hf_target(model.cfg) == "gpt2" else llama_state_dict(model)
