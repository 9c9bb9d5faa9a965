"""The KV caches: the static one points every layer at the next positions and gives a GPT the logits of a whole
forward, as the growing one does."""

import pytest
import torch

from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from lm.models.kv_cache import StaticKVCache


def test_advance_points_every_layer_at_the_next_positions_under_a_causal_mask():
    cache = StaticKVCache(n_layer=2, batch_size=1, n_head=1, max_len=5, head_dim=4)
    cache.advance(3)
    assert cache.positions.tolist() == [0, 1, 2] and cache.length == 3
    assert cache[1].mask.tolist() == [[True, False, False, False, False],
                                      [True, True, False, False, False],
                                      [True, True, True, False, False]]
    cache.advance(1)
    assert cache[0].positions.tolist() == [3] and cache[1].mask.tolist() == [[True, True, True, True, False]]
    assert cache[0].mask is cache[1].mask  # built once per forward, shared by the layers
    with pytest.raises(ValueError, match="KV cache overflow: 6 positions exceed its max_len=5"):
        cache.advance(2)
    assert cache.length == 4  # the refused advance moved nothing
    cache.reset()
    cache.advance(2)
    assert cache.positions.tolist() == [0, 1]


def test_write_stores_at_the_positions_and_returns_the_whole_storage():
    cache = StaticKVCache(n_layer=1, batch_size=2, n_head=1, max_len=4, head_dim=3)
    cache.advance(1)
    cache.advance(2)  # positions 1 and 2
    k = torch.arange(12.0).view(2, 1, 2, 3)  # (B, nkv, T, hs)
    all_k, all_v = cache[0].write(k, -k)
    assert all_k.shape == (2, 1, 4, 3) and all_k.data_ptr() == cache[0].k.data_ptr()
    torch.testing.assert_close(all_k[:, :, 1:3], k, rtol=0, atol=0)
    torch.testing.assert_close(all_v[:, :, 1:3], -k, rtol=0, atol=0)
    assert not all_k[:, :, [0, 3]].any()


@pytest.mark.parametrize("overrides", [
    {},
    dict(pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=1, qk_norm=True, bias=False, nope_interval=2),
    dict(pos="sinusoidal", norm_position="post"),
], ids=["gpt2", "llama-gqa-qknorm-nope", "sinusoidal-postnorm"])
def test_a_static_cache_gives_the_logits_of_a_whole_forward(overrides):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, **overrides)).eval()
    idx = torch.randint(0, 64, (2, 9))
    cache = model.new_static_cache(2, 12)
    with torch.no_grad():
        full = model.logits(model(idx))  # (B, T, V)
        cache.advance(6)
        steps = [model.logits(model(idx[:, :6], cache=cache))]  # the prompt: positions 0..5 at once
        for t in range(6, 9):
            cache.advance(1)
            steps.append(model.logits(model(idx[:, t:t + 1], cache=cache)))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_a_forward_of_more_tokens_than_the_cache_was_advanced_by_is_refused():
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32)).eval()
    cache = model.new_static_cache(1, 8)
    cache.advance(1)
    with pytest.raises(ValueError, match=r"advanced by 1 positions for 3 tokens; call cache.advance\(3\)"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="max_len=17 exceeds model.block_size=16"):
        model.new_static_cache(1, 17)


def test_a_static_cache_of_the_whole_block_size_decodes_a_full_window():
    # a cache of exactly block_size positions is the largest one the model can use, and must be accepted: decoding
    # all block_size positions through it gives the logits of one whole forward of the window
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16)).eval()
    idx = torch.randint(0, 64, (1, 8))
    cache = model.new_static_cache(1, 8)
    with torch.no_grad():
        full = model.logits(model(idx))
        cache.advance(5)
        steps = [model.logits(model(idx[:, :5], cache=cache))]
        for t in range(5, 8):
            cache.advance(1)
            steps.append(model.logits(model(idx[:, t:t + 1], cache=cache)))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
