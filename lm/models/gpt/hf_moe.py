"""The decoder's mixtures of experts and transformers: the classes whose forward is one of our GPT configurations
with model.n_experts exactly. Their attention and norms are the dense classes' (`lm.models.gpt.hf`); this file adds
the experts.

- Mixtral (`MixtralForCausalLM`): Mistral's block with every MLP a mixture of experts; the router takes the
  softmax over all experts, its top k, and renormalises their weights to sum to 1 (`model.router_renorm: true`).
- OLMoE (`OlmoeForCausalLM`): the pre-norm Llama block with RMSNorm over the whole query and key projections
  (`model.qk_norm_scope: all`), every MLP a mixture; the top-k weights are renormalised only with norm_topk_prob
  (false in OLMoE-1B-7B: `model.router_renorm: false`).
- Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's block (per-head QK-norm); the layers mlp_only_layers names, and those
  decoder_sparse_step skips, keep a dense MLP intermediate_size wide (`model.d_ff`), the others are mixtures of
  experts moe_intermediate_size wide (`model.expert_d_ff`); renormalised with norm_topk_prob. Our blocks are
  mixtures every `model.moe_every`-th after the first `model.moe_first_dense`, so a layer pattern those two keys
  cannot express is refused.

None of the three has shared experts, a sigmoid router or a balancing bias (model.router_bias_rate: DeepSeek-V3's
e_score_correction_bias, which changes which experts a token goes to): a model whose biases are all 0 exports
exactly, one whose biases have moved is refused by name. They store each expert's three matrices expert by
expert, as Linear weights (out, in): gate (Mixtral's w1, gate_proj), up (w3, up_proj) and down (w2, down_proj) are
our stacked w_gate, w_in and w_out, one expert a row (`Part.slab`), transposed; the router's gate is ours.

The balance loss: transformers' load_balancing_loss_func counts every one of a token's k choices, so for one layer
its value is k times our moe_balance (both E * sum_e f_e p_e; its shares f_e sum to k, ours to 1), and
model.aux_loss_coef is k times router_aux_loss_coef, the same weight on the same gradient. Over several layers
transformers multiplies shares and probabilities pooled over all layers, we average each layer's product, so the
two terms differ there. None of the three has a router z-loss; model.router_z_loss_coef travels as a
router_z_loss_coef entry of config.json (which transformers keeps as an attribute), written when it is not 0.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lm.hf.targets import HFReader, Need, Part, Plan, Target, equals
from lm.models.gpt.config import GPTConfig, moe_block
from lm.models.gpt.hf import LLAMA_BLOCK, llama_plan, rotary_config, rotary_fields

__all__ = ["READERS", "TARGETS", "moe_keys", "moe_plan"]


@dataclass(frozen=True)
class ExpertNames:
    """Where a class keeps a mixture-of-experts block's tensors: model.layers.<i>.<block>.gate.weight (the router)
    and model.layers.<i>.<block>.experts.<e>.<gate|up|down>.weight."""

    block: str
    gate: str
    up: str
    down: str


MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
QWEN_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
"""OLMoE's and Qwen3-MoE's"""


def moe_plan(names: ExpertNames) -> Callable[[GPTConfig], Plan]:
    """The plan of a class that names its experts `names`: the Llama names (`llama_plan`), and in each block that
    is a mixture of experts the router and every expert's three matrices."""

    def plan(cfg: GPTConfig) -> Plan:
        out = llama_plan(cfg)
        for i in range(cfg.n_layer):
            if not cfg.moe_layer(i):
                continue
            ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.{names.block}."
            out[f"{ours}router.gate.weight"] = (Part(f"{theirs}gate.weight", cfg.n_experts),)
            for param, proj in (("w_gate", names.gate), ("w_in", names.up), ("w_out", names.down)):
                out[f"{ours}experts.{param}"] = tuple(Part(f"{theirs}experts.{e}.{proj}.weight", 1, transposed=True,
                                                           slab=True) for e in range(cfg.n_experts))
        return out

    return plan


# ---- export -----------------------------------------------------------------------------------

