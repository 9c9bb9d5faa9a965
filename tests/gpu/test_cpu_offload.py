"""fsdp's parallel.cpu_offload on a GPU: skipped without CUDA (a CPU run refuses offload). FSDP2 offloads the
parameters alone; a buffer the forward reads (a mixture of experts' balancing bias) stays on the GPU."""

import pytest
import torch

from lm.config import load_config
from tests.gpu.steps import step_losses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MOE = ["--model.n_layer=2", "--model.n_head=4", "--model.d_model=128", "--model.block_size=128", "--model.pos=rope",
       "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.bias=false", "--model.n_experts=4",
       "--model.experts_per_token=2", "--model.expert_d_ff=128", "--model.router_bias_rate=0.01",
       "--data.seq_len=128", "--train.device=cuda", "--train.batch_size=4", "--train.micro_batch_size=4",
       "--parallel.engine=fsdp", "--optim.lr=3e-3", "--schedule.warmup_steps=0"]


def losses(flags: list[str], steps: int = 4) -> list[float]:
    return step_losses(load_config(None, [*MOE, *flags]), steps)


def test_an_offloaded_mixture_of_experts_trains_as_one_on_the_gpu():
    on_gpu, offloaded = losses([]), losses(["--parallel.cpu_offload=true"])
    assert offloaded == pytest.approx(on_gpu, rel=1e-3) and offloaded[-1] < offloaded[0]
