"""How a model family maps to and from transformers classes: the terms each family states its mapping in.

A family (`lm.models.<family>.hf`) lists the `Target`s it exports to, each with the config values our model
must have for the class's forward to equal ours (`Need`), its config.json, and where each of our parameters
lives among its tensors (a `Plan`); and the `HFReader`s of the classes it imports, each reading a config.json
as the family's config keys. One plan serves both ways: the export cuts our tensors into theirs
(`hf_state_dict`), the import fills ours from theirs (`lm.hf.import_weights`). Everything here is pure, so the
parity tests feed transformers the very tensors the export writes.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lm.errors import ExportError

__all__ = ["ONE_KV_HEAD", "HFReader", "Need", "Part", "Plan", "Target", "equals", "hf_state_dict", "pick_target",
           "row_spans", "split_rows", "unmet", "yaml_value"]


@dataclass(frozen=True)
class Need:
    """One condition a target puts on the model config: `key` must be `wanted` (as one writes it on the CLI)."""

    key: str
    wanted: str
    ok: Callable[[Any], bool]


def yaml_value(value: object) -> str:
    """A config value as it is written in YAML or on the command line (`false`, not `False`)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def equals(key: str, value: object) -> Need:
    return Need(key, yaml_value(value), lambda cfg: getattr(cfg, key) == value)


ONE_KV_HEAD = Need("n_kv_head", "0 (one key/value head per query head)", lambda cfg: cfg.kv_heads == cfg.n_head)
"""Multi-head attention: a class without grouped-query attention needs as many key/value heads as query heads."""


