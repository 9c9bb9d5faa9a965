"""A local transformers checkpoint directory, read as far as no model family is needed: its config.json.

Which family reads which transformers class, and how, is the family's (`HFReader`, `lm.models.hf_checkpoint`).
Reading needs neither transformers nor torch: only JSON.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm.errors import CheckpointError
from lm.hf.config_schema import check_config_json
from lm.io import atomic_write_text

if TYPE_CHECKING:
    from lm.hf.targets import HFReader

__all__ = ["CONFIG_NAME", "GENERATION_CONFIG", "ORIGIN_DIR", "HFModel", "find_origin", "is_hf_checkpoint",
           "keep_origin", "named_class", "read_config_json"]

CONFIG_NAME = "config.json"
GENERATION_CONFIG = "generation_config.json"
ORIGIN_DIR = "hf_origin"
"""Where a run started from a transformers checkpoint keeps that checkpoint's config.json and
generation_config.json: an export of the run writes back its token ids and generation settings unchanged."""


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
    return os.path.isfile(Path(path) / CONFIG_NAME)  # False, not OSError, for a name too long to look up


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


def named_class(hf: dict[str, Any], origin: Path, model_types: dict[str, str]) -> str:
    """Which of the transformers classes of `model_types` (class -> its model_type) the settings `hf` read from
    `origin` describe: the one class they name in `architectures`, else the class of their `model_type`.
    CheckpointError naming the file and the supported classes otherwise, and where the two disagree: transformers'
    Auto classes build the model_type's class, whose defaults and checks differ."""
    archs = hf.get("architectures") or []
    supported = ", ".join(model_types)
    if archs:
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in model_types:
            raise CheckpointError(f"{origin}: architectures={archs} is not one lm imports; supported: {supported}")
        if "model_type" in hf and hf["model_type"] != model_types[archs[0]]:
            raise CheckpointError(f"{origin}: architectures={archs} with model_type={hf['model_type']!r}, which "
                                  f"transformers builds as another class; {archs[0]} has model_type="
                                  f"{model_types[archs[0]]!r}")
        return archs[0]
    model_type = hf.get("model_type")
    by_type = {kind: hf_class for hf_class, kind in model_types.items()}
    if model_type not in by_type:
        raise CheckpointError(f"{origin}: model_type={model_type!r} (and no architectures) is not one lm imports; "
                              f"supported: {supported}")
    return by_type[model_type]


def keep_origin(directory: str | Path, run_dir: Path) -> None:
    """Copy the config.json and generation_config.json of the transformers checkpoint in `directory` into
    `run_dir`/hf_origin (each file whole, atomically), unless the run already keeps them."""
    target = run_dir / ORIGIN_DIR
    if (target / CONFIG_NAME).is_file():
        return
    target.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_NAME, GENERATION_CONFIG):
        if (Path(directory) / name).is_file():
            atomic_write_text(target / name, (Path(directory) / name).read_text())


def find_origin(step_dir: Path, init_from: str | None) -> Path | None:
    """The transformers files a run came from: its own copy (`keep_origin`) beside checkpoints/, or else its
    checkpoint.init_from while that directory still holds them; None for a run that did not start from one."""
    if step_dir.parent.name == "checkpoints" and (step_dir.parents[1] / ORIGIN_DIR / CONFIG_NAME).is_file():
        return step_dir.parents[1] / ORIGIN_DIR
    if init_from and is_hf_checkpoint(init_from):
        return Path(init_from)
    return None
