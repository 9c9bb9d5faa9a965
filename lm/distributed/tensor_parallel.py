"""Tensor parallelism with sequence parallelism (`torch.distributed.tensor.parallel`), from a family's plan.

A family names what each of its modules is under tensor parallelism (`lm.models.family.TPStyle`); this module
turns those names into torch's parallel styles over the mesh's tensor-parallel dimension. Between blocks the
residual stream is cut along the sequence (each rank holds T / tp positions, so norms and dropout cost 1/tp);
a sublayer gathers the whole sequence, its first matrices keep each rank's heads or hidden units
(column-parallel), and its output matrix sums the ranks' parts straight into sequence shards (row-parallel,
a reduce-scatter). The output head keeps each rank's slice of the vocabulary, and the loss is computed over
those slices (`loss_parallel`) without ever gathering the logits.
"""

import contextlib
import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from lm.distributed.expert_parallel import run_on_local_weights
from lm.models.family import TPStyle

__all__ = ["apply_tensor_parallel", "parallel_loss", "whole"]


class Replicated(ParallelStyle):
    """A module whose parameters every tensor-parallel rank holds whole, called with whole inputs (the same on
    every rank): its weights become replicated DTensors, so FSDP2 and the gradient norm see one mesh, and its
    outputs come back as plain tensors. Each rank computes the whole gradient, so none is reduced."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def wrap(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                         if isinstance(x, torch.Tensor) else x for x in inputs)

        def unwrap(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, input_fn=wrap, output_fn=unwrap)  # parameters: replicated


class WholeWeights(ParallelStyle):
    """A module whose parameters every tensor-parallel rank holds whole (replicated DTensors, for FSDP2's single
    mesh) and whose forward runs on their local tensors, fed plain inputs: a mixture's routed experts, whose rows
    are grouped by expert, which no DTensor layout describes. Every rank computes the whole gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        run_on_local_weights(module)
        return distribute_module(module, device_mesh)  # parameters: replicated


def _style(style: TPStyle) -> ParallelStyle:
    """torch's parallel style for one of the plan's names."""
    if style is TPStyle.COLUMNS:  # input: the whole sequence; output: this rank's heads or hidden units
        return ColwiseParallel()
    if style is TPStyle.ROWS:  # input: this rank's columns; output: the ranks' sum, cut along the sequence
        return RowwiseParallel(output_layouts=Shard(1))
    if style is TPStyle.SEQUENCE:  # a norm over channels on this rank's positions
        return SequenceParallel(use_local_output=True)
    if style is TPStyle.HEADS:  # a norm over each head's channels, on this rank's heads: (B, nh, T, hs)
        return SequenceParallel(sequence_dim=1, use_local_output=True)
    if style is TPStyle.GATHER:  # a sublayer's first input: the whole sequence, from each rank's positions
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  input_kwarg_layouts={}, desired_input_kwarg_layouts={}, use_local_output=True)
    if style is TPStyle.SCATTER:  # the embedded sequence, whole on every rank, cut into shards as it comes out
        return PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
                                   use_local_output=True)
    if style is TPStyle.EMBEDDING:  # vocabulary rows split; every rank gets the whole embedded sequence
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style is TPStyle.HEAD:  # vocabulary rows split; logits stay split over the vocabulary for the loss
        return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    if style is TPStyle.REPLICATE:  # whole on every rank, run on whole inputs (a position table)
        return Replicated()
    if style is TPStyle.WHOLE:  # the whole sequence in, this rank's slice of the output back (no sum: all alike)
        return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Replicate(),),
                                        desired_output_layouts=(Shard(1),), use_local_output=True)
    if style is TPStyle.EXPERTS:
        return WholeWeights()
    raise ValueError(f"unknown tensor-parallel style {style}")


def apply_tensor_parallel(model: nn.Module, plan: dict[str, TPStyle], mesh: DeviceMesh) -> None:
    """Parallelise `model` in place over the 1-D tensor-parallel `mesh`, module by module as `plan` says (module
    name -> style). Works on the meta device, before the weights exist. A tied head is tied again afterwards by
    the model's own init_weights. Parameters already DTensors (expert-parallel experts) are left to their mesh."""
    parallelize_module(model, mesh, {name: _style(style) for name, style in plan.items()})
    missed = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if missed:  # a plan that forgot a module: FSDP2 would shard these over another mesh than the rest
        raise ValueError(f"the tensor-parallel plan leaves {', '.join(missed)} out; give its module a style")


def parallel_loss(tp: int) -> contextlib.AbstractContextManager:
    """Where cross-entropy and its backward run over logits split along the vocabulary (tp > 1)."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def whole(value):
    """`value` with every DTensor in it (a tensor, or a dataclass of them) made a whole local tensor: what a
    loss or score computed over vocabulary slices hands back to code that knows nothing of meshes."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: whole(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, tuple):
        return tuple(whole(v) for v in value)
    return value
