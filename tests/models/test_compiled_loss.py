"""`compiled_loss`: inside it the float32 cross-entropy (and z-loss) runs torch.compile'd, with the same values and
gradients as eager, whole and chunked; chunked, backward's recomputation happens after the block has closed."""

import pytest
import torch

from lm.models.loss import compiled_loss, next_token_loss


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 24])  # 24 does not divide the 2 x 20 positions: a shorter last chunk
@pytest.mark.parametrize("with_z", [False, True])
def test_the_compiled_loss_matches_eager_in_value_and_gradient(chunk, with_z):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 97, bias=False)
    h = torch.randn(2, 20, 16)  # (B, T, C)
    targets = torch.randint(0, 97, (2, 20))

    def run(compiled: bool):
        x = h.clone().requires_grad_()
        head.zero_grad()
        with compiled_loss(compiled):
            loss = next_token_loss(head, x, targets, chunk, with_z)
        loss.sum().backward()  # outside the block, as the engines' backward of a chunked loss recomputes
        return loss.detach(), x.grad, head.weight.grad.clone()

    eager = run(False)
    calls = torch._dynamo.utils.counters["stats"]["calls_captured"]
    compiled = run(True)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > calls  # it was traced
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


def test_the_block_restores_what_was_there():
    import lm.models.loss as loss

    with compiled_loss(True):
        with compiled_loss(False):
            assert not loss._compiling
        assert loss._compiling
    assert not loss._compiling
