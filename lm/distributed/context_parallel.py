"""Context parallelism: each window's tokens split over the mesh's "cp" ranks, for sequences too long for one
device's activations.

The sequence is cut into 2 x cp equal slices and rank r holds slices r and 2cp-1-r, so every rank gets the same
share of the causal attention's work (the early slices attend to little, the late ones to much): the head-tail
balance of torch's `context_parallel`, and the same token-to-rank map (tests/distributed/test_context_parallel.py
checks it against torch's load balancer). Every attention layer gathers the keys and values of the whole sequence
from the group (`SelfAttention.kv_gather`), puts them in position order, and lets each local query see the keys
at or before its own position. That all-gather form runs on gloo and on CPU; torch's ring attention
(`context_parallel`) has handlers only for the CUDA kernels, and is not used.

The trunk's output is gathered back to the whole window, so the loss, evaluation and logging see whole windows
as without context parallelism. Every rank of a group then computes the same loss, and backward through the
gather adds the group's gradients for each rank's tokens: each rank's gradients are cp times its share, and FSDP2,
which shards over the data- and context-parallel ranks together and averages over them, brings them back to the
data-parallel mean.
"""

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from lm.models.attention import SequenceShard

__all__ = ["ContextParallel", "shard_indices"]

# torch 2.13 renamed torch 2.11's all_gather_tensor_autograd (which now warns that it is deprecated)
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def shard_indices(length: int, cp: int, rank: int) -> torch.Tensor:
    """The positions of a `length`-token window that context-parallel `rank` of `cp` holds: slices rank and
    2cp-1-rank of 2cp equal slices."""
    k = length // (2 * cp)
    return torch.cat([torch.arange(rank * k, (rank + 1) * k), torch.arange(length - (rank + 1) * k, length - rank * k)])


class ContextParallel:
    """Sets every attention layer of `model` to gather its keys and values over `mesh` (1-D, the "cp" ranks), and
    gives the forward that runs a rank's share of each window (`run`)."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh) -> None:
        self.group, self.cp, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.model = model
        self.order: torch.Tensor | None = None  # gathered tokens (rank order) -> position order
        for module in model.modules():
            if hasattr(module, "kv_gather"):
                module.kv_gather = self._gather_kv

    def _gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The group's `t` concatenated along the sequence dimension `dim`, in position order (differentiable:
        backward sums the group's gradients for each rank's part)."""
        whole = _all_gather_autograd(t.contiguous(), gather_dim=dim, group=self.group)
        return whole.index_select(dim, self.order)

    def _gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._gather(k, 2), self._gather(v, 2)  # (B, nkv, T, hs) each

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The trunk's output (B, T, C) for whole windows x (B, T), this rank computing its share of the tokens."""
        length = x.shape[1]
        idx = shard_indices(length, self.cp, self.rank).to(x.device)
        held = torch.cat([shard_indices(length, self.cp, r) for r in range(self.cp)]).to(x.device)
        self.order = torch.argsort(held)
        h = self.model(x[:, idx], shard=SequenceShard(idx, length))  # (B, T / cp, C)
        return self._gather(h, 1)
