"""Document-masked attention: a window packed from several documents, given each token's position inside its
document, must score every document exactly as if it ran alone."""

import pytest
import torch

from lm.models.attention import SelfAttention, document_causal_mask
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from lm.models.layers import apply_rope, rope_angles, sinusoidal_positions
from lm.models.registry import get_family

ROPE16 = GPTConfig(d_model=16, n_head=1, pos="rope")  # rotary angles of 16-channel heads

VARIANTS = {
    "learned": dict(pos="learned"),
    "sinusoidal": dict(pos="sinusoidal", norm_position="post", mlp="relu"),
    "rope": dict(pos="rope"),
    "llama": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_head=4, n_kv_head=2, tie_embeddings=False),
}

# Two rows of a 20-token window with different boundaries. Row 0 starts mid-document (its first piece
# restarts at 0), then holds documents of 5, 2 and 6 tokens; row 1 holds 3, 9, 1 and 7.
DOC_LENGTHS = [[7, 5, 2, 6], [3, 9, 1, 7]]
T = 20


def tiny_model(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    fields = dict(vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=32, dropout=0.0)
    fields.update(overrides)
    return GPT(GPTConfig(**fields)).eval()


def logits_and_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor,
                    positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of idx and the family's loss of the batch (x, y[, positions])."""
    batch = [idx, targets] if positions is None else [idx, targets, positions]
    return model.logits(model(idx, positions)), get_family("gpt").training.loss(model, model, batch).optimized


def packed_positions(lengths: list[int]) -> torch.Tensor:
    """(sum(lengths),) positions restarting at 0 for every document."""
    return torch.cat([torch.arange(n) for n in lengths])


def test_document_causal_mask_by_hand() -> None:
    # documents [0, 1], [2], [3, 4, 5] in row 0; [0, 1, 2], [3, 4, 5] in row 1
    positions = torch.tensor([[0, 1, 0, 0, 1, 2], [0, 1, 2, 0, 1, 2]])
    expected_row0 = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    expected_row1 = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    mask = document_causal_mask(positions)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], expected_row0)
    assert torch.equal(mask[1, 0], expected_row1)


def test_one_document_mask_is_the_causal_triangle() -> None:
    mask = document_causal_mask(torch.arange(5)[None])
    assert torch.equal(mask[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())


def test_position_encodings_of_a_batch_equal_those_of_each_row() -> None:
    positions = torch.stack([packed_positions(lengths) for lengths in DOC_LENGTHS])  # (2, T)
    pe = sinusoidal_positions(positions, 32)
    cos, sin = rope_angles(positions, ROPE16)
    assert pe.shape == (2, T, 32) and cos.shape == sin.shape == (2, T, 16)
    x = torch.randn(2, 3, T, 16)
    rotated = apply_rope(x, cos, sin)
    for b in range(2):
        assert torch.equal(pe[b], sinusoidal_positions(positions[b], 32))
        row_cos, row_sin = rope_angles(positions[b], ROPE16)
        assert torch.equal(cos[b], row_cos) and torch.equal(sin[b], row_sin)
        assert torch.equal(rotated[b], apply_rope(x[b : b + 1], row_cos, row_sin)[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_documents_score_as_if_alone(variant: str) -> None:
    model = tiny_model(**VARIANTS[variant])
    torch.manual_seed(1)
    idx = torch.randint(0, 100, (2, T))
    targets = torch.randint(0, 100, (2, T))
    positions = torch.stack([packed_positions(lengths) for lengths in DOC_LENGTHS])  # (2, T)
    logits, loss = logits_and_loss(model, idx, targets, positions)

    losses, counts = [], []
    for b, lengths in enumerate(DOC_LENGTHS):
        start = 0
        for n in lengths:
            doc = slice(start, start + n)
            alone, doc_loss = logits_and_loss(model, idx[b : b + 1, doc], targets[b : b + 1, doc])
            torch.testing.assert_close(logits[b : b + 1, doc], alone, rtol=0, atol=1e-5)
            losses.append(doc_loss)
            counts.append(n)
            start += n
    weighted = sum(n * doc_loss for n, doc_loss in zip(counts, losses)) / sum(counts)
    torch.testing.assert_close(loss, weighted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_without_positions_nothing_changes(variant: str) -> None:
    model = tiny_model(**VARIANTS[variant])
    idx, targets = torch.randint(0, 100, (2, T)), torch.randint(0, 100, (2, T))
    logits, loss = logits_and_loss(model, idx, targets)
    logits_none = model.logits(model(idx, None))
    assert torch.equal(logits, logits_none)
    # one document filling the window: the masked path, so equal only to rounding
    one_doc = torch.arange(T).expand(2, T)
    logits_one, loss_one = logits_and_loss(model, idx, targets, one_doc)
    torch.testing.assert_close(logits_one, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss_one, loss, rtol=0, atol=1e-5)


def test_gradients_flow_through_the_mask_path_and_stay_inside_each_document() -> None:
    model = tiny_model(**VARIANTS["llama"]).train()
    idx = torch.randint(0, 100, (1, 12))
    positions = packed_positions([5, 7])[None]  # (1, 12)
    embedded = []
    model.wte.register_forward_hook(lambda module, args, out: embedded.append(out) or out.retain_grad())
    logits = model.logits(model(idx, positions=positions))
    logits[0, 5:].logsumexp(-1).sum().backward()  # a function of the second document's logits alone
    grad = embedded[0].grad  # (1, 12, C)
    assert grad[0, :5].abs().max() == 0  # nothing reaches the first document's tokens
    assert (grad[0, 5:].abs().amax(-1) > 0).all()

    model.zero_grad()
    _, loss = logits_and_loss(model, idx, torch.randint(0, 100, (1, 12)), positions)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.blocks[0].attn.q.weight.grad.abs().sum() > 0


def test_causal_self_attention_with_a_document_mask_keeps_documents_apart() -> None:
    torch.manual_seed(0)
    attn = SelfAttention(GPTConfig(n_head=2, d_model=16, dropout=0.0), causal=True)
    x = torch.randn(1, 7, 16)
    y = attn(x, mask=document_causal_mask(packed_positions([3, 4])[None]))
    torch.testing.assert_close(y[:, :3], attn(x[:, :3]), rtol=0, atol=1e-6)
    torch.testing.assert_close(y[:, 3:], attn(x[:, 3:]), rtol=0, atol=1e-6)


def test_positions_of_the_wrong_shape_are_refused() -> None:
    model = tiny_model()
    idx = torch.randint(0, 100, (2, 8))
    with pytest.raises(ValueError, match=r"positions has shape \(8,\); it must match idx, \(2, 8\)"):
        model(idx, positions=torch.arange(8))


def test_positions_with_a_cache_are_refused() -> None:
    model = tiny_model()
    idx = torch.randint(0, 100, (1, 8))
    positions = torch.arange(8)[None]
    with pytest.raises(ValueError, match="cannot be combined with a KV cache"):
        model(idx, positions=positions, cache=model.new_cache(1, 16))

