"""The model families by name (model.arch): each one's config class and its `Family` spec.

The built-in families are imported when first asked for, and a config is read without importing their models
(nor torch). A family from outside lm is added by `register(family)` in Python, `family` a `Family` instance
(`lm.models.family`); for the command-line tools (and the processes torchrun starts), name the modules that call
`register` in the environment variable LM_FAMILIES, comma-separated, and they are imported at the first lookup:

    LM_FAMILIES=mypkg.family torchrun --nproc_per_node=2 -m lm.train --model.arch=mine ...
"""

import difflib
import importlib
import os
from typing import TYPE_CHECKING

from lm.errors import ConfigError
from lm.models.config import ModelConfig

if TYPE_CHECKING:
    from lm.models.family import Family

DEFAULT = "gpt"
"""The family of a config that names none."""

_BUILTIN = {
    "gpt": ("lm.models.gpt.config:GPTConfig", "lm.models.gpt.family:FAMILY"),
    "encdec": ("lm.models.encdec.config:EncDecConfig", "lm.models.encdec.family:FAMILY"),
    "encoder": ("lm.models.encoder.config:EncoderConfig", "lm.models.encoder.family:FAMILY"),
    "lstm": ("lm.models.lstm.config:LSTMConfig", "lm.models.lstm.family:FAMILY"),
}
_builtin: dict[str, "Family"] = {}
_registered: dict[str, "Family"] = {}
_plugins_loaded = False


def _load(path: str) -> object:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _load_plugins() -> None:
    """Import the modules LM_FAMILIES names, once; each registers its families."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for module in filter(None, (m.strip() for m in os.environ.get("LM_FAMILIES", "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"LM_FAMILIES: cannot import {module!r}: {err}") from None


def register(family: "Family") -> None:
    """Make `family` known under family.name (model.arch). A name is registered once; a built-in one never."""
    if family.name in _BUILTIN or family.name in _registered:
        raise ValueError(f"model family {family.name!r} is already registered")
    if family.config_class.arch != family.name:
        raise ValueError(f"{family.config_class.__name__}.arch defaults to {family.config_class.arch!r}, "
                         f"not the family's name {family.name!r}")
    _registered[family.name] = family


def family_names() -> list[str]:
    """Every family's name, the built-in ones first."""
    _load_plugins()
    return [*_BUILTIN, *_registered]


def _unknown(arch: object) -> ConfigError:
    names = family_names()
    close = difflib.get_close_matches(str(arch), names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"model.arch: unknown model family {arch!r}; {hint}expected one of {names}")


def config_class(arch: object) -> type[ModelConfig]:
    """The config dataclass of family `arch` (imports its config module only)."""
    if isinstance(arch, str) and arch in _BUILTIN:
        return _load(_BUILTIN[arch][0])  # type: ignore[return-value]
    _load_plugins()
    if isinstance(arch, str) and arch in _registered:
        return _registered[arch].config_class
    raise _unknown(arch)


def get_family(arch: str) -> "Family":
    """The spec of family `arch`."""
    if arch in _BUILTIN:
        if arch not in _builtin:
            _builtin[arch] = _load(_BUILTIN[arch][1])  # type: ignore[assignment]
        return _builtin[arch]
    _load_plugins()
    if arch not in _registered:
        raise _unknown(arch)
    return _registered[arch]


def family_of(cfg: ModelConfig) -> "Family":
    """The spec of the family a model config belongs to."""
    return get_family(cfg.arch)
