"""Muon: momentum whose update is orthogonalised by a Newton-Schulz iteration, for the hidden weight matrices;
AdamW for every other parameter, in the same optimizer (one state dict, one checkpoint).

A matrix's update is its Nesterov momentum with every singular value pushed towards 1: the step moves all
directions of the matrix alike instead of mostly its few dominant ones. Under FSDP2 each rank holds rows of
a matrix, and orthogonalising rows alone is a different map, so every rank gathers each whole momentum
matrix, orthogonalises it and keeps its own rows; under DDP the ranks split the matrices between them
(see `Muon._orthogonalised`).
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adam import adam

# Coefficients of the quintic a*X + b*(X X^T) X + c*(X X^T)^2 X, chosen so that 5 iterations move every
# singular value in (0, 1] into roughly [0.7, 1.2] (fast rather than exact: the step only needs the
# directions; exact convergence would take many more iterations from small singular values).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """An approximately orthogonal matrix with g's singular vectors: about U V^T for g = U S V^T; g (m, n).

    Computes in bfloat16 on CUDA (the iteration tolerates it and it is the fast path there), float32
    elsewhere; returns g's dtype.
    """
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    wide = x.shape[0] <= x.shape[1]
    if not wide:  # iterate on the (min, min) Gram matrix, the cheaper side
        x = x.mT
    x = x / (x.norm() + 1e-7)  # the Frobenius norm bounds the spectral norm: singular values now in (0, 1]
    for _ in range(steps):
        gram = x @ x.mT  # (m, m)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).to(g.dtype)


class Muon(torch.optim.AdamW):
    """AdamW over the groups without `muon: True`, exactly as torch.optim.AdamW steps them; Muon over those
    with it, which hold 2-D matrices and take `momentum` and `ns_steps`.

    Each Muon matrix p (m, n) with gradient g keeps one state tensor, `momentum_buffer` b:
        b <- momentum * b + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * b              (Nesterov)
        p <- p * (1 - lr * weight_decay) - lr * sqrt(max(1, m / n)) * newton_schulz(u)
    The sqrt factor keeps the per-element size of a tall matrix's update that of a square one's.

    Like the fused AdamW it skips a step on the device: where `found_inf` (set before `step`) is 1, no
    weight, moment or buffer changes, and the host never waits for the gradient norm.
    """

    def __init__(self, params, momentum: float, ns_steps: int, world_size: int = 1, rank: int = 0, **adamw) -> None:
        super().__init__(params, **adamw)
        self.world_size, self.rank = world_size, rank  # of the default process group: the ranks share the work
        for group in self.param_groups:
            if group.setdefault("muon", False):
                group.setdefault("momentum", momentum)
                group.setdefault("ns_steps", ns_steps)
                if any(p.dim() != 2 for p in group["params"]):
                    raise ValueError("Muon: a muon group holds 2-D matrices only")

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        applied = None if found_inf is None else found_inf == 0  # 0-dim bool on the device
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group, applied)
            else:
                self._adamw_step(group, found_inf)
        return None

    def _adamw_step(self, group: dict, found_inf: torch.Tensor | None) -> None:
        """torch's AdamW step over one group (torch.optim.Adam.step's body for a single group)."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
            has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
            differentiable=group["differentiable"], fused=group["fused"], found_inf=found_inf,
            decoupled_weight_decay=True,
        )

    def _muon_step(self, group: dict, applied: torch.Tensor | None) -> None:
        momentum, lr = group["momentum"], group["lr"]
        params = [p for p in group["params"] if p.grad is not None]
        buffers, nesterov = [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)  # a DTensor like p under FSDP2
                # steps applied, as AdamW keeps it (and torch's AdamW expects of every state it loads)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["step"] += 1 if applied is None else applied
            buffers.append(state["momentum_buffer"].lerp(p.grad, 1 - momentum))
            nesterov.append(p.grad.lerp(buffers[-1], momentum))
        for p, new_buf, update in zip(params, buffers, self._orthogonalised(nesterov, group["ns_steps"])):
            m, n = p.shape
            new_p = p.mul(1 - lr * group["weight_decay"]).sub_(update, alpha=lr * max(1.0, m / n) ** 0.5)
            for old, new in ((self.state[p]["momentum_buffer"], new_buf), (p, new_p)):
                old, new = _local(old), _local(new)
                old.copy_(new if applied is None else torch.where(applied, new, old))

    def _orthogonalised(self, updates: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
        """newton_schulz of each whole matrix.

        Replicated matrices (ddp) on several ranks: rank r orthogonalises matrices r, r + world, ... and
        broadcasts each result, so the ranks share the work instead of all repeating it (every rank holds
        the same reduced gradients, so the owner's result is everyone's).

        Sharded matrices (fsdp: DTensors of rows): every rank gathers each whole matrix, orthogonalises
        it and keeps its own rows. That repeats the Newton-Schulz work on every rank, but needs only the
        one all-gather per matrix (as much traffic as FSDP2's gather of the weights); owners would need
        a second exchange to scatter each result back to the ranks holding its rows. The repeated work is
        small where FSDP is used: 5 iterations of three matmuls, ~1.5e12 FLOPs per step at GPT-2 124M
        against ~4e17 for the forward and backward of a 0.5M-token batch.
        """
        if updates and isinstance(updates[0], DTensor):
            return [distribute_tensor(newton_schulz(u.full_tensor(), steps), u.device_mesh, u.placements,
                                      src_data_rank=None)  # no traffic: each rank slices its rows
                    for u in updates]
        if self.world_size == 1:
            return [newton_schulz(u, steps) for u in updates]
        owners = [i % self.world_size for i in range(len(updates))]
        results = [newton_schulz(u, steps) if owner == self.rank else torch.empty_like(u)
                   for u, owner in zip(updates, owners)]
        for work in [dist.broadcast(r, src=owner, async_op=True) for r, owner in zip(results, owners)]:
            work.wait()
        return results


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of t: the local shard of a DTensor (sharing its storage), t itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t
