"""The command line of every tool that takes a config: `--config FILE` and dotted `--section.key=value`
overrides (read by `lm.config.load.load_config`), a tool's own flags, and a `--help` that lists every key with its
type, default and one-line doc.
"""

import argparse
import ast
import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable

from lm.config.job_config import JobConfig, config_key
from lm.config.load import load_config
from lm.models.config import ModelConfig
from lm.models.registry import config_class, family_names


def config_help() -> str:
    """Every config key with its type, default and docstring, for `--help`; the model section once per family."""
    lines = []
    for section in dataclasses.fields(JobConfig):
        cls = typing.get_type_hints(JobConfig)[section.name]
        if cls is not ModelConfig:
            lines += [f"{section.name}:", *_key_lines(section.name, cls)]
            continue
        for name in family_names():
            family = config_class(name)
            lines += [f"model (model.arch={name}: {family.title}):", *_key_lines(section.name, family)]
    return "\n".join(lines)


def _key_lines(section: str, cls: type) -> list[str]:
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        kind = getattr(hints[f.name], "__name__", "")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # a list's is []
        lines.append(f"  --{section}.{config_key(f.name)}={default!r} ({kind}) {docs.get(f.name, '')}")
    return lines


@functools.cache  # every tool's parse_cli builds the help text; parsing the classes' source each time cost 0.1 s
def _field_docs(cls: type) -> dict[str, str]:
    """Read the string literal that follows each field in the class body and its bases' (its one-line doc)."""
    docs = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = str(nxt.value.value)  # type: ignore[attr-defined]
    return docs


class OneConfig(argparse.Action):
    """The action of a tool's `--config FILE`: one file, as a second would silently replace the first."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: object,
                 option: str | None = None) -> None:
        if not str(value).strip():  # Path("") is the working directory
            parser.error(f"argument --config: expected a path, got {value!r}")
        if getattr(namespace, self.dest) is not None:
            parser.error(f"--config is given twice ({getattr(namespace, self.dest)}, {value}); give one file and "
                         "override its keys with --section.key=value")
        setattr(namespace, self.dest, value)


def parse_cli(
    argv: list[str], description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None,
    prog: str | None = None, base: dict | None = None, reads: tuple[str, ...] | None = None,
) -> tuple[JobConfig, argparse.Namespace]:
    """Parse `--config FILE` plus dotted overrides over `base` (see `load_config`); `extra(parser)` may add
    tool-specific flags. `reads`: the sections ("data") and keys ("data.seq_len") the tool reads, for one that
    reads part of the config; an override of anything else is refused, as it would change nothing. A config
    file's other keys are left alone: one file serves every tool.

    Returns (JobConfig, argparse.Namespace of the extra flags).
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="config keys (override any with --section.key=value):\n" + config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", action=OneConfig, help="YAML config file (see configs/)")
    if extra is not None:
        extra(parser)
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for item in rest:
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            parser.error(f"unrecognized argument {item!r}; config overrides look like --section.key=value")
        if reads is not None and (problem := unread_override(item.split("=", 1)[0][2:], reads)):
            parser.error(problem)
        overrides.append(item)
    return load_config(args.config, overrides, base), args


def unread_override(key: str, reads: tuple[str, ...]) -> str | None:
    """Why a tool that reads only `reads` (sections and section.key names) refuses an override of `key`; None
    when it reads it. The same key in a section it reads is named: --data.val_fraction for --task.val_fraction."""
    sections = typing.get_type_hints(JobConfig)
    section, name = key.split(".", 1)
    if key in reads or section in reads or section not in sections:  # an unknown section: load_config's to name
        return None
    same = [f"--{read}.{name}" for read in reads if read in sections
            and name in {config_key(f.name) for f in dataclasses.fields(sections[read])}]
    return (f"--{key}: this tool does not read it (it reads {', '.join(reads)}), so it would change nothing"
            + (f"; did you mean {same[0]}?" if same else ""))
