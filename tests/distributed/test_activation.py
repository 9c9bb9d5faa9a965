import pytest
import torch
import torch.nn as nn

from lm.distributed.activation import checkpoint_blocks, compile_blocks
from lm.models.registry import config_class, family_of

KEYS = {"gpt": dict(n_head=2), "encdec": dict(n_head=2, n_sentinels=3, pos="sinusoidal"), "lstm": {}}


@pytest.mark.parametrize("arch", ["gpt", "encdec", "lstm"])
@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_gives_the_same_gradients_as_none(arch, every):
    cfg = config_class(arch)(vocab_size=100, block_size=16, n_layer=3, d_model=16, **KEYS[arch])
    family = family_of(cfg)
    batch = [torch.randint(0, 100, (2, 8)) for _ in range(3 if arch == "encdec" else 2)]
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = family.build(cfg)
        if wrap:
            blocks = 6 if arch == "encdec" else 3  # an LSTM's layers are its blocks
            assert checkpoint_blocks(family.blocks(model), every) == (blocks + every - 1) // every
        family.training.loss(model, model, batch).optimized.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()  # same names: checkpoints do not notice
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 2])
def test_a_checkpointed_block_is_compiled_too(every):
    """train.compile with activation checkpointing: torch keeps dynamo out of `checkpoint`'s own frame, so a
    block whose forward was that frame ran eager, without a word."""
    from torch._dynamo.utils import counters

    cfg = config_class("gpt")(vocab_size=100, block_size=16, n_layer=2, d_model=16, **KEYS["gpt"])
    family = family_of(cfg)
    torch.manual_seed(0)
    model = family.build(cfg)
    blocks = family.blocks(model)
    checkpoint_blocks(blocks, every)  # as the engines do: checkpointed first, then compiled
    compile_blocks(blocks)
    torch._dynamo.reset()
    counters.clear()
    family.training.loss(model, model, [torch.randint(0, 100, (2, 8)) for _ in range(2)]).optimized.backward()
    # identical blocks share a graph: every block checkpointed, one; only the first, one for each kind
    assert counters["stats"]["unique_graphs"] == (1 if every == 1 else 2), dict(counters["stats"])
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("every, chosen", [(0, []), (1, [0, 1, 2, 3, 4]), (2, [0, 2, 4]), (3, [0, 3])])
def test_checkpointing_wraps_exactly_every_nth_block_and_none_at_zero(every, chosen):
    # parallel.activation_checkpointing=0 (the default: off) checkpointing every block would recompute every
    # forward and train the same, so only which blocks were wrapped shows it
    blocks = [nn.Linear(2, 2) for _ in range(5)]
    plain = [block.forward for block in blocks]
    assert checkpoint_blocks(blocks, every) == len(chosen)
    wrapped = [i for i, block in enumerate(blocks) if block.forward != plain[i]]
    assert wrapped == chosen


class Counted(nn.Linear):
    """A linear layer that counts its forward calls."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_a_checkpointed_block_runs_its_forward_again_in_backward():
    # checkpointing saves memory by recomputing the block's forward during backward: a wrapper that only
    # called the forward would give the same gradients and keep every activation
    torch.manual_seed(0)
    blocks = [Counted(3, 3) for _ in range(3)]
    assert checkpoint_blocks(blocks, 2) == 2
    x = torch.randn(2, 3, requires_grad=True)
    for block in blocks:
        x = torch.tanh(block(x))
    assert [block.calls for block in blocks] == [1, 1, 1]
    x.sum().backward()
    assert [block.calls for block in blocks] == [2, 1, 2]  # blocks 0 and 2 recomputed, block 1 not
