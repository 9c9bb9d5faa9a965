"""A run that starts from a Hugging Face checkpoint takes its model config from the checkpoint.

With `checkpoint.init_from` naming a transformers checkpoint directory, the `model` section is what its
config.json describes (`lm.hf.importing`). A model key given in the YAML or on the command line must agree
with it, except the keys that change training and not the weights (`ModelConfig.training_keys`); anything
else is a config that does not describe the checkpoint, refused by name. `data.tokenizer` defaults to the
checkpoint's own tokenizer.json when it has one, and another tokenizer is refused.
"""

import dataclasses
import typing
from pathlib import Path
from typing import Any

from lm.errors import CheckpointError, ConfigError, LMError
from lm.hf.importing import is_hf_checkpoint
from lm.hf.tokenizer_files import exported_encoding
from lm.models.registry import config_class
from lm.tokenizer import tokenizer_identity

__all__ = ["model_from_checkpoint"]

TOKENIZER_FILE = "tokenizer.json"


def model_from_checkpoint(raw: dict[str, Any], coerce: typing.Callable[[str, object, object], object]) -> dict:
    """`raw` (the config's {section: {key: value}} as given) with its model section, and a missing
    data.tokenizer, filled from the Hugging Face checkpoint that checkpoint.init_from names; `raw` as it is
    when init_from names no such directory. `coerce(key, value, type)` reads a given value as the config does."""
    init_from = (raw.get("checkpoint") or {}).get("init_from")
    if not isinstance(init_from, str) or not init_from or not is_hf_checkpoint(init_from):
        return raw
    # here, not above: which family reads the checkpoint is every family's to say, and they import torch
    from lm.models.hf_checkpoint import read_hf_model

    try:
        source = read_hf_model(init_from)
        family = config_class(source.arch)
        derived = family(**source.fields)
    except (CheckpointError, ConfigError) as err:
        raise ConfigError(f"checkpoint.init_from: {err}") from None
    given = raw.get("model") or {}
    if not isinstance(given, dict):
        return raw  # the config's own check names the section
    hints = typing.get_type_hints(family)
    keys = {f.name for f in dataclasses.fields(family)}  # a ClassVar (z_loss) is no key
    for key, value in given.items():
        if key in family.training_keys or key not in keys:
            continue
        if coerce(f"model.{key}", value, hints[key]) != getattr(derived, key):
            raise ConfigError(f"model.{key}: {value!r} disagrees with checkpoint.init_from={init_from}, whose "
                              f"config.json gives {getattr(derived, key)!r}; the model comes from the checkpoint, "
                              f"so drop model.{key}")
    unknown = {key: value for key, value in given.items() if key not in keys}  # named by the config's own check
    model = dataclasses.asdict(derived) | {key: given[key] for key in family.training_keys if key in given} | unknown
    data = raw.get("data") or {}
    tokenizer = Path(init_from) / TOKENIZER_FILE
    if isinstance(data, dict) and tokenizer.is_file():
        # lm.export's files of a tiktoken encoding are named by the encoding, as the data it trained on records
        own = exported_encoding(Path(init_from)) or str(tokenizer)
        if "tokenizer" in data:
            _check_tokenizer(data["tokenizer"], own, init_from)
        data = {**data, "tokenizer": data.get("tokenizer", own)}
    return {**raw, "model": model, "data": data}


def _check_tokenizer(given: object, own: str, init_from: str) -> None:
    """Refuse a data.tokenizer whose ids (or BOS and EOS) are not those of the checkpoint's own tokenizer: every
    embedding row stands for one of its ids. One that cannot be read is left to the config's own check."""
    if not isinstance(given, str):
        return
    try:
        same = tokenizer_identity(given) == tokenizer_identity(own)
    except (LMError, OSError, ValueError):
        return
    if not same:
        raise ConfigError(f"data.tokenizer: {given!r} is not the tokenizer of checkpoint.init_from={init_from} "
                          f"({own}), whose embedding rows stand for that tokenizer's ids; drop data.tokenizer (it "
                          "defaults to the checkpoint's) and prepare the data with the checkpoint's tokenizer")
