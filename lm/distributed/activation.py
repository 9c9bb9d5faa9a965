"""Per-block wrappers applied from outside the model: activation checkpointing (recompute a block's
activations in backward) and torch.compile."""

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated units, in order: a GPT's or an encoder-decoder's transformer blocks, an LSTM's layers."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    if hasattr(model, "layers"):
        return list(model.layers)
    return [*model.encoder, *model.decoder]


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each repeated unit in place; the embeddings, head and loss stay eager. Identical blocks
    share one compiled graph, so compiling costs one block's time, FSDP2's hooks between blocks stay
    outside the graphs, and on a CPU the demo steps faster than compiled whole (docs/benchmarks.md)."""
    for block in model_blocks(model):
        block.compile()


def checkpoint_blocks(model: nn.Module, every: int) -> int:
    """Checkpoint every `every`-th block (1: all of them); returns how many blocks are checkpointed.

    The block's forward is replaced on the instance rather than the block wrapped, so parameter names,
    and with them checkpoints, are the same with and without activation checkpointing.
    """
    blocks = model_blocks(model)[::every] if every else []
    for block in blocks:
        # non-reentrant checkpointing composes with FSDP2's hooks, autocast and keyword arguments
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(blocks)
