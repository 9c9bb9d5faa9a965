"""Per-block wrappers applied from outside the model: activation checkpointing (recompute a block's
activations in backward) and torch.compile. The blocks are the model family's (`Family.blocks`)."""

import functools

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
        # non-reentrant checkpointing composes with FSDP2's hooks, autocast and keyword arguments
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(chosen)