@dataclass(frozen=True)
class Part:
    """One transformers tensor, or `rows` of its rows from `offset` on, that fills `rows` consecutive rows (dim 0)
    of one of our parameters."""

    name: str
    rows: int
    transposed: bool = False
    """Stored (in, out), as GPT-2's Conv1D layers are: our rows are its columns."""
    offset: int = 0
    """Where our rows start in its rows (columns when transposed): GPT-2's c_attn holds our q, k and v"""
    of: int = 0
    """How many rows (columns when transposed) it has, when more than `rows`"""
    slab: bool = False
    """It is one whole row of ours (`rows` 1), without that dimension: one expert's matrix of a stacked
    (n_experts, in, out) weight, which transformers stores expert by expert (transposed: as a Linear's (out, in))"""

    @property
    def stored_rows(self) -> int:
        return self.of or self.rows

    def stored_shape(self, rest: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the stored tensor, given the dimensions of our parameter after its rows (dim 0)."""
        if self.slab:
            return tuple(reversed(rest)) if self.transposed else rest
        return (rest[0], self.stored_rows) if self.transposed else (self.stored_rows, *rest)


Plan = dict[str, tuple[Part, ...]]
"""Our parameter name -> the transformers tensors that, stacked along dim 0 in order, are its rows."""


@dataclass(frozen=True)
class Target:
    """A transformers model class, what our model config must be for its forward to equal ours, and how our
    model is written as it."""

    name: str
    """How messages call it: GPT-2"""
    hf_class: str
    needs: tuple[Need, ...]
    config: Callable[[Any, int | None, torch.dtype], dict[str, Any]]
    """(model config, end-of-text id or None, weight dtype) -> its config.json"""
    plan: Callable[[Any], Plan]
    extra: Callable[[Any, dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda cfg, weights: {}
    """Tensors it has that we do not, made from our weights (BERT's token-type table)"""
    refuse: Callable[[Any, dict[str, torch.Tensor]], str | None] = lambda cfg, weights: None
    """(model config, our state dict) -> why these weights cannot be written as it though their config can (a tensor
    of ours it has no place for holds more than its default), or None"""
    tokenizer_files: bool = True
    """Whether the export writes the tokenizer's files beside the model (an encoder's ids are not the tokenizer's)"""
    note: Callable[[Any, str], str] | None = None
    """(model config, data.tokenizer) -> what a user of the export must know that its files do not say"""
    code: tuple[Path, ...] = ()
    """Source files written beside config.json (`lm.hf.remote_code.code_files`): the class is lm's own code, which
    transformers runs with trust_remote_code=True"""
    generation: Callable[[Any], dict[str, Any]] | None = None
    """model config -> its generation_config.json, where generation does not start, end and pad with the end-of-text
    token (an encoder-decoder starts from its padding id)"""


@dataclass(frozen=True)
class HFReader:
    """How a transformers class's checkpoint reads as one of our families."""

    model_type: str
    """Its config.json's model_type (which names the class when `architectures` is absent)"""
    fields: Callable[[dict[str, Any], list[str]], dict[str, Any]]
    """config.json -> our model config's keys; appends to the list every setting we cannot reproduce"""
    plan: Callable[[Any], Plan]
    """Where each of our parameters lives in its files, given the config `fields` made"""
    rename: Callable[[str], str] = field(default=lambda name: name)
    """A stored tensor's name as `plan` names it (older files name some tensors otherwise)"""


def unmet(cfg: Any, target: Target) -> list[Need]:
    """The conditions of `target` that `cfg` does not meet, in the target's order."""
    return [need for need in target.needs if not need.ok(cfg)]


def pick_target(cfg: Any, targets: tuple[Target, ...], family: str) -> Target:
    """The first of `targets` whose forward equals ours for `cfg`; ExportError when none does, listing the model
    keys in the way and, per target, the values it needs. `family` names the model in that message."""
    if not targets:
        raise ExportError(f"cannot export to Hugging Face: {family} (model.arch={cfg.arch}) has no transformers "
                          "counterpart")
    misses = {target: unmet(cfg, target) for target in targets}
    for target, missed in misses.items():
        if not missed:
            return target
    keys = list(dict.fromkeys(need.key for missed in misses.values() for need in missed))
    have = ", ".join(f"model.{key}={yaml_value(getattr(cfg, key))}" for key in keys)
    per_target = "; ".join(
        f"{target.hf_class} ({target.name}) needs " + ", ".join(f"model.{need.key}={need.wanted}" for need in missed)
        for target, missed in misses.items()
    )
    raise ExportError(f"cannot export to Hugging Face: no transformers model has this combination "
                      f"({have}): {per_target}")


def split_rows(tensor: torch.Tensor, parts: tuple[Part, ...]) -> list[tuple[Part, torch.Tensor]]:
    """Our tensor cut into its parts' rows, each transposed back where it is stored so."""
    out, start = [], 0
    for part in parts:
        piece = tensor[start] if part.slab else tensor[start:start + part.rows]
        out.append((part, piece.t() if part.transposed else piece))
        start += part.rows
    return out


def row_spans(parts: tuple[Part, ...], start: int, stop: int) -> list[tuple[Part, int, int]]:
    """The pieces of our rows [start, stop): (part, first row, end row) in the part's own rows, in order.

    An FSDP rank holds a contiguous block of each parameter's rows; this says which rows of which stored
    tensors hold that block, so the rank reads those alone.
    """
    spans, offset = [], 0
    for part in parts:
        lo, hi = max(start, offset), min(stop, offset + part.rows)
        if lo < hi:
            spans.append((part, lo - offset, hi - offset))
        offset += part.rows
    return spans


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with its own storage: safetensors refuses tensors that share memory, such as
    the row slices of our fused q/k/v matrix."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def hf_state_dict(model: nn.Module, target: Target) -> dict[str, torch.Tensor]:
    """The transformers weights of `model` under `target`'s names, each a standalone contiguous tensor."""
    sd = model.state_dict()
    if why := target.refuse(model.cfg, sd):
        raise ExportError(f"cannot export to Hugging Face as {target.hf_class} ({target.name}): {why}")
    pieces: dict[str, list[tuple[Part, torch.Tensor]]] = {}
    for ours, parts in target.plan(model.cfg).items():
        for part, piece in split_rows(sd[ours], parts):
            pieces.setdefault(part.name, []).append((part, piece))
    out: dict[str, torch.Tensor] = {}
    for name, found in pieces.items():  # several of ours fill one of theirs (GPT-2's c_attn) in offset order
        found.sort(key=lambda item: item[0].offset)
        out[name] = torch.cat([piece for _, piece in found], dim=1 if found[0][0].transposed else 0)
    out.update(target.extra(model.cfg, sd))
    return {k: _own(v) for k, v in out.items()}