_EXPERTS = (Need("n_experts", "above 0 (a mixture of experts)", lambda cfg: cfg.n_experts > 0),
            equals("n_shared_experts", 0), equals("router", "softmax"))
_EVERY_BLOCK = (equals("moe_first_dense", 0), equals("moe_every", 1))
"""Mixtral and OLMoE have a mixture of experts in every layer"""
_NO_BIAS = (equals("bias", False), equals("qkv_bias", False), equals("nope_interval", 0))


def _experts_config(cfg: GPTConfig) -> dict[str, Any]:
    """config.json's router keys every class shares (see the module docstring for the coefficients)."""
    k = cfg.experts_per_token
    config = {"num_experts_per_tok": k, "router_aux_loss_coef": cfg.aux_loss_coef / k,
              "output_router_logits": False}
    if cfg.router_z_loss_coef:
        config["router_z_loss_coef"] = cfg.router_z_loss_coef
    return config


def _mixtral_config(cfg: GPTConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return {**rotary_config(cfg, "mixtral", "MixtralForCausalLM", eos_token_id, dtype), **_experts_config(cfg),
            "intermediate_size": cfg.expert_ff, "num_local_experts": cfg.n_experts, "router_jitter_noise": 0.0,
            "sliding_window": None}


def _olmoe_config(cfg: GPTConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return {**rotary_config(cfg, "olmoe", "OlmoeForCausalLM", eos_token_id, dtype), **_experts_config(cfg),
            "intermediate_size": cfg.expert_ff, "num_experts": cfg.n_experts, "norm_topk_prob": cfg.router_renorm,
            "attention_bias": False, "clip_qkv": None,
            "pad_token_id": None}  # OlmoeConfig's default, 1, is a token of OLMoE's own tokenizer


def _qwen3_moe_config(cfg: GPTConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    # every dense layer listed, so decoder_sparse_step stays 1 whatever model.moe_first_dense and moe_every are
    return {**rotary_config(cfg, "qwen3_moe", "Qwen3MoeForCausalLM", eos_token_id, dtype), **_experts_config(cfg),
            "num_experts": cfg.n_experts, "moe_intermediate_size": cfg.expert_ff,
            "norm_topk_prob": cfg.router_renorm, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(cfg.n_layer) if not cfg.moe_layer(i)], "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None}


def _moved_router_bias(cfg: GPTConfig, weights: dict[str, torch.Tensor]) -> str | None:
    """Why a model whose balancing biases have moved cannot be written as these classes, or None."""
    moved = [name for name, tensor in weights.items() if name.endswith(".router.score_bias") and bool(tensor.any())]
    if not moved:
        return None
    return (f"{moved[0]} and the other routers' balancing biases (model.router_bias_rate={cfg.router_bias_rate}, "
            f"DeepSeek-V3's e_score_correction_bias) are not 0 in {len(moved)} of its mixture-of-experts blocks, and "
            "Mixtral, OLMoE and Qwen3-MoE have no place for them: without them their routers would send tokens to "
            "other experts than lm's. Export a model trained with model.router_bias_rate=0")


TARGETS = (
    Target("Mixtral", "MixtralForCausalLM", (
        *LLAMA_BLOCK, equals("norm_position", "pre"), equals("qk_norm", False), *_NO_BIAS, *_EXPERTS,
        equals("router_renorm", True), *_EVERY_BLOCK,
    ), _mixtral_config, moe_plan(MIXTRAL_NAMES), refuse=_moved_router_bias),
    Target("OLMoE", "OlmoeForCausalLM", (
        *LLAMA_BLOCK, equals("norm_position", "pre"), equals("qk_norm", True), equals("qk_norm_scope", "all"),
        *_NO_BIAS, Need("d_head", "0 (OLMoE's query norm is hidden_size wide)",
                        lambda cfg: cfg.head_dim * cfg.n_head == cfg.d_model),
        *_EXPERTS, *_EVERY_BLOCK,
    ), _olmoe_config, moe_plan(QWEN_NAMES), refuse=_moved_router_bias),
    Target("Qwen3-MoE", "Qwen3MoeForCausalLM", (
        *LLAMA_BLOCK, equals("norm_position", "pre"), equals("qk_norm", True), equals("qk_norm_scope", "head"),
        *_NO_BIAS, *_EXPERTS,
    ), _qwen3_moe_config, moe_plan(QWEN_NAMES), refuse=_moved_router_bias),
)


# ---- import ------------------------------------------------------------------------------------

def moe_keys(sparse: list[bool]) -> tuple[int, int] | None:
    """(model.moe_first_dense, model.moe_every) that make exactly the blocks `sparse` marks mixtures of experts;
    None when no pair does. The first mixture is block first_dense + every - 1, which leaves one pair per every."""
    if True not in sparse:
        return None
    first = sparse.index(True)
    for every in range(1, first + 2):
        keys = (first + 1 - every, every)
        if [moe_block(i, *keys) for i in range(len(sparse))] == sparse:
            return keys
    return None


def _experts_fields(hf: dict, defaults: tuple[int, int, float], renorm: bool, problems: list[str]) -> dict[str, Any]:
    """Our router keys from config.json: `defaults` are the class's own number of experts, experts per token and
    router_aux_loss_coef, for a config.json that leaves them out. Each class takes the number of experts under
    both names (num_local_experts, num_experts), so the two must agree."""
    named = {key: hf[key] for key in ("num_local_experts", "num_experts") if hf.get(key) is not None}
    if len(set(named.values())) > 1:
        problems.append(f"num_local_experts={named['num_local_experts']} with num_experts={named['num_experts']} "
                        "(one setting under two names; keep one)")
    n = next(iter(named.values()), defaults[0])
    k = hf.get("num_experts_per_tok", defaults[1])
    return dict(n_experts=n, experts_per_token=k, n_shared_experts=0, router="softmax", router_renorm=renorm,
                aux_loss_coef=k * hf.get("router_aux_loss_coef", defaults[2]),
                router_z_loss_coef=float(hf.get("router_z_loss_coef", 0.0)))


def _mixtral_fields(hf: dict, problems: list[str]) -> dict[str, Any]:
    if hf.get("router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise={hf['router_jitter_noise']} (lm's router scores the tokens as they "
                        "are; import with 0)")
    return {**rotary_fields(hf, "mixtral", problems), **_experts_fields(hf, (8, 2, 0.001), True, problems)}


def _olmoe_fields(hf: dict, problems: list[str]) -> dict[str, Any]:
    if hf.get("clip_qkv") is not None:
        problems.append(f"clip_qkv={hf['clip_qkv']} (lm does not clip queries, keys and values)")
    return {**rotary_fields(hf, "olmoe", problems),
            **_experts_fields(hf, (64, 8, 0.01), hf.get("norm_topk_prob", False), problems)}


def _qwen3_moe_fields(hf: dict, problems: list[str]) -> dict[str, Any]:
    fields = rotary_fields(hf, "qwen3_moe", problems)
    experts = _experts_fields(hf, (128, 8, 0.001), hf.get("norm_topk_prob", False), problems)
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    sparse = [i not in dense and (i + 1) % step == 0 for i in range(fields["n_layer"])]
    if not any(sparse):  # every layer dense: Qwen3's block
        return fields
    keys = moe_keys(sparse)
    if keys is None:
        blocks = ", ".join(str(i) for i, moe in enumerate(sparse) if moe)
        problems.append(f"mlp_only_layers={dense} with decoder_sparse_step={step} makes blocks {blocks} mixtures of "
                        "experts (lm's are every model.moe_every-th block after the first model.moe_first_dense)")
        keys = (0, 1)
    return {**fields, **experts, "moe_first_dense": keys[0], "moe_every": keys[1],
            "expert_d_ff": hf.get("moe_intermediate_size", 768)}


READERS = {
    "MixtralForCausalLM": HFReader("mixtral", _mixtral_fields, moe_plan(MIXTRAL_NAMES)),
    "OlmoeForCausalLM": HFReader("olmoe", _olmoe_fields, moe_plan(QWEN_NAMES)),
    "Qwen3MoeForCausalLM": HFReader("qwen3_moe", _qwen3_moe_fields, moe_plan(QWEN_NAMES)),
}
