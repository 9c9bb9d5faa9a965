"""The loss of a next-token model's output head: cross-entropy, optionally with the z-loss term, whole or a
chunk of positions at a time (`model.loss_chunk`).

At a 50k vocabulary the (B*T, V) logits, their float32 copy and the gradient of each are most of a small
model's peak memory. Chunked, each chunk's head matmul and float32 loss run under non-reentrant activation
checkpointing: forward keeps only the chunk's summed loss, and backward recomputes one chunk's logits at a
time, so at most one chunk's logits exist at once. The price is a second head matmul per chunk.

The z-loss term (optim.z_loss) is the mean of log Z^2, Z the softmax's normaliser at each position: it pulls
the logits' log-partition towards 0, which keeps them from drifting large. The logsumexp is computed beside
the cross-entropy rather than shared with it, so both also run on logits split over the vocabulary.

Inside `compiled_loss()` (train.compile) the float32 cast and the cross-entropy run as one torch.compile'd
graph: eager, they read and write the (B*T, V) logits several times over, which at GPT-2's size was a fifth
of a compiled training step on an H100 (docs/benchmarks.md).
"""

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lm.models.terms import Losses, mean_terms

_compiling = False  # inside compiled_loss()


@contextlib.contextmanager
def compiled_loss(enabled: bool = True) -> Iterator[None]:
    """Inside the block (when `enabled`), the losses below run their float32 part compiled."""
    global _compiling
    before, _compiling = _compiling, enabled
    try:
        yield
    finally:
        _compiling = before


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


def _maybe_compiled(fn: Callable) -> Callable:
    return _compiled(fn) if _compiling else fn


def _summed_loss(logits: torch.Tensor, targets: torch.Tensor, with_z: bool) -> torch.Tensor:
    """Summed float32 cross-entropy of logits (n, V) against targets (n,); with_z: (2,) the sums of the
    cross-entropy and of log Z^2."""
    # Softmax over ~50k classes loses too much precision in bf16; compute the loss in float32.
    logits = logits.float()
    if not with_z:
        return F.cross_entropy(logits, targets, reduction="sum")
    # cross_entropy rather than log_z - logits[target]: logits split over the vocabulary (tensor parallelism)
    # cannot be indexed by target, while cross_entropy and logsumexp reduce over the split
    log_z = torch.logsumexp(logits, dim=-1)  # (n,)
    return torch.stack([F.cross_entropy(logits, targets, reduction="sum"), log_z.square().sum()])


def head_loss(logits: torch.Tensor, targets: torch.Tensor, with_z: bool = False) -> torch.Tensor:
    """Mean float32 cross-entropy of logits (B, T, V) against targets (B, T); with_z: (2,) the means of
    the cross-entropy and of log Z^2."""
    return _maybe_compiled(_mean_loss)(logits, targets, with_z)


def _mean_loss(logits: torch.Tensor, targets: torch.Tensor, with_z: bool) -> torch.Tensor:
    logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)  # (B*T, V), (B*T,)
    if not with_z:
        return F.cross_entropy(logits.float(), targets)
    return _summed_loss(logits, targets, with_z) / targets.numel()


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, targets: torch.Tensor,
                with_z: bool, summed: Callable) -> torch.Tensor:
    return summed(head(h), targets, with_z)


def chunked_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, targets: torch.Tensor,
                          chunk: int, with_z: bool = False) -> torch.Tensor:
    """`head_loss` of the logits head(h), `chunk` positions at a time.

    h: (B, T, C) the head's input; targets: (B, T) ids; `head` maps (n, C) to logits (n, V), e.g. the
    model's output Linear (called as a module, so engines that gather weights in its hooks see the call).
    The positions are flattened to B*T and cut into chunks of `chunk` (the last may be shorter); the
    chunks' summed losses are added and divided by B*T, so the result is the plain mean up to the order
    of the float32 additions.
    """
    C = h.shape[-1]
    # split, not slicing: its backward concatenates the chunks' gradients once instead of adding
    # a zero-padded (B*T, C) gradient per chunk
    pieces = zip(h.reshape(-1, C).split(chunk), targets.reshape(-1).split(chunk))  # each (n, C), (n,)
    # the loss function is chosen now: backward's recomputation runs outside compiled_loss() and must repeat it
    summed = _maybe_compiled(_summed_loss)
    total = sum(checkpoint(_chunk_loss, head, h_chunk, t_chunk, with_z, summed, use_reentrant=False)
                for h_chunk, t_chunk in pieces)
    return total / targets.numel()


def next_token_loss(logits: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, targets: torch.Tensor,
                    chunk: int = 0, with_z: bool = False) -> torch.Tensor:
    """`head_loss` of the logits of hidden states h (B, T, C) against targets (B, T): whole, or with `chunk`
    > 0 `chunk` positions at a time (`chunked_cross_entropy`), the full logits never built."""
    if chunk:
        return chunked_cross_entropy(logits, h, targets, chunk, with_z)
    return head_loss(logits(h), targets, with_z)


def cross_entropy_terms(loss: torch.Tensor, weight: float, z_loss: float = 0.0) -> Losses:
    """A cross-entropy as named terms (`lm.models.terms`) over `weight` targets: "loss", the scalar `loss`; with
    z_loss, `loss` is the (2,) pair of `head_loss(..., with_z=True)`, and the terms add "z_loss" (its mean log
    Z^2) and the optimized "objective", cross-entropy + z_loss * mean log Z^2."""
    if not z_loss:
        return Losses(mean_terms(weight, loss=loss))
    objective = loss[0] + z_loss * loss[1]
    return Losses(mean_terms(weight, loss=loss[0], z_loss=loss[1], objective=objective), objective="objective")
