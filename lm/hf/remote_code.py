"""Exports as code: for a model no transformers class computes, the export writes lm's own modeling files beside
the weights, and config.json's `auto_map` names their classes, so transformers loads the directory with
`trust_remote_code=True`. Each family's last export target is such a class (`lm.models.<family>.hf_remote`).

The files import only torch, transformers and each other. The layers are lm's own source (`lm.models.layers`,
`attention`, `block`, ...), written with their imports of each other made relative (`exported_source`), so a model
change is made once; what only transformers needs (a configuration, the glue to its cache and masks, one modeling
file per family) is package data in `CODE_DIR`, copied into exports and never imported by lm. A modeling file
reproduces the options it was written for and no others: `option_needs` keeps the target to those, refusing by
name any value it does not know, and any config key added to lm after it (unless left at its default), so a new
option is refused in one line rather than exported wrong.
"""

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch.nn as nn

from lm.hf.targets import Need, Part, Plan, yaml_value

__all__ = ["CODE_DIR", "TRANSFORMER_KEYS", "code_files", "code_note", "exported_source", "layer_files", "option_needs",
           "plan_by_name", "remote_config", "transformer_fields"]

CODE_DIR = Path(__file__).with_name("remote")
"""The files only an export as code needs, which it copies: the configuration, the glue and the modeling files"""

CONFIG_FILE, GLUE_FILE = "configuration_lm.py", "hf_glue.py"

LAYER_IMPORT = re.compile(r"^from lm\.models\.(\w+) import ", re.MULTILINE)
"""How lm's layer modules import each other (one module of lm.models, by name)"""

STAND_INS = {"config": Path(CONFIG_FILE).stem}
"""lm.models modules the export does not carry, and the written file that stands in for each: the layers' config is
a dataclass of lm's config system; configuration_lm.py's `TransformerConfig` gives them its keys under its names"""

TRANSFORMER_KEYS: dict[str, tuple[Any, ...] | None] = {
    "arch": None, "vocab_size": None, "block_size": None, "n_layer": None, "d_model": None, "n_head": None,
    "n_kv_head": None, "d_ff": None, "norm_eps": None, "bias": None, "tie_embeddings": None,
    "pos": ("learned", "sinusoidal", "rope"), "norm": ("layernorm", "rmsnorm"), "norm_position": ("pre", "post"),
    "mlp": ("gelu", "relu", "relu2", "swiglu"),
    # dropout acts in training only, and the padding rows up to vocab_multiple are not exported
    "dropout": None, "vocab_multiple": None,
}
"""The shared transformer keys (`lm.models.config.TransformerConfig`) configuration_lm.py carries, with the values the
modeling files compute (None: any value). A family's target adds its own keys."""


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


def layer_files(root: ModuleType) -> tuple[Path, ...]:
    """The source files of lm's layer module `root` (lm.models.block) and of every lm.models module it imports,
    directly or through another, except those with a stand-in (`STAND_INS`); by name."""
    found: dict[str, Path] = {}
    todo = [Path(root.__file__)]
    while todo:
        path = todo.pop()
        if path.name not in found:
            found[path.name] = path
            imported = LAYER_IMPORT.findall(path.read_text(encoding="utf-8"))
            todo += [path.with_name(f"{name}.py") for name in imported if name not in STAND_INS]
    return tuple(found[name] for name in sorted(found))


def code_files(modeling_file: str, layers: ModuleType) -> tuple[Path, ...]:
    """The files an export of the class in `modeling_file` holds: its configuration, the glue, lm's layer files from
    the module `layers` (lm.models.block) down, and itself."""
    return CODE_DIR / CONFIG_FILE, CODE_DIR / GLUE_FILE, *layer_files(layers), CODE_DIR / modeling_file


def exported_source(path: Path, beside: tuple[Path, ...] = ()) -> str:
    """Code file `path` as the export writes it beside the files `beside`: an lm layer file's imports of other
    lm.models modules become relative imports of the files written beside it (or of their stand-ins), under a line
    that says where it comes from; a modeling file imports every file beside it itself (`_import_all`). ValueError
    where an import of lm is left, which transformers could not load without lm installed."""
    text = path.read_text(encoding="utf-8")
    if path.parent != CODE_DIR:
        text = f"# lm.models.{path.stem}: lm's own source, its imports of lm made relative by lm.export\n" + \
            LAYER_IMPORT.sub(lambda m: f"from .{STAND_INS.get(m[1], m[1])} import ", text)
    elif path.name.startswith("modeling_"):
        text = _import_all(text, [p.stem for p in beside if p != path])
    if left := re.search(r"^\s*(from|import)\s+lm\b.*", text, re.MULTILINE):
        raise ValueError(f"{path}: the export cannot carry `{left[0].strip()}`; a layer file may import torch and "
                         "lm.models' layer modules only")
    return text


def _import_all(text: str, modules: list[str]) -> str:
    """`text`, a modeling file, with an import of each of `modules` it does not import itself: transformers 4.x
    copies into its module cache only the files a local modeling file imports directly, so a layer file that only
    another imports (block.py's attention.py) would be missing there."""
    missing = [name for name in modules if not re.search(rf"^from \.{name} import ", text, re.MULTILINE)]
    if not missing:
        return text
    header = "\n\n# every file beside this one, for transformers 4.x, which copies only the files imported here\n"
    return text + header + "".join(f"from .{name} import __name__ as _{name}  # noqa: E402, F401\n" for name in missing)


def code_note(hf_class: str, modeling_file: str) -> str:
    """What a user of an export as code must know."""
    return (f"{hf_class} is lm's own code, written beside the weights ({modeling_file}): load the directory with "
            "trust_remote_code=True")
