"""The model families by name (model.arch): each one's config class and its `Family` spec.

The built-in families are imported when first asked for, and a config is read without importing their models
(nor torch). A family from outside lm is added by `register(family)` in Python, `family` a `Family` instance
(`lm.models.family`); for the command-line tools (and the processes torchrun starts), name the modules that call
`register` in the environment variable LM_FAMILIES, comma-separated, and they are imported at the first lookup:

    LM_FAMILIES=mypkg.family torchrun --nproc_per_node=2 -m lm.train --model.arch=mine ...

A spec is checked whole when it is registered (`spec_problems`: its name, its config class and every function lm
calls later), and a module LM_FAMILIES names that fails to import, raises or registers a bad spec is a
`ConfigError` naming the module: a broken family stops a tool before it starts, in one line, not halfway through.
"""

import dataclasses
import difflib
import importlib
import os
import re
import sys
import traceback
from collections.abc import Mapping
from typing import Any

import yaml

from lm.errors import ConfigError
from lm.models.config import ModelConfig
from lm.models.family import Estimates, Family, HFAdapter, Parallel, Sampler, TaskHead, Training

DEFAULT = "gpt"
"""The family of a config that names none."""

_BUILTIN = {
    "gpt": ("lm.models.gpt.config:GPTConfig", "lm.models.gpt.family:FAMILY"),
    "encdec": ("lm.models.encdec.config:EncDecConfig", "lm.models.encdec.family:FAMILY"),
    "encoder": ("lm.models.encoder.config:EncoderConfig", "lm.models.encoder.family:FAMILY"),
    "lstm": ("lm.models.lstm.config:LSTMConfig", "lm.models.lstm.family:FAMILY"),
}
_builtin: dict[str, Family] = {}
_registered: dict[str, Family] = {}
_origins: dict[str, str] = {}  # name -> the module that registered it, for a second module's error
_plugins_loaded = False

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_FN, _MAYBE_FN = "a callable", "a callable or None"
_PARTS: tuple[tuple[str, Any], ...] = (
    ("build", _FN), ("blocks", _FN), ("output_layers", _FN), ("check_precision", _FN),
    ("training", Training), ("training.objective", _FN), ("training.loss", _FN), ("training.score", _FN),
    ("training.causal_lm", bool), ("training.head", (TaskHead, type(None))), ("training.head.keys", tuple),
    ("training.head.is_param", _FN), ("training.head.outputs", _FN), ("training.after_step", _MAYBE_FN),
    ("parallel", Parallel), ("parallel.tensor_styles", _MAYBE_FN), ("parallel.tensor_problem", _FN),
    ("parallel.context_problem", _FN), ("parallel.stage", _MAYBE_FN), ("parallel.pipeline_problem", _FN),
    ("parallel.experts", _MAYBE_FN), ("parallel.expert_problem", _FN),
    ("sampler", (Sampler, type(None))), ("sampler.sample", _FN), ("sampler.outside_forward", bool),
    ("hf", HFAdapter), ("hf.targets", tuple), ("hf.readers", Mapping),
    ("estimates", Estimates), ("estimates.activation_bytes", _MAYBE_FN), ("estimates.flops_per_token", _MAYBE_FN),
    ("estimates.memory_note", str), ("estimates.idle_params", _MAYBE_FN),
    ("estimates.context_kv", _MAYBE_FN),
)
"""Every part of a spec that lm reads after registration, by its path, with what it must be: a callable (or None
where lm skips it), or an instance of the type(s) given. A part below None (a family without a sampler) is absent."""


def _load(path: str) -> object:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _import_failure(module: str, err: Exception) -> str:
    """What went wrong importing plugin `module`, in one line, with the file and line where it did."""
    if isinstance(err, ConfigError):  # a bad spec refused by `register`, or the plugin's own config error
        return f"LM_FAMILIES: {module!r}: {_one_line(str(err))}"
    if isinstance(err, SyntaxError):
        return f"LM_FAMILIES: {module!r} has a syntax error: {err.msg} ({err.filename}, line {err.lineno})"
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"LM_FAMILIES: importing {module!r} raised {type(err).__name__}: {_one_line(str(err))}{where}"


