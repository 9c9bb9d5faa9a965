"""A transformers checkpoint's safetensors weights loaded into our model, whole or one shard per rank.

The directory holds `model.safetensors`, or shards listed by `model.safetensors.index.json`. Every name
is checked against the plan of the family that reads the class (`HFReader.plan`) before a byte of weight data is
read: a tensor we would not use (a q_norm, say) or one we need and cannot find is refused by name, and so is one
of another shape. Each parameter is then read in place, one at a time (`lm.hf.safetensors_rows`), and a rank of a
sharded model (FSDP2, HSDP, tensor parallelism, or FSDP2 over tensor parallelism) reads only the rows it keeps:
one contiguous byte range per stored tensor. GPT-2's Conv1D matrices are the exception: stored (in, out), a
rank's rows are columns of the stored tensor, so it reads the whole tensor. So are the weights cut along their
second dimension too (a mixture's experts under expert parallelism, a row-parallel projection under tensor
parallelism): a rank reads its rows whole and keeps its block of them.
"""

import json
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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
    """The safetensors files of the checkpoint: the one file, or else the index's. transformers reads a directory
    holding both (an export with --force over a sharded save) in that order, and so does lm."""
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    if (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            return sorted({directory / file for file in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{directory / INDEX}: not an index with a weight_map: {err}") from None
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


def _check_tied_head(plan: Plan, stored: dict[str, StoredTensor], origin: Path) -> None:
    """A tied model's checkpoint that holds an lm_head.weight anyway must hold the embedding's copy there:
    transformers 5 leaves a head that differs untied and uses it, where lm's tied model would use the embedding.
    Compared a block of rows at a time; a checkpoint without the copy (what save_pretrained writes) costs nothing."""
    head, embed = stored.get("lm_head.weight"), stored.get(plan["wte.weight"][0].name) if "wte.weight" in plan else None
    if head is None or embed is None:
        return
    same = (head.shape, head.stored_dtype) == (embed.shape, embed.stored_dtype)
    rows = max(1, 2**26 // max(1, head.row_bytes))  # 64 MiB of each at a time
    for lo in range(0, head.shape[0], rows) if same else ():
        hi = min(lo + rows, head.shape[0])
        if not torch.equal(read_rows(head, lo, hi), read_rows(embed, lo, hi)):
            same = False
            break
    if not same:
        raise CheckpointError(f"{origin}: tie_word_embeddings is true but lm_head.weight is not a copy of "
                              f"{embed.name}; transformers then unties the head and uses lm_head.weight, where lm "
                              "would use the embedding: set tie_word_embeddings to false in config.json (or drop "
                              "lm_head.weight from the weights)")


def _local_box(param: torch.Tensor) -> list[tuple[int, int]]:
    """For each dimension, the [start, stop) of the whole parameter that this rank holds: all of it, or a DTensor's
    local shard, found by torch's `compute_local_shape_and_global_offset` over every placement, as
    `lm.distributed.fsdp.FullTensorInit` finds the slice it draws and torch's state-dict helpers the slice of a full
    tensor they copy into a DTensor (`_distribute_tensors`). FSDP2 shards dim 0 (HSDP: replicated over the
    replicas); over tensor parallelism's cut of dim 0 it shards that cut again (a `_StridedShard`, whose block is the
    tp rank's rows cut by the dp rank); under expert parallelism an experts weight is cut along dim 0 over the ep
    ranks and along dim 1 by FSDP2 (`lm.distributed.fsdp.shard_experts`)."""
    if not isinstance(param, DTensor):
        return [(0, n) for n in param.shape]
    if any(isinstance(placement, Partial) for placement in param.placements):  # a sum's terms, not a block of it
        raise CheckpointError(f"cannot import into a parameter placed as {param.placements}; lm imports into "
                              "parameters whole, replicated or sharded")
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return [(start, start + n) for start, n in zip(offset, shape)]


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
    """Fill `model` (ours for `source.fields`, materialised, whole or sharded by any layout) with the checkpoint's
    weights, cast to the model's dtype, once `check_hf_weights` passes."""
    plan, stored = check_hf_weights(source, model)
    if model.cfg.tie_embeddings:
        _check_tied_head(plan, stored, source.directory)
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
