"""Reading and writing job configs: defaults < a YAML file < `--section.key=value` overrides (and, for a run
that starts from a Hugging Face checkpoint, its model: `lm.config.init_from`).

Unknown keys, wrong types and impossible values raise `ConfigError` naming the key. A tool's command line, and
its `--help` of every key, is `lm.config.command_line`'s.
"""

import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Callable
from pathlib import Path

import yaml

from lm.config.init_from import model_from_checkpoint
from lm.config.job_config import JobConfig, config_key
from lm.errors import ConfigError
from lm.io import atomic_write_text, read_utf8
from lm.models.config import ModelConfig
from lm.models.registry import DEFAULT, config_class


def _coerce(key: str, value: object, kind: object) -> object:
    """Check `value` against the annotation `kind`; ints are accepted where floats are expected, and a float
    must be finite (no setting means anything by nan or inf, and they pass every range check)."""
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            _check_written(key, value)
            if not -2**63 <= value < 2**63:  # what numpy and torch hold; a count past it is no count anyone means
                raise ConfigError(f"{key}: {_shown(value)} does not fit a 64-bit integer")
            return int(value)
    elif kind is float:
        _check_written(key, value)
        number = _float(value)
        if number is not None and not math.isfinite(number):
            raise ConfigError(f"{key}: must be a finite number, got {_shown(value)}")
        if number is not None:
            return number
    elif kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return getattr(value, "text", str(value))  # 2024_12_01 as written, not YAML's 20241201
    name = getattr(kind, "__name__", str(kind))
    if hasattr(value, "text"):  # a number YAML read, with its text: named as the int or float it is
        value = type(value).__base__(value)
    raise ConfigError(f"{key}: expected {name}, got {type(value).__name__} {value!r}")


_SURPRISING = {"octal": re.compile(r"[-+]?0[0-7_]+"),
               "base 60": re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")}
"""Numbers YAML 1.1 reads in a base nobody writing a step count or a rate means: 010 is 8, 1:30 is 90."""


def _shown(value: object) -> str:
    """A value for a message: a number of hundreds of digits by its first ones and its length."""
    text = repr(int(value) if isinstance(value, int) else value)
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text)} digits)"


def _check_written(key: str, value: object) -> None:
    """Refuse a number YAML read as octal or base 60 (`value.text` is what was written)."""
    text = getattr(value, "text", None)
    for base, pattern in _SURPRISING.items():
        if text is not None and pattern.fullmatch(text):
            raise ConfigError(f"{key}: YAML reads {text!r} as {type(value).__base__(value)!r} ({base}); "
                              "write the number in decimal, without leading zeros or colons")


def _float(value: object) -> float | None:
    """A number as a float (inf for an int too large for one); text too, since YAML 1.1 reads 1e-3 (no dot)
    and nan as strings."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return math.inf
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


_QUOTES = ("'", '"')


def _build(cls: type, values: dict, prefix: str, texts: dict[str, str]) -> object:
    """`cls` from `values`; `texts`: the command line's text of each dotted key it set, which a text key keeps
    as written (YAML would drop ` #...` as a comment and surrounding spaces, and read 2024-12-01 as a date),
    unless it is quoted: YAML reads escapes in double quotes ('"\\n\\n')."""
    hints = typing.get_type_hints(cls)
    names = {config_key(f.name): f.name for f in dataclasses.fields(cls)}  # key -> field (`async` -> `async_`)
    known = set(names)
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)  # YAML reads `1:` as a number
            hint = f"did you mean {close[0]!r}? " if close else ""
            if issubclass(cls, ModelConfig):  # each family takes its own keys
                raise ConfigError(f"{prefix}{key}: not a key of {cls.title} (model.arch={cls.arch}); {hint}it "
                                  f"takes {sorted(known)}")
            raise ConfigError(f"{prefix}{key}: unknown key; {hint}expected one of {sorted(known)}")
    kwargs = {}
    for key, value in values.items():
        name = names[key]
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{key}: expected a mapping of keys, got {value!r}")
            if kind is ModelConfig:  # the family model.arch names has the config class
                kind = config_class(value.get("arch", DEFAULT))
            kwargs[name] = _build(kind, value, f"{prefix}{key}.", texts)
        elif typing.get_origin(kind) is list:
            kwargs[name] = _build_list(typing.get_args(kind)[0], value, f"{prefix}{key}")
        else:
            if value is False and off_by_default(cls, name):  # YAML 1.1 reads `off` as False
                value = "off"
            elif kind is str and f"{prefix}{key}" in texts and not texts[f"{prefix}{key}"].lstrip().startswith(_QUOTES):
                value = texts[f"{prefix}{key}"]
            kwargs[name] = _coerce(f"{prefix}{key}", value, kind)
    return cls(**kwargs)


def off_by_default(cls: type, name: str) -> bool:
    """Whether field `name` of `cls` is text whose default is "off" (train.float8): YAML's False means it there."""
    return any(f.name == name and f.default == "off" for f in dataclasses.fields(cls))