def _load_plugins() -> None:
    """Import the modules LM_FAMILIES names, once; each registers its families. A module that fails is a
    ConfigError naming it, what it registered is forgotten, and the next lookup tries again (and fails the same)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True  # before importing: a plugin that looks a family up while it loads does not recurse
    names = dict.fromkeys(filter(None, (m.strip() for m in os.environ.get("LM_FAMILIES", "").split(","))))
    for module in names:
        before = dict(_registered)
        try:
            importlib.import_module(module)
        except ImportError as err:
            _forget_since(before)
            raise ConfigError(f"LM_FAMILIES: cannot import {module!r}: {_one_line(str(err))}") from None
        except Exception as err:  # any failure of a user's module is bad input here, not lm's bug
            _forget_since(before)
            raise ConfigError(_import_failure(module, err)) from None


def _forget_since(before: dict[str, Family]) -> None:
    """Put the registry back as it was before a plugin that failed half way, and load the plugins again next time."""
    global _plugins_loaded
    _registered.clear()
    _registered.update(before)
    _plugins_loaded = False


def spec_problems(family: object) -> list[str]:
    """What is wrong with a family spec, each problem naming the part and what it must be; [] for a usable one.

    Checked: that it is a `Family`; its name (the model.arch value); its config class (a dataclass subclassing
    ModelConfig whose keys all have defaults, as the config loader builds it from a section naming few of them,
    and whose arch defaults to the name); and every function and part lm calls or reads later (`_PARTS`)."""
    if not isinstance(family, Family):
        return [f"expected a lm.models.family.Family instance, got {type(family).__name__}"]
    problems = []
    if not isinstance(family.name, str) or not _NAME.fullmatch(family.name):
        problems.append(f"name: expected a model.arch value (letters, digits, '_', '-', '.'), got {family.name!r}")
    elif (read := yaml.safe_load(family.name)) != family.name:  # `--model.arch=7` or `arch: on` could not name it
        problems.append(f"name: YAML reads {family.name!r} as the {type(read).__name__} {read!r}, so model.arch "
                        "could not name the family; expected a name YAML reads as text")
    problems += _config_class_problems(family.config_class, family.name)
    absent = set()
    for path, want in _PARTS:
        parent, _, attr = path.rpartition(".")
        if parent in absent:
            continue
        value = getattr(_part(family, parent), attr, None)
        if want in (_FN, _MAYBE_FN):
            if not (callable(value) or (want == _MAYBE_FN and value is None)):
                problems.append(f"{path}: expected {want}, got {_shown(value)}")
        elif not isinstance(value, want):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in (want if isinstance(want, tuple)
                                                                                    else (want,)))
            problems.append(f"{path}: expected {names}, got {_shown(value)}")
            absent.add(path)
        if value is None:
            absent.add(path)
    return problems


def _part(family: Family, path: str) -> object:
    value: object = family
    for attr in filter(None, path.split(".")):
        value = getattr(value, attr, None)
    return value


def _shown(value: object) -> str:
    return "None" if value is None else f"{type(value).__name__} {_one_line(repr(value))[:60]}"


def _config_class_problems(cls: object, name: object) -> list[str]:
    if not (isinstance(cls, type) and issubclass(cls, ModelConfig) and dataclasses.is_dataclass(cls)):
        return [f"config_class: expected a dataclass subclassing lm.models.config.ModelConfig, got {_shown(cls)}"]
    problems = []
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        problems.append(f"config_class: {cls.__name__}'s keys {required} have no default; every key needs one (a "
                        "config names only the keys it changes)")
    if (arch := getattr(cls, "arch", None)) != name:
        problems.append(f"config_class: {cls.__name__}.arch defaults to {arch!r}, not the family's name {name!r}")
    if not isinstance(getattr(cls, "title", None), str):
        problems.append(f"config_class: {cls.__name__}.title: expected a str (how messages name the family), got "
                        f"{_shown(getattr(cls, 'title', None))}")
    return problems


def register(family: Family) -> None:
    """Make `family` known under family.name (model.arch). A name is registered once; a built-in one never. The
    spec is checked whole (`spec_problems`): ConfigError naming the family and every problem, or the module that
    registered the name first."""
    caller = sys._getframe(1).f_globals.get("__name__", "?")
    name = getattr(family, "name", None)
    if isinstance(name, str) and name in _BUILTIN:
        raise ConfigError(f"model family {name!r} is already registered: it is a built-in family; give yours "
                          "another name")
    if isinstance(name, str) and name in _registered:
        raise ConfigError(f"model family {name!r} is already registered (by module {_origins.get(name, '?')!r}); "
                          "register a family once, under a name of its own")
    if problems := spec_problems(family):
        raise ConfigError(f"model family {name!r}: {'; '.join(problems)}")
    _registered[name] = family  # type: ignore[index]
    _origins[name] = caller  # type: ignore[index]


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


def get_family(arch: str) -> Family:
    """The spec of family `arch`."""
    if arch in _BUILTIN:
        if arch not in _builtin:
            _builtin[arch] = _load(_BUILTIN[arch][1])  # type: ignore[assignment]
        return _builtin[arch]
    _load_plugins()
    if arch not in _registered:
        raise _unknown(arch)
    return _registered[arch]


def family_of(cfg: ModelConfig) -> Family:
    """The spec of the family a model config belongs to."""
    return get_family(cfg.arch)
