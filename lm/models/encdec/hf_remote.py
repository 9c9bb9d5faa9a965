"""The encoder-decoder as lm's own code for transformers (`lm/hf/remote/modeling_lm_encdec.py`, loaded with
trust_remote_code=True), its only export target: no transformers class has its layer (T5 and BART differ in
positions, norms and embedding scale). The embedding and an untied head keep the ids the model knows (the
tokenizer's, the sentinels and padding), without the padding rows up to vocab_multiple.

Inside each stack the parameters keep our names; the stacks' own embeddings, positions and final norms are
encoder.embed (our tgt_embed when shared, else src_embed), encoder.pos, encoder.norm and decoder.embed (tgt_embed),
decoder.pos, decoder.norm.
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
from lm.models.encdec.config import EncDecConfig

__all__ = ["TARGET", "encdec_target"]

HF_CLASS, MODELING_FILE = "LMEncDecForConditionalGeneration", "modeling_lm_encdec.py"

KNOWN: dict[str, tuple[Any, ...] | None] = {
    **TRANSFORMER_KEYS, "pos": ("learned", "sinusoidal"), "share_embeddings": None, "n_sentinels": None,
}
"""Every EncDecConfig key the modeling file knows, with the values it computes (None: any value)"""


def encdec_config(cfg: EncDecConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return remote_config("lm_encdec", "LMEncDecConfig", "AutoModelForSeq2SeqLM", HF_CLASS, MODELING_FILE, {
        **transformer_fields(cfg, cfg.total_vocab_size), "share_embeddings": cfg.share_embeddings,
        "n_sentinels": cfg.n_sentinels, "sentinel_start": cfg.sentinel_start, "pad_token_id": cfg.pad_id,
        "decoder_start_token_id": cfg.pad_id, "is_encoder_decoder": True, "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    })


def encdec_generation(cfg: EncDecConfig) -> dict[str, Any]:
    """Decoding starts from the padding id and never writes it (lm's sampling draws from the ids below it). No end
    id: lm stops at the sentinel after the prompt's last span, which depends on the prompt."""
    return {"decoder_start_token_id": cfg.pad_id, "pad_token_id": cfg.pad_id, "suppress_tokens": [cfg.pad_id]}


def _rename(cfg: EncDecConfig, name: str) -> str:
    """Our parameter's name in the export (see the module docstring)."""
    tables = {"src_embed.weight": "encoder.embed.weight", "src_pos.weight": "encoder.pos.weight",
              "tgt_embed.weight": "encoder.embed.weight" if cfg.share_embeddings else "decoder.embed.weight",
              "tgt_pos.weight": "decoder.pos.weight", "lm_head.weight": "lm_head.weight"}
    if name in tables:
        return tables[name]
    stack, rest = name.split(".", 1)  # encoder.<i>.<...>, enc_norm.<...>, decoder.<i>.<...>, dec_norm.<...>
    if stack in ("enc_norm", "dec_norm"):
        return f"{'encoder' if stack == 'enc_norm' else 'decoder'}.norm.{rest}"
    return f"{stack}.blocks.{rest}"


def encdec_plan(cfg: EncDecConfig) -> Plan:
    from lm.models.encdec.model import EncoderDecoder

    with torch.device("meta"):
        model = EncoderDecoder(cfg)
    return plan_by_name(model, lambda name: _rename(cfg, name), ("tgt_embed.weight", "src_embed.weight",
                                                                 "lm_head.weight"), cfg.total_vocab_size)


def encdec_note(cfg: EncDecConfig, tokenizer: str) -> str:
    return (f"{code_note(HF_CLASS, MODELING_FILE)}; a source marks its i-th missing span with sentinel id "
            f"{cfg.sentinel_start} + i (up to {cfg.sentinel_start + cfg.n_sentinels - 1}), and the decoder starts "
            f"from the padding id {cfg.pad_id}")


def encdec_target(config_class: type = EncDecConfig) -> Target:
    """The target for configs of `config_class` (EncDecConfig; a test passes a subclass with a key added)."""
    return Target("lm's own code", HF_CLASS, option_needs(config_class, KNOWN), encdec_config, encdec_plan,
                  note=encdec_note, code=code_files(MODELING_FILE, block), generation=encdec_generation)


TARGET = encdec_target()
