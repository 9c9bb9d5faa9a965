"""The asynchronous checkpoint's host copy on CUDA: pinned buffers filled by non-blocking copies, which `copy`
waits for (skipped without a CUDA GPU; the CPU side: tests/distributed/test_host_copy.py)."""

import pytest
import torch

from lm.distributed.host_copy import HostCopy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_pinned_copy_holds_the_values_of_its_call_and_the_next_call_refills_it():
    weight = torch.randn(4096, 4096, device="cuda")  # 64 MB: a copy long enough to be caught unfinished
    host = HostCopy(pin_memory=True)
    assert host.allocate({"w": weight, "tied": weight}) == 4096 * 4096 * 4
    first = host.copy({"w": weight, "tied": weight})["w"]
    assert first.is_pinned() and first.device.type == "cpu"
    assert torch.equal(first, weight.cpu())
    expected = weight.cpu()
    weight.mul_(2.0)  # training goes on, on the GPU
    assert torch.equal(first, expected)
    second = host.copy({"w": weight, "tied": weight})["w"]
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, weight.cpu())