def _build_list(item: type, values: object, key: str) -> list:
    """A list of `item` dataclasses from a list of mappings; an item's own check names it (key[i].field)."""
    if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
        raise ConfigError(f"{key}: expected a list of mappings such as [{{dir: data/a, weight: 1}}], got {values!r}")
    items = []
    for i, value in enumerate(values):
        try:
            items.append(_build(item, value, f"{key}[{i}].", {}))
        except ConfigError as err:
            text = str(err)
            raise ConfigError(text if text.startswith(key) else f"{key}[{i}].{text}") from None
    return items


def _is_list_key(key: str) -> bool:
    """Whether the dotted `key` is a list-valued setting (data.mixture), whose CLI value is YAML."""
    section, _, leaf = key.partition(".")
    fields = {f.name: f for f in dataclasses.fields(JobConfig)}
    if section not in fields:
        return False
    hints = typing.get_type_hints(typing.get_type_hints(JobConfig)[section])
    return typing.get_origin(hints.get(leaf)) is list


def _merge(base: dict, key: str, value: object) -> None:
    section, _, leaf = key.partition(".")
    if not leaf:
        raise ConfigError(f"{key}: overrides take the form --section.key=value")
    base.setdefault(section, {})
    if not isinstance(base[section], dict):
        raise ConfigError(f"{section}: expected a mapping of keys")
    base[section][leaf] = value


class _DuplicateKey(Exception):
    def __init__(self, key: object, first: int, again: int) -> None:
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


class _Int(int):
    """An int YAML read, with the text it was read from (`text`)."""


class _Float(float):
    """A float YAML read, with the text it was read from (`text`)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: YAML keeps the last
    value silently, so a typo'd copy of a section would quietly replace the first. Numbers keep their text,
    for a text key given one (`out_dir: 2024_12_01` or `010`, which YAML 1.1 reads as 20241201 and 8)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: the safe loader merges, keys given win
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (list, dict)):  # no dict takes it: `key in lines` raised a TypeError
                raise yaml.constructor.ConstructorError(None, None, f"a {type(key).__name__} as a key",
                                                        key_node.start_mark)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise _DuplicateKey(key, lines[key], line)
            lines[key] = line
        return super().construct_mapping(node, deep)


def _keeping_text(number: type, construct: Callable) -> Callable:
    def construct_number(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> object:
        kept = number(construct(loader, node))
        kept.text = node.value
        return kept
    return construct_number


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _keeping_text(_Int, yaml.SafeLoader.construct_yaml_int))
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float",
                                 _keeping_text(_Float, yaml.SafeLoader.construct_yaml_float))
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:timestamp",  # no key is a date: a run named 2024-12-01
                                 yaml.SafeLoader.construct_yaml_str)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """What is wrong and where, in one line: PyYAML's own message spans several, quoting the text."""
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return " ".join(str(err).split())
    context = f" ({err.context})" if getattr(err, "context", None) else ""
    return f"{err.problem}{context} at line {mark.line + 1}, column {mark.column + 1}"


def _parse_yaml(text: str, origin: str | Path) -> dict:
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as dup:
        raise ConfigError(f"{origin}: key {dup.key!r} is given twice (lines {dup.first} and {dup.again}); "
                          "keep one") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{origin}: not valid YAML: {_yaml_problem(err)}") from None
    except ValueError as err:  # Python's limit on an int's digits (4300)
        raise ConfigError(f"{origin}: a number YAML cannot read: {str(err).split(';')[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections at the top level")
    return raw


def config_from_yaml(text: str, origin: str | Path) -> JobConfig:
    """The config lm stored as YAML text (a checkpoint's config.yaml, a consolidated file's metadata), validated
    like a file; errors name `origin`. Model keys that the config's family does not take are dropped: lm wrote
    every family's keys into the model section before each family had keys of its own, and a family never
    read the others."""
    raw = _parse_yaml(text, origin)
    model = raw.get("model")
    if isinstance(model, dict):
        try:
            taken = {f.name for f in dataclasses.fields(config_class(model.get("arch", DEFAULT)))}
        except ConfigError as err:
            raise ConfigError(f"{origin}: {err}") from None
        raw["model"] = {key: value for key, value in model.items() if key in taken}
    return _build_job(raw)


def read_stored_config(path: Path) -> JobConfig:
    """`config_from_yaml` of a file lm wrote (a checkpoint's config.yaml)."""
    return config_from_yaml(read_utf8(path), path)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> JobConfig:
    """Build a JobConfig from `base` ({section: {key: value}}, e.g. taken from a checkpoint's config), then an
    optional YAML file's keys over it, then `section.key=value` override strings.

    An override that switches model.arch to another family than the file's (`--config configs/demo.yaml
    --model.arch=lstm`, or a sweep's grid) keeps the file's model keys that family takes and leaves out the
    others, which were the file's family's; a key an override names must be the family's."""
    raw: dict = {section: dict(keys) for section, keys in (base or {}).items()}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: no such file {str(path)!r}")
        for section, keys in _parse_yaml(read_utf8(path), path).items():
            if isinstance(keys, dict) and isinstance(raw.get(section), dict):
                raw[section] = {**raw[section], **keys}
            else:
                raw[section] = keys
    given_arch = raw.get("model", {}).get("arch", DEFAULT) if isinstance(raw.get("model"), dict) else None
    texts = {}
    for item in overrides or []:
        key, eq, text = item.removeprefix("--").partition("=")
        if not eq:
            raise ConfigError(f"{item}: overrides take the form --section.key=value")
        texts[key] = text
        try:
            value = yaml.load(text, Loader=_UniqueKeyLoader) if text else ""
        except ValueError as err:  # Python's limit on an int's digits (4300)
            raise ConfigError(f"--{key}: a number YAML cannot read: {str(err).split(';')[0]}") from None
        except (yaml.YAMLError, _DuplicateKey) as err:
            if _is_list_key(key):
                problem = (f"key {err.key!r} is given twice" if isinstance(err, _DuplicateKey)
                           else f"not valid YAML: {_yaml_problem(err)}")
                raise ConfigError(f"--{key}: {problem}") from None
            value = text  # "*.txt" (an alias to YAML), "a: b: c": see below
        # a scalar key's text that YAML reads as a mapping or list ("KING: hi") is meant literally; a list
        # key (data.mixture) takes YAML's flow form: '[{dir: data/a, weight: 3}, {dir: data/b, weight: 1}]'
        if isinstance(value, (dict, list)) and not _is_list_key(key):
            value = text
        _merge(raw, key, value)
    _switch_family(raw, given_arch, {item.removeprefix("--").partition("=")[0] for item in overrides or []})
    return _build_job(model_from_checkpoint(raw, _coerce), texts)


def _switch_family(raw: dict, given_arch: object, overridden: set[str]) -> None:
    """When the overrides chose another family than `given_arch` (the base's and file's), drop the model keys
    that came from the base or file and that family does not take."""
    model = raw.get("model")
    if "model.arch" not in overridden or not isinstance(model, dict) or model.get("arch") == given_arch:
        return
    taken = {f.name for f in dataclasses.fields(config_class(model.get("arch")))}
    raw["model"] = {key: value for key, value in model.items() if key in taken or f"model.{key}" in overridden}


def _build_job(raw: dict, texts: dict[str, str] | None = None) -> JobConfig:
    try:
        return _build(JobConfig, raw, "", texts or {})
    except TypeError as err:  # a dataclass rejected its arguments in a way _build did not foresee
        raise ConfigError(str(err)) from None


SAVED_CONFIG_HEADER = "# lm: a run's resolved config, every key; lm writes this file and replaces it\n"
"""The first line of each config.yaml lm writes: a run replaces only a config.yaml that starts with it."""


def save_config(cfg: JobConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically, so a crash never leaves half a file)."""
    atomic_write_text(path, SAVED_CONFIG_HEADER + yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def saved_by_lm(path: Path) -> bool:
    """Whether the file at `path` is a config.yaml `save_config` wrote (by its first line)."""
    with open(path, "rb") as f:
        return f.readline() == SAVED_CONFIG_HEADER.encode()
