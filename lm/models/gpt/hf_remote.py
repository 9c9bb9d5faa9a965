"""The decoder as lm's own code for transformers (`lm/hf/remote/modeling_lm_decoder.py`, loaded with
trust_remote_code=True): the last export target, for the configurations that GPT-2, Llama and Qwen2 do not compute
(QK-norm, ReLU squared or ReLU, post-norm, sinusoidal positions, rmsnorm with learned positions, a logit soft-cap,
...). Its parameters keep our names; the embedding and an untied head keep the tokenizer's `vocab_size` rows, as
for the native classes.
"""

from typing import Any

import torch

from lm.hf.remote_code import (
    TRANSFORMER_KEYS,
    code_files,
    code_note,
    option_needs,
    plan_by_name,
    remote_config,
    transformer_fields,
)
from lm.hf.targets import Plan, Target
from lm.models import block
from lm.models.gpt.config import GPTConfig

__all__ = ["TARGET", "decoder_target"]

HF_CLASS, MODELING_FILE = "LMDecoderForCausalLM", "modeling_lm_decoder.py"

KNOWN: dict[str, tuple[Any, ...] | None] = {
    **TRANSFORMER_KEYS, "rope_theta": None, "qkv_bias": None, "qk_norm": (False, True), "logit_softcap": None,
    "norm_position": ("pre", "post", "output"), "d_head": None, "nope_interval": None,
    "qk_norm_scope": ("head", "all"), "rope_scaling": ("none", "linear", "llama3"), "rope_factor": None,
    "rope_low_freq_factor": None, "rope_high_freq_factor": None, "rope_original_context": None,
    "loss_chunk": None,  # how training computes the loss, not what
}
"""Every GPTConfig key the modeling file knows, with the values it computes (None: any value)"""


def decoder_config(cfg: GPTConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return remote_config("lm_decoder", "LMDecoderConfig", "AutoModelForCausalLM", HF_CLASS, MODELING_FILE, {
        **transformer_fields(cfg, cfg.vocab_size), "logit_softcap": cfg.logit_softcap, "d_head": cfg.d_head,
        "nope_interval": cfg.nope_interval, "qk_norm_scope": cfg.qk_norm_scope, "rope_scaling_type": cfg.rope_scaling,
        "rope_factor": cfg.rope_factor, "rope_low_freq_factor": cfg.rope_low_freq_factor,
        "rope_high_freq_factor": cfg.rope_high_freq_factor, "rope_original_context": cfg.rope_original_context,
        "bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    })


def decoder_plan(cfg: GPTConfig) -> Plan:
    from lm.models.gpt.model import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    return plan_by_name(model, lambda name: name, ("wte.weight", "lm_head.weight"), cfg.vocab_size)


def decoder_target(config_class: type = GPTConfig) -> Target:
    """The target for configs of `config_class` (GPTConfig; a test passes a subclass with a key added)."""
    return Target("lm's own code", HF_CLASS, option_needs(config_class, KNOWN), decoder_config, decoder_plan,
                  note=lambda cfg, tokenizer: code_note(HF_CLASS, MODELING_FILE), code=code_files(MODELING_FILE, block))


TARGET = decoder_target()
