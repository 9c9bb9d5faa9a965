"""Expert parallelism (parallel.ep): the routed experts of every mixture-of-experts layer split over ep ranks, each
(token, expert) pair sent to the rank that holds its expert and its output sent back.

A family's experts module (`Parallel.experts`) keeps its n experts stacked along the first dimension of each
weight and computes forward(rows sorted by expert (N, C), counts (n,)). Under expert parallelism its weights are
DTensors cut along that dimension over the ep ranks (Shard(0)): rank r holds experts [r n/ep, (r+1) n/ep). Around
the unchanged forward, the style below exchanges the counts, sends each rank's rows to the ranks of their experts
(an all-to-all with uneven splits, differentiable: its backward sends the gradients back the same way), regroups
the received rows by local expert, and after the forward undoes both. The model's code never sees a process group:
its forward runs on this rank's slice of the weights as plain tensors (`run_on_local_weights`).

How the ranks are laid out and how FSDP2 shards the experts further is `lm.distributed.layout.expert_meshes` and
`lm.distributed.fsdp.parallelize`.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

__all__ = ["ExpertParallel", "apply_expert_parallel", "run_on_local_weights"]


def run_on_local_weights(module: nn.Module) -> None:
    """Make `module`'s forward compute with this rank's local tensors of its DTensor parameters: expert-parallel
    rows are grouped by this rank's experts, not laid out as a DTensor could say. Gradients reach the DTensors
    (`to_local` hands them back with the parameters' placements)."""
    forward = module.forward

    def local_forward(*args, **kwargs):
        held = dict(module._parameters)  # what FSDP2's pre-forward hook set: the gathered parameters
        try:
            for name, param in held.items():
                if isinstance(param, DTensor):
                    module._parameters[name] = param.to_local()
            return forward(*args, **kwargs)
        finally:
            module._parameters.update(held)

    module.forward = local_forward


@dataclass(frozen=True)
class Route:
    """Where one forward's rows went, to send the outputs back the same way."""

    sent: list[int]
    """Rows this rank sent to each ep rank"""
    received: list[int]
    """Rows this rank received from each ep rank"""
    order: torch.Tensor
    """(M,) the received rows (by source rank, then expert) in the order of this rank's experts"""


class ExpertParallel(ParallelStyle):
    """One experts module split over the 1-D `mesh` of ep ranks (one instance per module: it keeps the route of
    the module's last forward)."""

    def __init__(self) -> None:
        self.route: Route | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        run_on_local_weights(module)
        return distribute_module(module, device_mesh, partition_fn=_shard_experts, input_fn=self._dispatch,
                                 output_fn=self._combine)

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (N, C) sorted by global expert, counts (n,)) -> (the rows of this rank's experts (M, C), sorted by
        local expert, counts (n / ep,))."""
        rows, counts = inputs
        ep = mesh.size()
        # (n,) as (ep, n / ep): row s holds what rank s sends to each of this rank's experts
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=mesh.get_group())
        by_source = received.view(ep, -1)
        # the splits must be host integers: a collective sizes its buffers before it runs
        sent, got = counts.view(ep, -1).sum(1).tolist(), by_source.sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(rows, got, sent, mesh)  # (M, C) by source rank, then expert
        slot = torch.arange(received.numel(), device=rows.device).repeat_interleave(received)  # (M,) (source, expert)
        order = (slot % by_source.shape[1]).argsort(stable=True)
        self.route = Route(sent, got, order)
        return rows[order], by_source.sum(0)

    def _combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """out (M, C) in this rank's expert order -> (N, C) in the order of the rows this rank dispatched."""
        route = self.route
        back = out[route.order.argsort()]  # (M, C) by source rank again
        return funcol.all_to_all_single_autograd(back, route.sent, route.received, mesh)


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Cut every weight of `module` along its first (experts) dimension over `mesh`."""
    for key, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


def apply_expert_parallel(modules: list[nn.Module], mesh: DeviceMesh) -> None:
    """Split each experts module in `modules` over the 1-D ep `mesh`, in place (on the meta device too)."""
    for module in modules:
        ExpertParallel()._apply(module, mesh)
