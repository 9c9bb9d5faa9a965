"""A transformers checkpoint's safetensors weights loaded into our model, whole or one FSDP shard per rank.

The directory holds `model.safetensors`, or shards listed by `model.safetensors.index.json`. Every name
is checked against the plan of the family that reads the class (`HFReader.plan`) before a byte of weight data is
read: a tensor we would not
use (a q_norm, say) or one we need and cannot find is refused by name, and so is one of another shape. Each
parameter is then read in place, one at a time (`lm.hf.safetensors_rows`), and a rank of an FSDP-sharded
model reads only the rows it keeps: one contiguous byte range per stored tensor. GPT-2's Conv1D matrices are
the exception: stored (in, out), a rank's rows are columns of the stored tensor, so it reads the whole tensor.
So are a mixture's experts under expert parallelism, cut along their second dimension too: a rank reads its ep
rank's experts whole and keeps its block of them.
"""

import json
import math
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lm.errors import CheckpointError
from lm.hf.importing import HFModel
from lm.hf.safetensors_rows import DTYPES, StoredTensor, read_header, read_rows
from lm.hf.targets import Part, Plan, row_spans

__all__ = ["check_hf_weights", "load_hf_weights", "stored_names"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Buffers some transformers versions saved beside the weights: GPT-2's causal-mask tables and rotary
# frequencies. They hold no learned value, and we compute both.
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _index(directory: Path) -> list[Path]:
    """The safetensors files of the checkpoint: the index's, or the one file."""
    if (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            return sorted({directory / file for file in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{directory / INDEX}: not an index with a weight_map: {err}") from None
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    raise CheckpointError(f"{directory}: no {SINGLE} or {INDEX} (found: {', '.join(found) or 'no weights'}); lm "
                          "imports safetensors: save the model with save_pretrained(safe_serialization=True)")


def stored_names(source: HFModel) -> dict[str, StoredTensor]:
    """The checkpoint's weights, each under the name the reader's plan gives it (transformers' current names),
    read from the files' headers; the buffers that hold no weight are left out."""
    return {source.reader.rename(name): tensor for path in _index(source.directory)
            for name, tensor in read_header(path).items() if not name.endswith(_BUFFER_SUFFIXES)}


def _listed(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _check_names(plan: Plan, stored: dict[str, StoredTensor], tied: bool, origin: Path) -> None:
    needed = {part.name for parts in plan.values() for part in parts}
    missing = sorted(needed - set(stored))
    # a tied head may be saved anyway, as a copy of the embedding
    unused = sorted(set(stored) - needed - ({"lm_head.weight"} if tied else set()))
    problems = ([f"missing {_listed(missing)}"] if missing else []) + \
        ([f"holds tensors lm's model has no place for: {_listed(unused)}"] if unused else [])
    if problems:
        raise CheckpointError(f"{origin}: its weights do not match its config.json: " + "; ".join(problems))


def _local_box(param: torch.Tensor) -> list[tuple[int, int]]:
    """For each dimension, the [start, stop) of the whole parameter that this rank holds: all of it, or a DTensor's
    shard, each Shard(d) of its placements cutting dimension d over its mesh dimension as torch.chunk does
    (ceil(n / ranks) per rank, the last ones shorter or empty), in mesh order; Replicate cuts nothing. FSDP2 shards
    dim 0 (HSDP: replicated over the replicas); under expert parallelism an experts weight is cut along dim 0 over
    the ep ranks and along dim 1 by FSDP2 (`lm.distributed.fsdp.shard_experts`)."""
    box = [(0, n) for n in param.shape]
    if not isinstance(param, DTensor):
        return box
    mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate()
    for i, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # a strided shard or a partial value is no box of the whole tensor
            raise CheckpointError(f"cannot import into a parameter placed as {param.placements}; lm imports into "
                                  "parameters whole, replicated, or cut into even blocks (Shard)")
        lo, hi = box[placement.dim]
        chunk = math.ceil((hi - lo) / mesh.size(i))
        start = min(lo + coordinate[i] * chunk, hi)
        box[placement.dim] = (start, min(start + chunk, hi))
    return box


def _check_tensors(plan: Plan, stored: dict[str, StoredTensor], params: dict[str, torch.Tensor]) -> None:
    """Each stored tensor the plan reads is a float of the shape our parameter needs."""
    for ours, parts in plan.items():
        rest = tuple(params[ours].shape[1:])
        for part in parts:
            tensor = stored[part.name]
            want = part.stored_shape(rest)
            if not tensor.is_float:
                raise CheckpointError(f"{tensor.path}: {tensor.name} is stored as {tensor.stored_dtype}; lm imports "
                                      f"floating-point weights ({', '.join(DTYPES)})")
            if tensor.shape != want:
                raise CheckpointError(f"{tensor.path}: {tensor.name} has shape {list(tensor.shape)}; its config.json "
                                      f"implies {list(want)}")


def _fill(local: torch.Tensor, spans: list[tuple[Part, int, int]], stored: dict[str, StoredTensor]) -> None:
    """Copy the spans' rows, in order, into `local` (this rank's rows of one parameter)."""
    at = 0
    for part, lo, hi in spans:
        tensor, dest = stored[part.name], local[at:at + hi - lo]
        lo, hi = lo + part.offset, hi + part.offset  # its rows (columns when transposed)
        if part.slab:  # one expert's matrix: our whole row
            whole = read_rows(tensor, 0, tensor.shape[0])
            dest[0].copy_(whole.t() if part.transposed else whole)
        elif part.transposed:  # our rows are its columns: read it whole
            dest.copy_(read_rows(tensor, 0, tensor.shape[0])[:, lo:hi].t())
        elif dest.dtype == tensor.dtype and dest.is_contiguous():
            read_rows(tensor, lo, hi, out=dest)
        else:
            dest.copy_(read_rows(tensor, lo, hi))
        at += hi - lo


def check_hf_weights(source: HFModel, model: nn.Module) -> tuple[Plan, dict[str, StoredTensor]]:
    """Refuse a checkpoint whose tensors are not what `model` (ours for `source.fields`, on any device, the
    meta device included) needs: a name missing or unused, a shape that differs, a weight that is no float.
    Reads the files' headers only. Returns the plan and the stored tensors it was checked against."""
    cfg = model.cfg
    plan = source.reader.plan(cfg)
    stored = stored_names(source)
    _check_names(plan, stored, cfg.tie_embeddings, source.directory)
    params = dict(model.named_parameters())  # a tied head appears once, as wte.weight
    if set(params) != set(plan):
        raise CheckpointError(f"{source.directory}: lm's model has parameters {sorted(set(params) ^ set(plan))} "
                              "that the import does not fill")
    for ours, parts in plan.items():
        if sum(part.rows for part in parts) != params[ours].shape[0]:
            raise CheckpointError(f"{source.directory}: {ours} has {params[ours].shape[0]} rows, the checkpoint "
                                  f"{sum(part.rows for part in parts)}; import with model.vocab_multiple=1")
    _check_tensors(plan, stored, params)
    return plan, stored


@torch.no_grad()
def load_hf_weights(source: HFModel, model: nn.Module) -> None:
    """Fill `model` (ours for `source.fields`, materialised, whole or FSDP-sharded) with the checkpoint's
    weights, cast to the model's dtype, once `check_hf_weights` passes."""
    plan, stored = check_hf_weights(source, model)
    params = dict(model.named_parameters())
    for ours, parts in plan.items():
        param = params[ours]
        local = param.to_local() if isinstance(param, DTensor) else param
        (start, stop), *rest = _local_box(param)
        if all(box == (0, n) for box, n in zip(rest, param.shape[1:])):
            _fill(local, row_spans(parts, start, stop), stored)
            continue
        # cut along a later dimension too (an expert-parallel experts weight): read this rank's rows whole, keep
        # its block of them
        rows = torch.empty((stop - start, *param.shape[1:]), dtype=local.dtype, device=local.device)
        _fill(rows, row_spans(parts, start, stop), stored)
        local.copy_(rows[(slice(None), *(slice(lo, hi) for lo, hi in rest))])
