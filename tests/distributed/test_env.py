"""The process group a run joins (`lm.distributed.env`)."""

import torch

from lm.distributed.env import group_backend


def test_cpu_offload_on_cuda_adds_a_cpu_backend_beside_nccl():
    # FSDP2's offloaded gradients are host DTensors whose norm is all-reduced where they are: a group of NCCL
    # alone ended the first step with "No backend type associated with device type cpu"
    cuda = torch.device("cuda", 0)
    assert group_backend(cuda, cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert group_backend(cuda) == "nccl"
    assert group_backend(torch.device("cpu")) == group_backend(torch.device("cpu"), cpu_offload=True) == "gloo"
