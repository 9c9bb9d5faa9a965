"""The host copy an asynchronous checkpoint writes from: values, structure, tied tensors, reused buffers, DTensors."""

import pytest
import torch

from lm.distributed.host_copy import HostCopy
from tests.workers import pool


def test_a_copy_holds_the_values_of_the_call_in_buffers_the_next_call_refills():
    weight, step = torch.arange(6.0).reshape(2, 3), torch.tensor(3.0)
    state = {"model": {"wte": weight, "head": weight}, "optim": {"state": {0: {"step": step}},
                                                                 "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]}}
    host = HostCopy(pin_memory=False)
    first = host.copy(state)
    assert first["model"]["wte"] is first["model"]["head"]  # tied: one copy, as in the model
    assert first["model"]["wte"] is not weight and torch.equal(first["model"]["wte"], weight)
    assert first["optim"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.95)}]
    assert first["optim"]["state"][0]["step"].item() == 3.0
    weight.add_(1.0)  # training goes on: the copy keeps the saved step's values
    assert first["model"]["wte"][0, 0].item() == 0.0
    buffer = first["model"]["wte"].data_ptr()
    second = host.copy(state)
    assert second["model"]["wte"].data_ptr() == buffer and second["model"]["wte"][0, 0].item() == 1.0


def test_buffers_allocated_ahead_are_the_ones_the_copy_fills():
    weight, bias = torch.ones(4, 8), torch.zeros(8)
    state = {"model": {"w": weight, "tied": weight, "b": bias}}
    host = HostCopy(pin_memory=False)
    assert host.allocate(state) == (32 + 8) * 4  # the tied weight once
    held = {path: buffer.data_ptr() for path, buffer in host._buffers.items()}
    copied = host.copy(state)["model"]
    assert {("model", "w"): copied["w"].data_ptr(), ("model", "b"): copied["b"].data_ptr()} == held
    assert torch.equal(copied["w"], weight) and torch.equal(copied["b"], bias)


def copy_a_sharded_tensor() -> tuple[list[int], list[float], str, bool]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    # 5 rows over 2 ranks (FSDP2's shards of a dimension the ranks do not divide): 3 and 2
    uneven = distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)])
    copies = HostCopy(pin_memory=False).copy({"w": sharded, "u": uneven})
    copied, local = copies["w"], copies["w"].to_local()
    same = copies["u"].shape == uneven.shape and copies["u"].stride() == uneven.stride()
    return (list(copied.shape), local.flatten().tolist(), str(copied.placements),
            local.data_ptr() != sharded.to_local().data_ptr() and dist.get_world_size() == 2 and same
            and torch.equal(copies["u"].full_tensor(), torch.arange(10.0).reshape(5, 2)))


@pytest.mark.process
def test_a_dtensor_is_copied_as_a_dtensor_of_the_same_shards():
    replies = [r["value"] for r in pool(2).run(copy_a_sharded_tensor)]
    assert replies == [([4, 2], [0.0, 1.0, 2.0, 3.0], "(Shard(dim=0),)", True),
                       ([4, 2], [4.0, 5.0, 6.0, 7.0], "(Shard(dim=0),)", True)]


def test_a_tensor_whose_shape_or_dtype_changed_is_copied_into_a_buffer_of_its_own_kind():
    # the same key may come back as another tensor (a counter saved as an integer after a float, a resized
    # embedding): the copy holds the new tensor as it is, not cast or reshaped into the last save's buffer
    host = HostCopy(pin_memory=False)
    host.copy({"step": torch.tensor(1.5), "wte": torch.ones(2, 3)})
    step, wte = torch.tensor(7, dtype=torch.int64), torch.arange(12.0).reshape(3, 4)
    copied = host.copy({"step": step, "wte": wte})
    assert copied["step"].dtype == torch.int64 and copied["step"].item() == 7
    assert copied["wte"].shape == (3, 4) and torch.equal(copied["wte"], wte)


def test_allocating_ahead_reads_no_values():
    # allocate only makes the buffers (pinning takes seconds at scale, ahead of the first save): it copies
    # nothing, so tensors whose values do not exist yet (the meta device) are enough to size them
    host = HostCopy(pin_memory=False)
    assert host.allocate({"w": torch.empty(4, 8, device="meta"), "step": 3}) == 4 * 8 * 4
    copied = host.copy({"w": torch.ones(4, 8), "step": 3})
    assert torch.equal(copied["w"], torch.ones(4, 8)) and copied["step"] == 3
