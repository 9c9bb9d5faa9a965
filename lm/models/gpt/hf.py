"""The decoder family and transformers: the classes whose forward is one of our GPT configurations exactly.

Export (`TARGETS`, in order of preference) and import (`READERS`):
- GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, tanh-GELU, biases, multi-head attention, pre-norm.
- Llama (`LlamaForCausalLM`): rotary positions, RMSNorm, SwiGLU, pre-norm; any number of key/value heads, with
  biases on every projection or on none.
- Qwen2 (`Qwen2ForCausalLM`): the Llama block with biases on the query/key/value projection alone
  (`model.qkv_bias`), every layer full attention.
- Qwen3 (`Qwen3ForCausalLM`): the Llama block with RMSNorm on each head's queries and keys (`model.qk_norm`)
  and its own head width (`model.d_head`), every layer full attention.
- SmolLM3 (`SmolLM3ForCausalLM`): the Llama block with every `model.nope_interval`-th layer left without rotary
  positions.
- OLMo 2 (`Olmo2ForCausalLM`): the Llama block with each sublayer's output normed before the residual add
  (`model.norm_position: output`) and RMSNorm over the whole query and key projections
  (`model.qk_norm_scope: all`).
- Mistral (`MistralForCausalLM`, import only: it exports as Llama): the Llama block without biases; its sliding
  window only when it cannot bind (no window, or one at least max_position_embeddings long), since our
  attention is full causal.

The mixtures of experts (Mixtral, OLMoE, Qwen3-MoE) are these blocks with experts: `lm.models.gpt.hf_moe`, which
reads their attention and norms with `rotary_fields` and names their dense parts with `llama_plan`.

Only options a class reproduces exactly are accepted. Knobs the class has in its config (GPT-2's n_inner and
tie_word_embeddings, Llama's biases and key/value heads) are passed through; options it has no knob for (a
post-norm block, rmsnorm with learned positions, a logit soft-cap) are refused rather than approximated, and
so is anything in a config.json that would change the forward (rope scaling other than linear and llama3, a
partial rotary factor, another activation, a binding sliding window, ...). Rotary scaling (`linear`, Llama 3's
`llama3`) travels in every rotary class's rope_parameters.

The embedding and an untied head cover the tokenizer's `vocab_size` rows: our padding rows (up to
`vocab_multiple`) have no counterpart, and dropping them leaves the logits of every real id unchanged. An
import keeps the checkpoint's own rows (`vocab_multiple` 1): padding them would add logits to every softmax.
"""

from typing import Any

import torch

from lm.hf.targets import ONE_KV_HEAD, HFReader, Need, Part, Plan, Target, equals
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.hf_rope import DEFAULT_THETAS, rope_fields

__all__ = ["LLAMA_BLOCK", "READERS", "TARGETS", "llama_plan", "rotary_config", "rotary_fields"]

LLAMA_BLOCK = (equals("pos", "rope"), equals("norm", "rmsnorm"), equals("mlp", "swiglu"), equals("logit_softcap", 0.0))
"""What every rotary class needs; the dense ones also model.n_experts=0, the mixtures of experts (`hf_moe`) more"""
_DENSE = (*LLAMA_BLOCK, equals("n_experts", 0))
_ROTARY = (*_DENSE, equals("norm_position", "pre"), equals("qk_norm", False), equals("nope_interval", 0))


