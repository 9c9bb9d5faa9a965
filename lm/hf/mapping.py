"""Which transformers class reproduces a model config, its config.json, and its weights under its names.

- GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, GELU, biases, multi-head attention, pre-norm.
- Llama (`LlamaForCausalLM`): rotary positions, RMSNorm, SwiGLU, pre-norm; any number of key/value
  heads, with or without biases.
- Qwen2 (`Qwen2ForCausalLM`): the Llama block with biases on the query/key/value projection alone
  (`model.qkv_bias`).
- BERT (`BertForMaskedLM`), for `model.arch: encoder` with the masked-LM head: learned positions, LayerNorm
  with biases, post-norm blocks, GELU (tanh approximation, in the blocks and in the head's transform alike),
  multi-head attention, output layer tied to the embedding.

Any other combination is refused (`ExportError`) before anything is loaded or written, naming the keys
that differ. Which of our parameters is which transformers tensor is one table, `weight_plan`, read both
ways: by the export and by the import (`lm.hf.weights`). The functions are pure, so the parity tests feed
the same tensors to transformers that the export writes.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lm.errors import ExportError
from lm.models.config import ModelConfig
from lm.models.encoder import Encoder
from lm.models.gpt import GPT

__all__ = ["ENCODER_TARGETS", "TARGETS", "Part", "Plan", "hf_config", "hf_state_dict", "hf_target", "row_spans",
           "split_rows", "unmet", "weight_plan"]


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
    """A transformers model class, and what our model config must be for its forward to equal ours."""

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
        # Llama's attention_bias covers q, k, v and o alike
        Need("qkv_bias", "false (or model.bias=true)", lambda cfg: cfg.bias or not cfg.qkv_bias),
    )),
    "qwen2": Target("Qwen2", "Qwen2ForCausalLM", (
        _equals("arch", "gpt"), _equals("pos", "rope"), _equals("norm", "rmsnorm"), _equals("mlp", "swiglu"),
        _equals("norm_position", "pre"), _equals("qk_norm", False), _equals("logit_softcap", 0.0),
        _equals("bias", False), _equals("qkv_bias", True),
    )),
    "bert": Target("BERT", "BertForMaskedLM", (
        # BertForSequenceClassification puts a tanh pooler layer between [CLS] and its classifier, which our
        # classify and regress heads do not have: only the masked-LM head has a transformers twin.
        _equals("arch", "encoder"), _equals("head", "mlm"), _equals("pos", "learned"), _equals("norm", "layernorm"),
        _equals("bias", True), _equals("norm_position", "post"), _equals("mlp", "gelu"),
        Need("n_kv_head", "0 (one key/value head per query head)", lambda cfg: cfg.kv_heads == cfg.n_head),
        # BertForMaskedLM's output layer is the word embedding plus a bias of its own. Untied, transformers 5
        # unties that bias as well (decoder.bias apart from cls.predictions.bias), 4.x keeps one: refused.
        _equals("tie_embeddings", True),
    )),
}
ENCODER_TARGETS = ("bert",)
"""The targets for `model.arch: encoder`; every other target is a causal LM for `model.arch: gpt`."""


def unmet(cfg: ModelConfig, target: Target) -> list[Need]:
    """The conditions of `target` that `cfg` does not meet, in the target's order."""
    return [need for need in target.needs if not need.ok(cfg)]


def hf_target(cfg: ModelConfig) -> str:
    """The key of TARGETS that reproduces `cfg` ("gpt2", "llama", "qwen2" or "bert"); ExportError when none does.

    The message lists the model keys in the way of an export and, per target, the values it needs. An
    encoder is measured against the encoder targets alone and any other model against the causal LMs:
    what BERT needs of a decoder (or GPT-2 of an encoder) would only bury the keys that matter.
    """
    if cfg.arch == "lstm":  # it ignores the position, norm and MLP keys, so listing them would mislead
        raise ExportError("cannot export to Hugging Face: model.arch=lstm is a recurrent model and the targets are "
                          "transformers (GPT2LMHeadModel, LlamaForCausalLM and Qwen2ForCausalLM need model.arch=gpt)")
    encoder = cfg.arch == "encoder"
    misses = {name: unmet(cfg, target) for name, target in TARGETS.items() if (name in ENCODER_TARGETS) == encoder}
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


