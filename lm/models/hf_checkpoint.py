"""Which family reads a transformers checkpoint: the class its config.json names, looked up among every
family's `hf.readers`, and its settings read as that family's config keys.

Everything that would change the forward and that the family does not reproduce is refused here, from
config.json alone, before any weight is read: one CheckpointError naming the file and every such setting.
"""

from pathlib import Path

from lm.errors import CheckpointError
from lm.hf.importing import HFModel, named_class, read_config_json
from lm.hf.targets import HFReader
from lm.models.registry import family_names, get_family

__all__ = ["read_hf_model"]


def _readers() -> dict[str, tuple[str, HFReader]]:
    """transformers class -> (family name, its reader), over every registered family."""
    return {hf_class: (name, reader) for name in family_names()
            for hf_class, reader in get_family(name).hf.readers.items()}


def read_hf_model(directory: str | Path) -> HFModel:
    """The family and model config keys of the transformers checkpoint in `directory`, from its config.json.

    Raises CheckpointError naming the file and every field lm cannot reproduce exactly, so nothing is read or
    written for a checkpoint that would not give its own logits.
    """
    directory = Path(directory)
    readers = _readers()
    hf, origin = read_config_json(directory)
    hf_class = named_class(hf, origin, {name: reader.model_type for name, (_, reader) in readers.items()})
    arch, reader = readers[hf_class]
    problems: list[str] = []
    if hf.get("quantization_config"):
        problems.append("quantization_config (lm imports full-precision weights)")
    fields = reader.fields(hf, problems)
    if problems:
        raise CheckpointError(f"{origin}: {hf_class} with settings lm cannot reproduce exactly: " + "; ".join(problems))
    return HFModel(directory, hf_class, arch, {"arch": arch, **fields}, reader)
