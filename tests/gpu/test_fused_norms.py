"""RMSNorm and QK-norm on a GPU under bf16 autocast: torch's fused kernel, no dtype-mismatch fallback, eager or
compiled. Skipped without CUDA (CI's CPU side is tests/models/test_layers.py)."""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class DispatchedOps(TorchDispatchMode):
    """Names of the aten ops a call reaches, after autocast and autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def tiny_model() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128, norm="rmsnorm", qk_norm=True,
                    pos="rope")
    return GPT(cfg).cuda()


def bf16_step(model: torch.nn.Module, forward) -> list[warnings.WarningMessage]:
    """One forward and backward under bf16 autocast; the warnings it raised, warn-once ones included."""
    idx = torch.randint(0, 256, (2, 64), device="cuda")
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.autocast("cuda", dtype=torch.bfloat16):
            warnings.simplefilter("always")
            forward(idx).float().sum().backward()
    finally:
        torch.set_warn_always(before)
    return [w for w in caught if "Mismatch dtype" in str(w.message)]


def test_rmsnorm_runs_the_fused_kernel_in_an_eager_bf16_step():
    model = tiny_model()
    with DispatchedOps() as seen:
        mismatches = bf16_step(model, lambda idx: model.logits(model(idx)))
    assert not mismatches
    assert any("_fused_rms_norm" in op for op in seen.ops), sorted(set(seen.ops))


def test_a_compiled_bf16_step_prints_no_dtype_mismatch_warning():
    model = tiny_model()
    compiled = torch.compile(model)
    assert not bf16_step(model, lambda idx: model.logits(compiled(idx)))
