"""The encoder's masked-LM head as lm's own code for transformers (`lm/hf/remote/modeling_lm_encoder.py`, loaded with
trust_remote_code=True): the export target after BERT, for the configurations it does not compute (rotary or
sinusoidal positions, pre-norm, RMSNorm, another MLP, grouped-query heads, no biases, an untied output layer). Its
parameters keep our names; the embedding and the output layer keep the ids the model knows (the tokenizer's,
[MASK], [CLS] and padding), without the padding rows up to vocab_multiple. A fine-tuning head is refused, as for
BERT."""

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
from lm.models.encoder.config import EncoderConfig
from lm.models.encoder.hf import encoding_note

__all__ = ["TARGET", "encoder_target"]

HF_CLASS, MODELING_FILE = "LMEncoderForMaskedLM", "modeling_lm_encoder.py"

KNOWN: dict[str, tuple[Any, ...] | None] = {
    **TRANSFORMER_KEYS, "rope_theta": None, "head": ("mlm",),
    "num_classes": None, "pooling": None,  # a fine-tuning head's, which head mlm has not
}
"""Every EncoderConfig key the modeling file knows, with the values it computes (None: any value)"""


def encoder_config(cfg: EncoderConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return remote_config("lm_encoder", "LMEncoderConfig", "AutoModelForMaskedLM", HF_CLASS, MODELING_FILE, {
        **transformer_fields(cfg, cfg.total_vocab_size), "mask_token_id": cfg.mask_id, "cls_token_id": cfg.cls_id,
        "pad_token_id": cfg.pad_id, "dtype": str(dtype).removeprefix("torch."),
    })


def encoder_plan(cfg: EncoderConfig) -> Plan:
    from lm.models.encoder.model import Encoder

    with torch.device("meta"):
        model = Encoder(cfg)
    return plan_by_name(model, lambda name: name, ("wte.weight", "lm_head.weight", "lm_head.bias"),
                        cfg.total_vocab_size)


def encoder_note(cfg: EncoderConfig, tokenizer: str) -> str:
    return f"{code_note(HF_CLASS, MODELING_FILE)}; {encoding_note(cfg, tokenizer)}"


def encoder_target(config_class: type = EncoderConfig) -> Target:
    """The target for configs of `config_class` (EncoderConfig; a test passes a subclass with a key added)."""
    return Target("lm's own code", HF_CLASS, option_needs(config_class, KNOWN), encoder_config, encoder_plan,
                  tokenizer_files=False, note=encoder_note, code=code_files(MODELING_FILE, block))


TARGET = encoder_target()