def hf_config(cfg: ModelConfig, eos_token_id: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json for the transformers class that reproduces `cfg`, as a JSON-ready dict.

    `eos_token_id` (our end-of-text id) also serves as the start token, as in GPT-2. The vocabulary is
    the tokenizer's (`cfg.vocab_size`): our embedding's padding rows are never produced by the
    tokenizer, so dropping them leaves the logits of every real id unchanged.
    """
    name = hf_target(cfg)
    if name == "bert":
        return _bert_config(cfg, dtype)
    common: dict[str, Any] = {
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
    rotary = {
        "model_type": name,
        **common,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ff_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters; 4.x reads the top-level rope_theta and ignores the dict.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        # Llama has dropout on attention weights only; ours also drops residuals and embeddings in training.
        "attention_dropout": cfg.dropout,
    }
    if name == "qwen2":  # its biases on q/k/v are built in; no layer uses a sliding window
        return {**rotary, "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer,
                "layer_types": ["full_attention"] * cfg.n_layer}
    return {**rotary, "head_dim": cfg.head_dim, "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "pretraining_tp": 1}


def _bert_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """BertForMaskedLM's config.json. Its vocabulary is our whole embedding, padding rows included: [MASK],
    [CLS] and padding come after the tokenizer's ids, and keeping every row makes its logits ours exactly.
    Its token-type table has one row, written as zeros (`hf_state_dict`), so it adds nothing."""
    return {
        "model_type": "bert",
        "architectures": [TARGETS["bert"].hf_class],
        "vocab_size": cfg.padded_vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "intermediate_size": cfg.ff_dim,
        # our GELU is the tanh approximation, in the blocks and in the MLM head's transform, which BERT
        # also runs with hidden_act
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
        "max_position_embeddings": cfg.block_size,
        "position_embedding_type": "absolute",  # transformers 4.x reads it; 5 has absolute positions only
        "type_vocab_size": 1,
        "layer_norm_eps": cfg.norm_eps,
        "pad_token_id": cfg.pad_id,
        "tie_word_embeddings": True,
        "is_decoder": False,
        "initializer_range": 0.02,
        "dtype": str(dtype).removeprefix("torch."),
    }


@dataclass(frozen=True)
class Part:
    """One transformers tensor that fills `rows` consecutive rows (dim 0) of one of our parameters."""

    name: str
    rows: int
    transposed: bool = False
    """Stored (in, out), as GPT-2's Conv1D layers are: our rows are its columns."""


Plan = dict[str, tuple[Part, ...]]
"""Our parameter name -> the transformers tensors that, stacked along dim 0 in order, are its rows."""


def _gpt2_plan(cfg: ModelConfig) -> Plan:
    d = cfg.d_model
    plan: Plan = {"wpe.weight": (Part("transformer.wpe.weight", cfg.block_size),)}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b, rows in (("ln_1", "ln_1", d), ("ln_2", "ln_2", d), ("attn.qkv", "attn.c_attn", 3 * d),
                           ("attn.proj", "attn.c_proj", d), ("mlp.fc", "mlp.c_fc", cfg.ff_dim),
                           ("mlp.proj", "mlp.c_proj", d)):
            # the fused q/k/v rows [q; k; v] are c_attn's columns in the same order
            plan[f"{ours}{a}.weight"] = (Part(f"{theirs}{b}.weight", rows, transposed=not a.startswith("ln")),)
            plan[f"{ours}{a}.bias"] = (Part(f"{theirs}{b}.bias", rows),)
    plan["ln_f.weight"] = (Part("transformer.ln_f.weight", d),)
    plan["ln_f.bias"] = (Part("transformer.ln_f.bias", d),)
    return plan


def _llama_plan(cfg: ModelConfig) -> Plan:
    """Llama and Qwen2 (and, on import, Mistral) share these names. Our fused q/k/v rows [q heads; k heads;
    v heads] are q_proj, k_proj, v_proj, and the SwiGLU rows [gate; up] gate_proj, up_proj; both use rotary's
    half-split layout, so no row is permuted."""
    q_rows, kv_rows, d, ff = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.d_model, cfg.ff_dim
    plan: Plan = {}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn, mlp = f"{theirs}self_attn.", f"{theirs}mlp."
        for p in ("weight", "bias"):
            if p == "weight" or cfg.bias or cfg.qkv_bias:
                plan[f"{ours}attn.qkv.{p}"] = (Part(f"{attn}q_proj.{p}", q_rows), Part(f"{attn}k_proj.{p}", kv_rows),
                                               Part(f"{attn}v_proj.{p}", kv_rows))
            if p == "weight" or cfg.bias:
                plan[f"{ours}attn.proj.{p}"] = (Part(f"{attn}o_proj.{p}", d),)
                plan[f"{ours}mlp.fc.{p}"] = (Part(f"{mlp}gate_proj.{p}", ff), Part(f"{mlp}up_proj.{p}", ff))
                plan[f"{ours}mlp.proj.{p}"] = (Part(f"{mlp}down_proj.{p}", d),)
        plan[f"{ours}ln_1.weight"] = (Part(f"{theirs}input_layernorm.weight", d),)
        plan[f"{ours}ln_2.weight"] = (Part(f"{theirs}post_attention_layernorm.weight", d),)
    plan["ln_f.weight"] = (Part("model.norm.weight", d),)
    return plan


def _bert_plan(cfg: ModelConfig) -> Plan:
    """BertForMaskedLM's names. Our fused q/k/v rows [q; k; v] are query, key and value; each post-norm block's
    ln_1 and ln_2 are the LayerNorms after its attention and its feed-forward. The embedding covers every
    row (see `_bert_config`); the tied output layer is the embedding, and its bias is cls.predictions.bias."""
    d, ff = cfg.d_model, cfg.ff_dim
    plan: Plan = {"wte.weight": (Part("bert.embeddings.word_embeddings.weight", cfg.padded_vocab_size),),
                  "wpe.weight": (Part("bert.embeddings.position_embeddings.weight", cfg.block_size),),
                  "lm_head.bias": (Part("cls.predictions.bias", cfg.padded_vocab_size),)}
    layers = {"emb_norm": ("bert.embeddings.LayerNorm", d), "mlm_dense": ("cls.predictions.transform.dense", d),
              "mlm_norm": ("cls.predictions.transform.LayerNorm", d)}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"bert.encoder.layer.{i}."
        attn = f"{theirs}attention.self."
        for p in ("weight", "bias"):
            plan[f"{ours}attn.qkv.{p}"] = (Part(f"{attn}query.{p}", d), Part(f"{attn}key.{p}", d),
                                           Part(f"{attn}value.{p}", d))
        layers.update({f"{ours}attn.proj": (f"{theirs}attention.output.dense", d),
                       f"{ours}ln_1": (f"{theirs}attention.output.LayerNorm", d),
                       f"{ours}mlp.fc": (f"{theirs}intermediate.dense", ff),
                       f"{ours}mlp.proj": (f"{theirs}output.dense", d),
                       f"{ours}ln_2": (f"{theirs}output.LayerNorm", d)})
    for ours, (theirs, rows) in layers.items():
        for p in ("weight", "bias"):
            plan[f"{ours}.{p}"] = (Part(f"{theirs}.{p}", rows),)
    return plan


def weight_plan(cfg: ModelConfig, family: str) -> Plan:
    """Where each of our parameters lives in a transformers checkpoint of `family` (a key of TARGETS, or
    "mistral"). For the causal LMs, the embedding and an untied head cover the tokenizer's `vocab_size` rows:
    our padding rows (up to `vocab_multiple`) have no counterpart. A tied head is the embedding, so it is not
    listed."""
    if family == "bert":
        return _bert_plan(cfg)
    embed = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
    plan = {"wte.weight": (Part(embed, cfg.vocab_size),)}
    plan.update(_gpt2_plan(cfg) if family == "gpt2" else _llama_plan(cfg))
    if not cfg.tie_embeddings:
        plan["lm_head.weight"] = (Part("lm_head.weight", cfg.vocab_size),)
    return plan


def split_rows(tensor: torch.Tensor, parts: tuple[Part, ...]) -> dict[str, torch.Tensor]:
    """Our tensor cut into its transformers tensors: each part's rows, transposed back where it is stored so."""
    out, start = {}, 0
    for part in parts:
        piece = tensor[start:start + part.rows]
        out[part.name] = piece.t() if part.transposed else piece
        start += part.rows
    return out


def row_spans(parts: tuple[Part, ...], start: int, stop: int) -> list[tuple[Part, int, int]]:
    """The pieces of our rows [start, stop): (part, first row, end row) in the part's own rows, in order.

    An FSDP rank holds a contiguous block of each parameter's rows; this says which rows of which stored
    tensors hold that block, so the rank reads those alone.
    """
    spans, offset = [], 0
    for part in parts:
        lo, hi = max(start, offset), min(stop, offset + part.rows)
        if lo < hi:
            spans.append((part, lo - offset, hi - offset))
        offset += part.rows
    return spans


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with its own storage: safetensors refuses tensors that share memory, such as
    the row slices of our fused q/k/v matrix."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def hf_state_dict(model: GPT | Encoder) -> dict[str, torch.Tensor]:
    """The transformers weights of `model`, under the names of whichever target its config maps to, each a
    standalone contiguous tensor. BERT's token-type table, which we do not have, is one row of zeros."""
    sd = model.state_dict()
    family = hf_target(model.cfg)
    out: dict[str, torch.Tensor] = {}
    for ours, parts in weight_plan(model.cfg, family).items():
        out.update(split_rows(sd[ours], parts))
    if family == "bert":
        out["bert.embeddings.token_type_embeddings.weight"] = sd["wte.weight"].new_zeros(1, model.cfg.d_model)
    return {k: _own(v) for k, v in out.items()}
