"""train.float8 with torchao's real float8 kernels: skipped without a CUDA GPU of compute capability 8.9 or later
(the CPU side, emulated: tests/distributed/test_float8.py)."""

import pytest
import torch

from lm.config import load_config
from tests.gpu.steps import step_losses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU of compute capability 8.9 or later")

TINY = ["--model.n_layer=2", "--model.n_head=4", "--model.d_model=128", "--model.block_size=128",
        "--data.seq_len=128", "--train.device=cuda", "--train.batch_size=8", "--train.micro_batch_size=8",
        "--train.dtype=bfloat16", "--optim.lr=3e-3", "--schedule.warmup_steps=0"]


def losses(flags: list[str], steps: int = 10) -> list[float]:
    """Training losses of `steps` steps on one fixed random batch, from train.seed's weights."""
    return step_losses(load_config(None, [*TINY, *flags]), steps)


@pytest.mark.parametrize("flags", [["--parallel.engine=fsdp", "--train.float8=tensorwise"],
                                   ["--parallel.engine=ddp", "--train.float8=rowwise"]], ids=["fsdp-tensorwise",
                                                                                               "ddp-rowwise"])
def test_float8_steps_follow_bf16s(flags):
    engine = flags[0]
    bf16, fp8 = losses([engine]), losses(flags)
    assert fp8[0] == pytest.approx(bf16[0], rel=0.02)  # the same weights, float8 rounding
    assert fp8[-1] < fp8[0] - 0.5 and fp8[-1] == pytest.approx(bf16[-1], rel=0.1)