def _common(cfg: GPTConfig, hf_class: str, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    """config.json keys every target shares. `eos_token_id` (our end-of-text id) also serves as the start token,
    as in GPT-2 (the export puts a tokenizer's own BOS in its place)."""
    return {
        "architectures": [hf_class],
        "vocab_size": cfg.vocab_size,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _gpt2_config(cfg: GPTConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        **_common(cfg, "GPT2LMHeadModel", eos_token_id, dtype),
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


def _rope_parameters(cfg: GPTConfig) -> dict[str, Any]:
    """transformers' rope_parameters for our rotary settings (its rope_type names the scaling)."""
    params: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
                              "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        params["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        params |= {"low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_context}
    return params


def rotary_config(cfg: GPTConfig, model_type: str, hf_class: str, eos_token_id: int | None,
                  dtype: torch.dtype) -> dict[str, Any]:
    return {
        "model_type": model_type,
        **_common(cfg, hf_class, eos_token_id, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ff_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "hidden_act": "silu",
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters; 4.x reads the top-level rope_theta and rope_scaling.
        "rope_parameters": _rope_parameters(cfg),
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling == "none" else _rope_parameters(cfg),
        # none: these classes drop attention weights only, lm's model.dropout residuals and embeddings too, so no
        # value reproduces its training (and lm refuses to import one it cannot)
        "attention_dropout": 0.0,
    }


def _llama_config(cfg: GPTConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return {**rotary_config(cfg, "llama", "LlamaForCausalLM", eos_token_id, dtype),
            "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "pretraining_tp": 1}


def _qwen2_config(cfg: GPTConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    # its biases on q/k/v are built in; no layer uses a sliding window
    return {**rotary_config(cfg, "qwen2", "Qwen2ForCausalLM", eos_token_id, dtype), "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": cfg.n_layer, "layer_types": ["full_attention"] * cfg.n_layer}


def _qwen3_config(cfg: GPTConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return {**rotary_config(cfg, "qwen3", "Qwen3ForCausalLM", eos_token_id, dtype), "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer,
            "layer_types": ["full_attention"] * cfg.n_layer}


def _smollm3_config(cfg: GPTConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return {**rotary_config(cfg, "smollm3", "SmolLM3ForCausalLM", eos_token_id, dtype),
            "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "use_sliding_window": False, "sliding_window": None,
            "no_rope_layer_interval": cfg.nope_interval,
            "pad_token_id": None,  # SmolLM3Config's default, 128004, is beyond a smaller vocabulary
            "no_rope_layers": [int(cfg.rotary_layer(i)) for i in range(cfg.n_layer)],
            "layer_types": ["full_attention"] * cfg.n_layer}


def _olmo2_config(cfg: GPTConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return {**rotary_config(cfg, "olmo2", "Olmo2ForCausalLM", eos_token_id, dtype), "attention_bias": False}


def _with_vocab(cfg: GPTConfig, embed: str, body: Plan) -> Plan:
    """The embedding, the body, and an untied head: the tokenizer's rows (a tied head is the embedding, so not
    listed)."""
    plan = {"wte.weight": (Part(embed, cfg.vocab_size),), **body}
    if not cfg.tie_embeddings:
        plan["lm_head.weight"] = (Part("lm_head.weight", cfg.vocab_size),)
    return plan


def gpt2_plan(cfg: GPTConfig) -> Plan:
    d = cfg.d_model
    plan: Plan = {"wpe.weight": (Part("transformer.wpe.weight", cfg.block_size),)}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b, rows in (("ln_1", "ln_1", d), ("ln_2", "ln_2", d), ("attn.proj", "attn.c_proj", d),
                           ("mlp.fc", "mlp.c_fc", cfg.ff_dim), ("mlp.proj", "mlp.c_proj", d)):
            plan[f"{ours}{a}.weight"] = (Part(f"{theirs}{b}.weight", rows, transposed=not a.startswith("ln")),)
            plan[f"{ours}{a}.bias"] = (Part(f"{theirs}{b}.bias", rows),)
        for n, proj in enumerate("qkv"):  # c_attn's columns are our q, k and v in that order
            plan[f"{ours}attn.{proj}.weight"] = (Part(f"{theirs}attn.c_attn.weight", d, True, n * d, 3 * d),)
            plan[f"{ours}attn.{proj}.bias"] = (Part(f"{theirs}attn.c_attn.bias", d, False, n * d, 3 * d),)
    plan["ln_f.weight"] = (Part("transformer.ln_f.weight", d),)
    plan["ln_f.bias"] = (Part("transformer.ln_f.bias", d),)
    return _with_vocab(cfg, "transformer.wte.weight", plan)


def llama_plan(cfg: GPTConfig) -> Plan:
    """Llama, Mistral, Qwen2, Qwen3 and OLMo 2 share these names; all use rotary's half-split layout, so no row is
    permuted. OLMo 2 norms each sublayer's output (our ln_1 and ln_2 in that place). The blocks that are
    mixtures of experts get no MLP here: each class names its experts (`hf_moe.moe_plan`)."""
    q_rows, kv_rows, d, ff = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.d_model, cfg.ff_dim
    plan: Plan = {}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn, mlp = f"{theirs}self_attn.", f"{theirs}mlp."
        for p in ("weight", "bias"):
            if p == "weight" or cfg.bias or cfg.qkv_bias:
                for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                    plan[f"{ours}attn.{proj}.{p}"] = (Part(f"{attn}{proj}_proj.{p}", rows),)
            if p == "weight" or cfg.bias:
                plan[f"{ours}attn.proj.{p}"] = (Part(f"{attn}o_proj.{p}", d),)
            if (p == "weight" or cfg.bias) and not cfg.moe_layer(i):  # a mixture's experts: `hf_moe`
                plan[f"{ours}mlp.gate.{p}"] = (Part(f"{mlp}gate_proj.{p}", ff),)
                plan[f"{ours}mlp.fc.{p}"] = (Part(f"{mlp}up_proj.{p}", ff),)
                plan[f"{ours}mlp.proj.{p}"] = (Part(f"{mlp}down_proj.{p}", d),)
        if cfg.norm_position == "output":
            plan[f"{ours}ln_1.weight"] = (Part(f"{theirs}post_attention_layernorm.weight", d),)
            plan[f"{ours}ln_2.weight"] = (Part(f"{theirs}post_feedforward_layernorm.weight", d),)
        else:
            plan[f"{ours}ln_1.weight"] = (Part(f"{theirs}input_layernorm.weight", d),)
            plan[f"{ours}ln_2.weight"] = (Part(f"{theirs}post_attention_layernorm.weight", d),)
        if cfg.qk_norm:
            whole = cfg.qk_norm_scope == "all"
            plan[f"{ours}attn.q_norm.weight"] = (Part(f"{attn}q_norm.weight", q_rows if whole else cfg.head_dim),)
            plan[f"{ours}attn.k_norm.weight"] = (Part(f"{attn}k_norm.weight", kv_rows if whole else cfg.head_dim),)
    plan["ln_f.weight"] = (Part("model.norm.weight", d),)
    return _with_vocab(cfg, "model.embed_tokens.weight", plan)


TARGETS = (
    Target("GPT-2", "GPT2LMHeadModel", (
        equals("pos", "learned"), equals("norm", "layernorm"), equals("mlp", "gelu"), equals("norm_position", "pre"),
        equals("bias", True), equals("qk_norm", False), equals("logit_softcap", 0.0), equals("n_experts", 0),
        # GPT-2 attention has no grouped-query option: every query head has its own key/value head.
        ONE_KV_HEAD,
        Need("d_head", "0 (GPT-2's heads are n_embd / n_head wide)",
             lambda cfg: cfg.head_dim * cfg.n_head == cfg.d_model),
    ), _gpt2_config, gpt2_plan),
    Target("Llama", "LlamaForCausalLM", (
        *_ROTARY,
        # Llama's attention_bias covers q, k, v and o alike
        Need("qkv_bias", "false (or model.bias=true)", lambda cfg: cfg.bias or not cfg.qkv_bias),
    ), _llama_config, llama_plan),
    Target("Qwen2", "Qwen2ForCausalLM", (*_ROTARY, equals("bias", False), equals("qkv_bias", True)),
           _qwen2_config, llama_plan),
    Target("Qwen3", "Qwen3ForCausalLM", (
        *_DENSE, equals("norm_position", "pre"), equals("qk_norm", True), equals("qk_norm_scope", "head"),
        equals("bias", False), equals("qkv_bias", False), equals("nope_interval", 0),
    ), _qwen3_config, llama_plan),
    Target("OLMo 2", "Olmo2ForCausalLM", (
        *_DENSE, equals("norm_position", "output"), equals("qk_norm", True), equals("qk_norm_scope", "all"),
        equals("bias", False), equals("qkv_bias", False), equals("nope_interval", 0),
    ), _olmo2_config, llama_plan),
    Target("SmolLM3", "SmolLM3ForCausalLM", (
        *_DENSE, equals("norm_position", "pre"), equals("qk_norm", False),
        Need("nope_interval", "above 0 (layers without rotary positions)", lambda cfg: cfg.nope_interval > 0),
        Need("qkv_bias", "false (or model.bias=true)", lambda cfg: cfg.bias or not cfg.qkv_bias),
    ), _smollm3_config, llama_plan),
)


# ---- import ------------------------------------------------------------------------------------

def _aliased(hf: dict, key: str, alias: str, default: Any, problems: list[str]) -> Any:
    """A setting a transformers class also takes under another name (its config's attribute_map: GPT-2's
    hidden_size is n_embd). transformers sets the alias after the key, so the alias wins; the two differing is
    a problem, since a hand edit of one leaves the other stale."""
    if key in hf and alias in hf and hf[key] != hf[alias]:
        problems.append(f"{key}={hf[key]} with {alias}={hf[alias]} (one setting under two names; keep one)")
    return hf.get(alias, hf.get(key, default))


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
    d = _aliased(hf, "n_embd", "hidden_size", 768, problems)
    return dict(vocab_size=hf.get("vocab_size", 50257),
                block_size=_aliased(hf, "n_positions", "max_position_embeddings", 1024, problems),
                n_layer=_aliased(hf, "n_layer", "num_hidden_layers", 12, problems),
                n_head=_aliased(hf, "n_head", "num_attention_heads", 12, problems), d_model=d,
                d_ff=hf.get("n_inner") or 4 * d, dropout=drops["resid_pdrop"], bias=True, pos="learned",
                norm="layernorm", mlp="gelu", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                tie_embeddings=hf.get("tie_word_embeddings", True), vocab_multiple=1)


CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "intermediate_size": 14336,
                "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "intermediate_size": 22016,
              "vocab_size": 151936},
    "qwen3": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "intermediate_size": 22016,
              "vocab_size": 151936},
    "olmo2": {"vocab_size": 50304, "rms_norm_eps": 1e-5},
    "smollm3": {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4,
                "max_position_embeddings": 32768, "num_hidden_layers": 36, "vocab_size": 128256,
                "tie_word_embeddings": True},
    "mixtral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "intermediate_size": 14336,
                "rms_norm_eps": 1e-5},
    "qwen3_moe": {"hidden_size": 2048, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "num_hidden_layers": 24, "intermediate_size": 6144, "vocab_size": 151936},
    "olmoe": {"hidden_size": 2048, "num_attention_heads": 16, "max_position_embeddings": 4096,
              "num_hidden_layers": 16, "intermediate_size": 2048, "vocab_size": 50304, "rms_norm_eps": 1e-5},
}
"""transformers' defaults of the Llama-shaped classes where they are not LlamaConfig's (which `rotary_fields`
falls back on): what a config.json that leaves the key out means. A missing num_key_value_heads is otherwise
num_attention_heads, as LlamaConfig makes it."""


def rotary_fields(hf: dict, model_type: str, problems: list[str]) -> dict[str, Any]:
    """The Llama-shaped classes, mixtures of experts included (their attention and norms: `hf_moe` adds the
    experts): one block, with biases, windows, norms and head widths as the class has them; a key the file leaves
    out has the class's default."""
    hf = {**CLASS_DEFAULTS.get(model_type, {}), **hf}
    d, n_head = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (lm's SwiGLU gates with silu)")
    # Qwen3Config's own default head width is 128, the others' hidden_size / num_attention_heads
    head_dim = hf.get("head_dim") or (128 if model_type == "qwen3" else d // n_head)
    d_head = 0 if n_head * head_dim == d else head_dim
    if hf.get("pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={hf['pretraining_tp']} (lm needs 1)")
    if hf.get("attention_dropout", 0.0):
        problems.append(f"attention_dropout={hf['attention_dropout']} (lm's model.dropout also drops residuals; "
                        "import with 0)")
    bias, qkv_bias = False, model_type == "qwen2"
    nope: dict[str, Any] = {}
    if model_type == "smollm3":
        nope = {"nope_interval": _nope_interval(hf, problems)}
    if model_type in ("qwen3", "olmo2", "qwen3_moe", "olmoe") and hf.get("attention_bias", False):
        problems.append("attention_bias=true (lm's biases are on every projection or on q, k and v alone)")
    if model_type in ("llama", "smollm3"):
        attn, mlp = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        if attn != mlp:
            problems.append(f"attention_bias={attn} with mlp_bias={mlp} (lm's model.bias puts biases on every "
                            "projection or on none)")
        bias = bool(attn)
    block = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window")
    if model_type in ("mistral", "mixtral") and window is not None and window < block:
        problems.append(f"sliding_window={window} below max_position_embeddings={block} (lm attends to every "
                        "earlier position)")
    if model_type in ("qwen2", "qwen3", "smollm3", "qwen3_moe"):
        if hf.get("use_sliding_window", False):
            problems.append("use_sliding_window=true (lm attends to every earlier position)")
        if any(kind != "full_attention" for kind in hf.get("layer_types") or []):
            problems.append(f"layer_types={hf['layer_types']} (lm has full attention in every layer)")
    norms = {"qwen3": dict(qk_norm=True), "olmo2": dict(norm_position="output", qk_norm=True, qk_norm_scope="all"),
             "qwen3_moe": dict(qk_norm=True), "olmoe": dict(qk_norm=True, qk_norm_scope="all")}
    rope = rope_fields(hf, problems, DEFAULT_THETAS.get(model_type, 10000.0))
    return dict(vocab_size=hf.get("vocab_size", 32000), block_size=block, n_layer=hf.get("num_hidden_layers", 32),
                n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head, d_model=d, d_head=d_head,
                d_ff=hf.get("intermediate_size", 11008), dropout=0.0, bias=bias, qkv_bias=qkv_bias,
                pos="rope", **rope, norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
                mlp="swiglu", **norms.get(model_type, {}), **nope, tie_embeddings=hf.get("tie_word_embeddings", False),
                vocab_multiple=1)


def _nope_interval(hf: dict, problems: list[str]) -> int:
    """SmolLM3's layers without rotary positions as our model.nope_interval: every interval-th layer, as its
    config builds no_rope_layers by default; any other pattern is a problem."""
    n_layer, interval = hf.get("num_hidden_layers", 32), hf.get("no_rope_layer_interval", 4)
    layers = hf.get("no_rope_layers")
    pattern = [int((i + 1) % interval != 0) for i in range(n_layer)] if isinstance(interval, int) and interval > 0 \
        else None
    if layers is None and pattern is not None:
        return interval
    if layers is not None and all(layers):
        return 0
    if layers is not None and pattern is not None and list(layers) == pattern:
        return interval
    problems.append(f"no_rope_layers={layers} with no_rope_layer_interval={interval} (lm leaves rotary positions out "
                    "of every n-th layer: model.nope_interval)")
    return 0


def _gpt2_name(name: str) -> str:
    """Older GPT-2 files name the body's tensors without the `transformer.` prefix that save_pretrained writes."""
    return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name


def _rotary_reader(model_type: str) -> HFReader:
    return HFReader(model_type, lambda hf, problems: rotary_fields(hf, model_type, problems), llama_plan)


READERS = {
    "GPT2LMHeadModel": HFReader("gpt2", _gpt2_fields, gpt2_plan, _gpt2_name),
    "LlamaForCausalLM": _rotary_reader("llama"),
    "MistralForCausalLM": _rotary_reader("mistral"),
    "Qwen2ForCausalLM": _rotary_reader("qwen2"),
    "Qwen3ForCausalLM": _rotary_reader("qwen3"),
    "Olmo2ForCausalLM": _rotary_reader("olmo2"),
    "SmolLM3ForCausalLM": _rotary_reader("smollm3"),
}
