"""A local transformers checkpoint directory, read as far as no model family is needed: its config.json.

Which family reads which transformers class, and how, is the family's (`HFReader`, `lm.models.hf_checkpoint`).
Reading needs neither transformers nor torch: only JSON.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm.errors import CheckpointError
from lm.hf.config_schema import check_config_json

if TYPE_CHECKING:
    from lm.hf.targets import HFReader

__all__ = ["CONFIG_NAME", "HFModel", "is_hf_checkpoint", "read_config_json"]

CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class HFModel:
    """What a transformers checkpoint directory holds, in our terms."""

    directory: Path
    hf_class: str
    arch: str
    """The family that reads it (model.arch)"""
    fields: dict[str, Any]
    """`model.*` keys of that family's config that reproduce it"""
    reader: "HFReader"


def is_hf_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a transformers checkpoint directory (it holds a config.json)."""
    return (Path(path) / CONFIG_NAME).is_file()


def read_config_json(directory: str | Path) -> tuple[dict[str, Any], Path]:
    """The settings of the checkpoint in `directory` and the file they came from; CheckpointError naming the
    file when there is none, it is not a JSON object, or a setting lm reads has the wrong type or range."""
    origin = Path(directory) / CONFIG_NAME
    try:
        hf = json.loads(origin.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: not a Hugging Face checkpoint directory (no {CONFIG_NAME})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{origin}: not readable JSON: {err}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{origin}: expected a JSON object of settings")
    check_config_json(hf, origin)
    return hf, origin
