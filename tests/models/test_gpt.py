import math
import re

import pytest
import torch
import torch.nn.functional as F

from lm.errors import ConfigError
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from lm.models.registry import get_family
from lm.models.sizes import block_params
from lm.plan.counts import num_params

GPT_FAMILY = get_family("gpt")


def tiny_config(**overrides: object) -> GPTConfig:
    fields = dict(vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=32)
    fields.update(overrides)
    return GPTConfig(**fields)


def tiny_model(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


def logits(model: GPT, idx: torch.Tensor, **kw: object) -> torch.Tensor:
    return model.logits(model(idx, **kw))


def loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss the family computes for a batch (x, y)."""
    return GPT_FAMILY.training.loss(model, model, [idx, targets]).optimized


def test_logits_cover_the_padded_vocabulary() -> None:
    model = tiny_model()
    assert model.cfg.padded_vocab_size == 128 and model.cfg.padded_vocab_size % 64 == 0
    assert GPTConfig(vocab_size=50257).padded_vocab_size == 50304
    assert GPTConfig(vocab_size=128).padded_vocab_size == 128
    h = model(torch.randint(0, 100, (3, 7)))
    assert h.shape == (3, 7, 32) and model.logits(h).shape == (3, 7, 128)


def test_changing_a_future_token_never_changes_earlier_logits() -> None:
    model = tiny_model()
    idx = torch.randint(0, 100, (2, 16))
    later = idx.clone()
    later[:, 10:] = (later[:, 10:] + 1) % 100
    before, after = logits(model, idx), logits(model, later)
    torch.testing.assert_close(after[:, :10], before[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, 10:], before[:, 10:])


def test_loss_is_mean_cross_entropy_in_float32() -> None:
    model = tiny_model()
    idx, targets = torch.randint(0, 100, (2, 9)), torch.randint(0, 100, (2, 9))
    out, mean = logits(model, idx), loss(model, idx, targets)
    log_probs = out.double().log_softmax(dim=-1)
    by_hand = -log_probs.gather(-1, targets[..., None]).mean()
    assert mean.dtype == torch.float32
    torch.testing.assert_close(mean.double(), by_hand, rtol=0, atol=1e-5)
    torch.testing.assert_close(mean, F.cross_entropy(out.view(18, -1), targets.view(18)))


def test_output_head_is_tied_to_token_embedding() -> None:
    model = tiny_model()
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()


def test_num_params_counted_by_hand() -> None:
    # V_pad=128, d=32, block=32, L=2, biases on
    wte, wpe = 128 * 32, 32 * 32
    block = (
        2 * 32  # ln_1
        + 3 * (32 * 32 + 32)  # q, k, v
        + 32 * 32 + 32  # attn proj
        + 2 * 32  # ln_2
        + 32 * 128 + 128  # mlp fc
        + 128 * 32 + 32  # mlp proj
    )
    ln_f = 2 * 32
    model = tiny_model()
    # parameters() yields the tied head once; the planner counts from the config alone
    assert sum(p.numel() for p in model.parameters()) == wte + wpe + 2 * block + ln_f == 30592
    assert num_params(model.cfg) == 30592
    assert num_params(model.cfg, non_embedding=True) == wte + 2 * block + ln_f == 29568


def test_no_biases_when_bias_is_false() -> None:
    model = tiny_model(bias=False)
    assert not [name for name, _ in model.named_parameters() if name.endswith("bias")]
    # without the 2*32 LayerNorm biases and the linear biases of the count above
    expected = 128 * 32 + 32 * 32 + 2 * (32 + 32 * 96 + 32 * 32 + 32 + 32 * 128 + 128 * 32) + 32
    assert sum(p.numel() for p in model.parameters()) == num_params(model.cfg) == expected


def test_init_statistics() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=1000, block_size=64, n_layer=8, n_head=4, d_model=256)
    model = GPT(cfg)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for block in model.blocks:
        assert block.attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.03)
        assert block.mlp.proj.weight.std().item() == pytest.approx(residual_std, rel=0.03)
        assert block.attn.k.weight.std().item() == pytest.approx(0.02, rel=0.03)
        assert block.mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.03)
        assert torch.equal(block.attn.v.bias, torch.zeros_like(block.attn.v.bias))
        assert torch.equal(block.ln_1.weight, torch.ones_like(block.ln_1.weight))
        assert torch.equal(block.ln_2.bias, torch.zeros_like(block.ln_2.bias))
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert model.wpe.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert model.wte.weight.mean().abs().item() < 1e-3


def test_meta_build_then_init_weights_matches_normal_build() -> None:
    cfg = tiny_config()
    torch.manual_seed(123)
    reference = GPT(cfg)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.wte.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(123)
    model.init_weights()
    assert model.lm_head.weight is model.wte.weight
    expected = reference.state_dict()
    actual = model.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    assert [p.shape for p in model.parameters()] == [p.shape for p in reference.parameters()]


VARIANTS = {
    "gpt2": {},
    "llama": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_head=4, n_kv_head=2, tie_embeddings=False),
    "sinusoidal-post-norm": dict(pos="sinusoidal", norm_position="post", mlp="relu"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_decode_logits_match_full_forward(variant: str) -> None:
    model = tiny_model(**VARIANTS[variant])
    idx = torch.randint(0, 100, (2, 12))
    full = logits(model, idx)
    cache = model.new_cache(batch_size=2, max_len=12)
    prefill = logits(model, idx[:, :6], cache=cache)
    steps = [logits(model, idx[:, t : t + 1], cache=cache) for t in range(6, 12)]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_multi_token_append_to_nonempty_cache_matches_full_forward(variant: str) -> None:
    model = tiny_model(**VARIANTS[variant])
    idx = torch.randint(0, 100, (2, 15))
    full = logits(model, idx)
    cache = model.new_cache(batch_size=2, max_len=20)
    parts = [logits(model, idx[:, a:b], cache=cache) for a, b in [(0, 5), (5, 9), (9, 10), (10, 15)]]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)


def test_llama_options_build_the_llama_layers() -> None:
    model = tiny_model(**VARIANTS["llama"])
    block = model.blocks[0]
    assert isinstance(block.ln_1, torch.nn.RMSNorm) and isinstance(model.ln_f, torch.nn.RMSNorm)
    assert not hasattr(model, "wpe")
    # 4 query heads, 2 key/value heads of 8
    assert block.attn.q.weight.shape == (4 * 8, 32) and block.attn.k.weight.shape == (2 * 8, 32)
    assert block.mlp.gate.weight.shape == block.mlp.fc.weight.shape == (128, 32)  # 8/3 * 32 rounded up to 64 -> 128
    assert model.lm_head.weight is not model.wte.weight
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.new_cache(1, 8).layers[0].k.shape == (1, 2, 8, 8)  # cached per key/value head


def test_rotary_attention_scores_depend_only_on_relative_position() -> None:
    from lm.models.layers import apply_rope, rope_angles

    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    def score(i: int, j: int) -> float:
        cos, sin = rope_angles(torch.tensor([i, j]), GPTConfig(d_model=16, n_head=2, pos="rope"))
        return float(apply_rope(q, cos[:1], sin[:1]) @ apply_rope(k, cos[1:], sin[1:]).transpose(-1, -2))
    assert score(3, 1) == pytest.approx(score(10, 8), abs=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)


def test_post_norm_has_no_final_norm_and_pre_norm_has_one() -> None:
    assert isinstance(tiny_model(norm_position="post").ln_f, torch.nn.Identity)
    assert isinstance(tiny_model().ln_f, torch.nn.LayerNorm)


def test_sequence_longer_than_block_size_raises() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="model.block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = model.new_cache(batch_size=1, max_len=40)
    model(torch.zeros(1, 30, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="model.block_size=32"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)


def test_overfits_one_batch() -> None:
    model = tiny_model()
    model.train()
    idx = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(1))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first_loss = loss(model, inputs, targets)
    for _ in range(40):
        step_loss = loss(model, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        step_loss.backward()
        optimizer.step()
    last_loss = loss(model, inputs, targets)
    assert first_loss.item() > 4.0
    assert last_loss.item() < first_loss.item() / 10


def test_qk_norm_normalises_each_heads_queries_and_keys_before_attention():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=1, n_head=2, d_model=32, qk_norm=True,
                          pos="rope"))
    attn = model.blocks[0].attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (16,)  # one weight over a head's channels
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, args, out: seen.update(q=out))
    attn.k_norm.register_forward_hook(lambda m, args, out: seen.update(k=out))
    model(torch.randint(0, 100, (2, 8)))
    for t in (seen["q"], seen["k"]):  # (B, heads, T, hs), each head's vector of unit root-mean-square
        assert t.shape[-1] == 16
        assert torch.allclose(t.pow(2).mean(-1), torch.ones(t.shape[:-1]), atol=5e-3)  # eps 1e-5 on small q, k
    no_norm = GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=1, n_head=2, d_model=32, pos="rope"))
    assert not hasattr(no_norm.blocks[0].attn, "q_norm")


def test_relu2_squares_the_relu():
    from lm.models.layers import MLP

    torch.manual_seed(0)
    mlp = MLP(GPTConfig(vocab_size=100, block_size=16, n_layer=1, n_head=2, d_model=8, mlp="relu2"))
    x = torch.randn(2, 3, 8)
    assert torch.allclose(mlp(x), mlp.proj(torch.relu(mlp.fc(x)) ** 2))


def test_logit_softcap_bounds_the_logits_and_chunks_the_same():
    fields = dict(vocab_size=100, block_size=16, n_layer=1, n_head=2, d_model=32)
    idx, targets = torch.randint(0, 100, (2, 8)), torch.randint(0, 100, (2, 8))
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**fields))
    torch.manual_seed(0)
    capped = GPT(GPTConfig(**fields, logit_softcap=0.5))
    raw = logits(plain, idx)
    out, mean = logits(capped, idx), loss(capped, idx, targets)
    assert torch.allclose(out, 0.5 * torch.tanh(raw / 0.5))  # the same weights, the logits squashed
    assert out.abs().max() < 0.5 and out.dtype == torch.float32
    assert mean.item() == pytest.approx(F.cross_entropy(out.view(16, -1), targets.view(-1)).item())
    with torch.no_grad():  # a decode step's head, (V, C) @ (C, B)
        sampled = capped.logits(capped(idx)[:, -1:])
    assert torch.allclose(sampled[:, 0], out[:, -1], atol=1e-6)
    torch.manual_seed(0)
    chunked = GPT(GPTConfig(**fields, logit_softcap=0.5, loss_chunk=5))
    assert loss(chunked, idx, targets).item() == pytest.approx(mean.item(), abs=1e-6)


@pytest.mark.parametrize("overrides", [
    dict(d_head=24, n_kv_head=2),
    dict(qk_norm=True, qk_norm_scope="all", n_kv_head=2, norm_position="output"),
    dict(qk_norm=True, d_head=12),
], ids=["d_head", "olmo2", "qwen3"])
def test_sizes_counted_from_the_config_match_the_built_model(overrides) -> None:
    cfg = tiny_config(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, **overrides)
    model = GPT(cfg)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())
    assert model.blocks[0].attn.q.out_features == cfg.n_head * cfg.head_dim


def test_output_norm_normalises_each_sublayers_output_before_the_residual_add() -> None:
    cfg = tiny_config(norm_position="output", pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    block = GPT(cfg).blocks[0]
    x = torch.randn(2, 8, cfg.d_model)
    with torch.no_grad():
        h = x + block.ln_1(block.attn(x))
        torch.testing.assert_close(block(x), h + block.ln_2(block.mlp(h)))


@pytest.mark.parametrize("overrides, fragment", [
    (dict(rope_scaling="yarn", pos="rope"), "model.rope_scaling: unknown value 'yarn'"),
    (dict(rope_scaling="linear"), "model.rope_scaling: linear scales rotary positions; it needs model.pos=rope"),
    (dict(rope_scaling="linear", pos="rope", rope_factor=0.0), "model.rope_factor: must be above 0"),
    (dict(rope_scaling="llama3", pos="rope", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0),
     "model.rope_low_freq_factor: must be above 0 and below model.rope_high_freq_factor"),
    (dict(qk_norm_scope="layer"), "model.qk_norm_scope: unknown value 'layer'"),
    (dict(d_head=-1), "model.d_head: must be >= 0"),
    (dict(nope_interval=2), "model.nope_interval: leaves rotary positions out of some layers; it needs model.pos=rope"),
])
def test_bad_rotary_and_head_settings_name_their_key(overrides, fragment) -> None:
    from lm.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(fragment)):
        tiny_config(**overrides)


def test_whole_projection_qk_norm_refuses_tensor_parallelism() -> None:
    cfg = tiny_config(qk_norm=True, qk_norm_scope="all", pos="rope")
    assert "model.qk_norm_scope=all" in GPT_FAMILY.parallel.tensor_problem(cfg, 2)
    assert GPT_FAMILY.parallel.tensor_problem(tiny_config(qk_norm=True, pos="rope"), 2) is None


def test_padded_vocab_size_rounds_up_to_the_next_multiple_only_when_needed():
    assert GPTConfig(vocab_size=50257).padded_vocab_size == 50304
    assert GPTConfig(vocab_size=128, vocab_multiple=64).padded_vocab_size == 128  # already a multiple: no padding
    assert GPTConfig(vocab_size=129, vocab_multiple=64).padded_vocab_size == 192
    assert GPTConfig(vocab_size=100, vocab_multiple=1).padded_vocab_size == 100


def test_derived_widths():
    cfg = GPTConfig(d_model=768, n_head=12, n_kv_head=4, mlp="swiglu")
    assert cfg.head_dim == 64 and cfg.kv_heads == 4  # head size from query heads, not key/value heads
    assert cfg.ff_dim == 2048  # 8/3 * 768 is already a multiple of 64
    assert GPTConfig(d_model=96, n_head=4, mlp="swiglu").ff_dim == 256  # 8/3 * 96 = 256
    assert GPTConfig(d_model=100, n_head=4, mlp="swiglu").ff_dim == 320  # 266 rounded up to 64
    assert GPTConfig(d_model=64, n_head=4, mlp="gelu").ff_dim == 256
    assert GPTConfig(d_model=64, n_head=4, d_head=32).head_dim == 32


def test_expert_width_defaults_to_the_dense_mlp_width():
    cfg = GPTConfig(d_model=96, n_head=4, mlp="swiglu", n_experts=4)
    assert cfg.expert_ff == cfg.ff_dim == 256
    assert GPTConfig(d_model=96, n_head=4, mlp="swiglu", n_experts=4, expert_d_ff=48).expert_ff == 48


def test_moe_layers_follow_first_dense_and_every():
    cfg = GPTConfig(n_layer=6, n_experts=4, moe_every=2, moe_first_dense=1)
    assert [cfg.moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    assert cfg.moe_layers == 2
    all_moe = GPTConfig(n_layer=3, n_experts=4)
    assert [all_moe.moe_layer(i) for i in range(3)] == [True, True, True] and all_moe.moe_layers == 3


def test_boundary_model_values():
    GPTConfig(n_experts=4, experts_per_token=4)  # every expert for every token is a valid (dense-like) mixture
    GPTConfig(d_model=100, n_head=3, d_head=32)  # with an explicit head size, n_head need not divide d_model
    with pytest.raises(ConfigError, match="model.d_model"):
        GPTConfig(d_model=100, n_head=3)
    with pytest.raises(ConfigError, match="rope needs an even head size"):
        GPTConfig(d_model=36, n_head=4, pos="rope")  # head size 9
    with pytest.raises(ConfigError, match="model.nope_interval"):
        GPTConfig(nope_interval=2)  # learned positions have no rotary to leave out


def test_context_parallel_estimate_counts_each_blocks_key_and_value_widths() -> None:
    # context parallelism all-gathers every block's keys and values: per token, the k and v projections' outputs
    for overrides in ({}, dict(n_head=4, n_kv_head=2), dict(d_head=24, n_kv_head=1)):
        cfg = tiny_config(pos="rope", **overrides)
        attn = GPT(cfg).blocks[0].attn
        assert GPT_FAMILY.estimates.context_kv(cfg) == attn.k.out_features + attn.v.out_features, overrides


def test_parameter_count_includes_query_key_value_biases_without_bias() -> None:
    # Qwen2's layout: no biases anywhere (bias false) but on the q, k and v projections (qkv_bias); the block size
    # the planner computes from the config alone must match the built block
    cfg = tiny_config(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True, n_kv_head=1)
    block = GPT(cfg).blocks[0]
    assert block.attn.q.bias is not None and block.attn.proj.bias is None
    assert block_params(cfg) == sum(p.numel() for p in block.parameters())


def test_every_target_id_counts_in_the_loss_token_0_included() -> None:
    # no target id is ignored: id 0 is an ordinary token (e.g. "!" in GPT-2's vocabulary), so the loss is the mean
    # over all B*T positions, those whose next token is 0 included
    model = tiny_model()
    idx = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    targets = torch.zeros(2, 9, dtype=torch.long)
    targets[:, ::2] = torch.arange(1, 6)
    out = logits(model, idx)
    by_hand = -out.double().log_softmax(dim=-1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(loss(model, idx, targets).double(), by_hand, rtol=0, atol=1e-5)
