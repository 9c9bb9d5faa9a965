"""The shared layers' norms under bf16 autocast: no dtype-mismatch fallback, fp32 unchanged, state dicts unchanged."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from lm.models.layers import RMSNorm, make_norm


@pytest.fixture
def every_warning():
    """Warnings recorded, torch's warn-once ones included (the mismatch warning is TORCH_WARN_ONCE, so an earlier
    test of the same process would otherwise hide it)."""
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.set_warn_always(before)


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_a_bf16_autocast_step_prints_no_dtype_mismatch_warning(norm, every_warning):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32, norm=norm, qk_norm=True,
                          pos="rope"))
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model(idx)  # (B, T, C)
        model.logits(h).float().sum().backward()
    assert not [w for w in every_warning if "Mismatch dtype" in str(w.message)]
    # the master weights and their gradients stay fp32 for the optimizer
    for p in (model.ln_f.weight, model.blocks[0].attn.q_norm.weight):
        assert p.dtype == p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0


def test_rmsnorm_in_float32_is_torchs_bit_for_bit():
    torch.manual_seed(0)
    ours, theirs = RMSNorm(24, eps=1e-5), nn.RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 24)
    assert torch.equal(ours(x), theirs(x))
    assert ours.state_dict().keys() == theirs.state_dict().keys() == {"weight"}


def test_rmsnorm_under_autocast_uses_the_weight_in_the_inputs_dtype():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 16).bfloat16()  # (N, C), as a linear's output under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    expected = F.rms_norm(x, (16,), norm.weight.bfloat16(), 1e-6)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
    assert norm.weight.dtype == torch.float32


def test_make_norm_keeps_the_isinstance_checks_of_init_and_weight_decay():
    rms = make_norm(GPTConfig(d_model=8, n_head=2, norm="rmsnorm"))
    ln = make_norm(GPTConfig(d_model=8, n_head=2, norm="layernorm"))
    assert isinstance(rms, nn.RMSNorm) and type(ln) is nn.LayerNorm
