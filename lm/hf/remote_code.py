"""Exports as code: for a model no transformers class computes, the export writes lm's own modeling files beside
the weights (`CODE_DIR`: a configuration, the shared layers and one modeling file per family, importing only torch
and transformers), and config.json's `auto_map` names their classes, so transformers loads the directory with
`trust_remote_code=True`. Each family's last export target is such a class (`lm.models.<family>.hf_remote`).

The files are package data, copied into exports and never imported by lm. A modeling file reproduces the options it
was written for and no others: `option_needs` keeps the target to those, refusing by name any value it does not
know, and any config key added to lm after it (unless left at its default), so a new option is refused in one
line rather than exported wrong.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.nn as nn

from lm.hf.targets import Need, Part, Plan, yaml_value

__all__ = ["CODE_DIR", "TRANSFORMER_KEYS", "code_files", "code_note", "option_needs", "plan_by_name", "remote_config",
           "transformer_fields"]

CODE_DIR = Path(__file__).with_name("remote")
"""The modeling files an export as code copies"""

CONFIG_FILE, LAYERS_FILE = "configuration_lm.py", "lm_layers.py"

TRANSFORMER_KEYS: dict[str, tuple[Any, ...] | None] = {
    "arch": None, "vocab_size": None, "block_size": None, "n_layer": None, "d_model": None, "n_head": None,
    "n_kv_head": None, "d_ff": None, "norm_eps": None, "bias": None, "tie_embeddings": None,
    "pos": ("learned", "sinusoidal", "rope"), "norm": ("layernorm", "rmsnorm"), "norm_position": ("pre", "post"),
    "mlp": ("gelu", "relu", "relu2", "swiglu"),
    # dropout acts in training only, and the padding rows up to vocab_multiple are not exported
    "dropout": None, "vocab_multiple": None,
}
"""The shared transformer keys (`lm.models.config.TransformerConfig`) lm_layers.py knows, with the values it computes
(None: any value). A family's target adds its own keys."""


def option_needs(config_class: type, known: dict[str, tuple[Any, ...] | None]) -> tuple[Need, ...]:
    """What a modeling file needs of a config of `config_class`: each key of `known` mapped to the values it
    reproduces holds one of them (None: any value), and every other field of the class keeps its default."""
    needs = []
    for key, values in known.items():
        if values is not None:
            needs.append(Need(key, " or ".join(yaml_value(v) for v in values),
                              lambda cfg, key=key, values=values: getattr(cfg, key) in values))
    for f in dataclasses.fields(config_class):
        if f.name not in known:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            needs.append(Need(f.name, f"{yaml_value(default)} (the exported code predates this key)",
                              lambda cfg, key=f.name, default=default: getattr(cfg, key) == default))
    return tuple(needs)


def plan_by_name(model: nn.Module, rename: Callable[[str], str], vocab_params: tuple[str, ...],
                 vocab_rows: int) -> Plan:
    """Every parameter of `model` (built on the meta device will do; a tied one once, under its first name) as the
    tensor `rename` names, whole, except that `vocab_params` keep their first `vocab_rows` rows: the ids the model
    knows, without the padding rows up to vocab_multiple."""
    return {name: (Part(rename(name), vocab_rows if name in vocab_params else p.shape[0]),)
            for name, p in model.named_parameters()}


def remote_config(model_type: str, config_class: str, auto_class: str, hf_class: str, modeling_file: str,
                  fields: dict[str, Any]) -> dict[str, Any]:
    """config.json of `hf_class` in `modeling_file`, configured by `config_class` of the configuration file, which
    transformers' AutoConfig and `auto_class` (AutoModelForCausalLM, ...) find through auto_map; `fields` are the
    configuration's own keys."""
    return {
        "model_type": model_type,
        "architectures": [hf_class],
        "auto_map": {"AutoConfig": f"{Path(CONFIG_FILE).stem}.{config_class}",
                     auto_class: f"{Path(modeling_file).stem}.{hf_class}"},
        **fields,
    }


def transformer_fields(cfg: Any, vocab_size: int) -> dict[str, Any]:
    """The configuration keys every family's model reads (`LMTransformerConfig`), with `vocab_size` ids: the
    sizes actually used (key/value heads, feed-forward width), never 0 for "the default"."""
    return {
        "vocab_size": vocab_size, "block_size": cfg.block_size, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
        "n_kv_head": cfg.kv_heads, "d_model": cfg.d_model, "d_ff": cfg.ff_dim, "pos": cfg.pos,
        "rope_theta": cfg.rope_theta, "norm": cfg.norm, "norm_eps": cfg.norm_eps, "norm_position": cfg.norm_position,
        "mlp": cfg.mlp, "bias": cfg.bias, "qkv_bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm, "dropout": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def code_files(modeling_file: str) -> tuple[str, ...]:
    """The files an export of the class in `modeling_file` holds: its configuration, the layers and itself."""
    return CONFIG_FILE, LAYERS_FILE, modeling_file


def code_note(hf_class: str, modeling_file: str) -> str:
    """What a user of an export as code must know."""
    return (f"{hf_class} is lm's own code, written beside the weights ({modeling_file}): load the directory with "
            "trust_remote_code=True")
