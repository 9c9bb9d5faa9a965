"""The output head and cross-entropy computed a chunk of positions at a time (`model.loss_chunk`).

At a 50k vocabulary the (B*T, V) logits, their float32 copy and the gradient of each are most of a small
model's peak memory. Here each chunk's head matmul and float32 cross-entropy run under non-reentrant
activation checkpointing: forward keeps only the chunk's scalar loss, and backward recomputes one chunk's
logits at a time, so at most one chunk's logits exist at once. The price is a second head matmul per chunk.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _summed_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                          targets: torch.Tensor) -> torch.Tensor:
    """Summed float32 cross-entropy of head(h) (n, V) against targets (n,); h (n, C)."""
    # Softmax over ~50k classes loses too much precision in bf16; compute the loss in float32.
    return F.cross_entropy(head(h).float(), targets, reduction="sum")


def chunked_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, targets: torch.Tensor,
                          chunk: int) -> torch.Tensor:
    """Mean float32 cross-entropy of the logits head(h) against targets, `chunk` positions at a time.

    h: (B, T, C) the head's input; targets: (B, T) ids; `head` maps (n, C) to logits (n, V), e.g. the
    model's output Linear (called as a module, so engines that gather weights in its hooks see the call).
    The positions are flattened to B*T and cut into chunks of `chunk` (the last may be shorter); the
    chunks' summed losses are added and divided by B*T, so the result is the plain mean up to the order
    of the float32 additions. Returns a float32 scalar.
    """
    C = h.shape[-1]
    # split, not slicing: its backward concatenates the chunks' gradients once instead of adding
    # a zero-padded (B*T, C) gradient per chunk
    pieces = zip(h.reshape(-1, C).split(chunk), targets.reshape(-1).split(chunk))  # each (n, C), (n,)
    total = sum(checkpoint(_summed_cross_entropy, head, h_chunk, t_chunk, use_reentrant=False)
                for h_chunk, t_chunk in pieces)
    return total / targets.numel()
