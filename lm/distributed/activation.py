"""Per-block wrappers applied from outside the model: activation checkpointing (recompute a block's
activations in backward) and torch.compile. The blocks are the model family's (`Family.blocks`)."""

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def compile_blocks(blocks: list[nn.Module]) -> None:
    """torch.compile each repeated unit in place; the embeddings and head stay eager (the engines compile the
    loss with `lm.models.loss.compiled_loss`). Identical blocks share one compiled graph, so compiling costs
    one block's time, FSDP2's hooks between blocks stay outside the graphs, and on a CPU the demo steps faster
    than compiled whole (docs/benchmarks.md)."""
    for block in blocks:
        block.compile()


def checkpoint_blocks(blocks: list[nn.Module], every: int) -> int:
    """Checkpoint every `every`-th of `blocks` (1: all of them); returns how many are checkpointed.

    The block's forward is replaced on the instance rather than the block wrapped, so parameter names,
    and with them checkpoints, are the same with and without activation checkpointing.
    """
    chosen = blocks[::every] if every else []
    for block in chosen:
        block.forward = _checkpointed(block.forward)
    return len(chosen)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` recomputed in backward. A function of lm's own rather than a partial of `checkpoint`: a compiled
    block (`compile_blocks`) traces into this frame and turns the call into its checkpoint operator, where the
    frame of `checkpoint` itself, which torch keeps dynamo out of, left every checkpointed block eager."""

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        # non-reentrant checkpointing composes with FSDP2's hooks, autocast and keyword arguments
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed
