import dataclasses
import math

import pytest
import torch

from lm.models.attention import SelfAttention, attend, causal_mask
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from lm.models.kv_cache import KVCache, LayerKVCache

CFG = GPTConfig(vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=32)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Softmax attention written out: (B, nh, T, hs) queries at positions start.. over keys 0..start+T-1."""
    B, nh, T, hs = q.shape
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, nh, T, S)
    for i in range(T):
        scores[:, :, i, start + i + 1 :] = float("-inf")
    y = scores.softmax(dim=-1) @ v  # (B, nh, T, hs)
    return y.transpose(1, 2).reshape(B, T, nh * hs)


def test_causal_mask_is_bottom_right_triangle() -> None:
    expected = torch.tensor(
        [
            [True, True, True, True, False],
            [True, True, True, True, True],
        ]
    )
    assert torch.equal(causal_mask(2, start=3), expected)
    assert torch.equal(causal_mask(3, start=0), torch.ones(3, 3, dtype=torch.bool).tril())


def test_attend_matches_written_out_softmax_attention() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    torch.testing.assert_close(attend(q, k, v, is_causal=True), reference_attention(q, k, v, 0))


def test_attend_with_mask_after_cached_keys() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 3, 2, 4)
    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    y = attend(q, k, v, mask=causal_mask(2, start=3))
    torch.testing.assert_close(y, reference_attention(q, k, v, start=3))


def test_self_attention_output_shape_and_no_future_leak() -> None:
    torch.manual_seed(0)
    attn = SelfAttention(CFG, causal=True).eval()
    x = torch.randn(2, 8, CFG.d_model)
    y = attn(x)
    assert y.shape == (2, 8, CFG.d_model)
    x2 = x.clone()
    x2[:, 5:] = torch.randn(2, 3, CFG.d_model)
    torch.testing.assert_close(attn(x2)[:, :5], y[:, :5], rtol=0, atol=1e-6)


def test_self_attention_with_cache_in_chunks_equals_full() -> None:
    torch.manual_seed(0)
    attn = SelfAttention(CFG, causal=True).eval()
    x = torch.randn(2, 10, CFG.d_model)
    full = attn(x)
    cache = LayerKVCache(2, CFG.n_head, 16, CFG.head_dim)
    # prefill (is_causal), a multi-token append (explicit mask), a single-token decode (no mask)
    chunks = [attn(x[:, a:b], cache=cache) for a, b in ((0, 4), (4, 7), (7, 8), (8, 10))]
    assert cache.length == 10
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)


def test_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=32, dropout=0.5)
    attn = SelfAttention(cfg, causal=True)
    x = torch.randn(1, 6, cfg.d_model)
    assert not torch.equal(attn(x), attn(x))
    attn.eval()
    assert torch.equal(attn(x), attn(x))


def test_layer_cache_append_returns_all_positions_so_far() -> None:
    cache = LayerKVCache(batch_size=1, n_head=2, max_len=4, head_dim=3)
    k1, v1 = torch.ones(1, 2, 3, 3), 2 * torch.ones(1, 2, 3, 3)
    k, v = cache.append(k1, v1)
    assert cache.length == 3 and k.shape == (1, 2, 3, 3)
    k, v = cache.append(3 * torch.ones(1, 2, 1, 3), 4 * torch.ones(1, 2, 1, 3))
    assert cache.length == 4 and k.shape == (1, 2, 4, 3)
    assert torch.equal(k[:, :, :3], k1) and torch.equal(v[:, :, :3], v1)
    assert k[0, 0, 3, 0].item() == 3.0 and v[0, 1, 3, 2].item() == 4.0
    with pytest.raises(ValueError, match="max_len=4"):
        cache.append(torch.ones(1, 2, 1, 3), torch.ones(1, 2, 1, 3))


def test_kv_cache_is_preallocated_per_layer() -> None:
    cache = KVCache(n_layer=3, batch_size=2, n_head=4, max_len=7, head_dim=5, dtype=torch.float64)
    assert cache.length == 0 and cache.max_len == 7
    assert len(cache.layers) == 3
    assert cache[1].k.shape == (2, 4, 7, 5) and cache[1].v.dtype == torch.float64
    assert cache[0].k.data_ptr() != cache[1].k.data_ptr()


def test_a_state_dict_with_a_fused_qkv_loads_as_the_three_projections():
    """Checkpoints saved before q, k and v were separate hold one `qkv` of rows [q; k; v]. Grouped-query, k and v
    are the same size, so a swap would load without a complaint."""
    cfg = dataclasses.replace(CFG, n_head=4, n_kv_head=2, pos="rope", qkv_bias=True)
    torch.manual_seed(0)
    saved = GPT(cfg).eval()
    fused = {}
    for name, value in saved.state_dict().items():
        prefix, _, part = name.rpartition(".")
        if prefix.endswith(".attn.q"):
            split = [saved.state_dict()[f"{prefix[:-1]}{p}.{part}"] for p in "qkv"]
            fused[f"{prefix[:-1]}qkv.{part}"] = torch.cat(split)
        elif not prefix.endswith((".attn.k", ".attn.v")):
            fused[name] = value
    torch.manual_seed(1)
    loaded = GPT(cfg).eval()
    loaded.load_state_dict(fused)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded.logits(loaded(x)), saved.logits(saved(x)))
