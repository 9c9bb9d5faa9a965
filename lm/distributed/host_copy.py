"""The host copy of a state dict that an asynchronous checkpoint writes from, its memory kept between saves.

torch's `DefaultStager` does the same, but in torch 2.11 (which GPU images still ship) it clears its dispatch table
after each call, so the second save of a run failed (`KeyError: <class 'type'>`) and every save would pin its
memory anew.
"""

import torch
from torch.distributed.tensor import DTensor


class HostCopy:
    """Copies a state dict (nested dicts, lists and tuples of tensors and plain values) into host buffers made at
    the first call and refilled at the next ones: pinned and filled by non-blocking copies when `pin_memory` (CUDA),
    so one synchronize waits for them all. A DTensor comes back as a DTensor of the same mesh, placements and
    global shape whose local tensor is the host buffer, so DCP writes the same shards from it."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[tuple, torch.Tensor] = {}
        """Each tensor's buffer, by its path of keys in the state dict"""

    def allocate(self, state: dict) -> int:
        """Make the buffers `copy(state)` fills, copying nothing: pinning host memory takes seconds at billions of
        parameters (several GB a second), which the first save would otherwise wait for. The bytes held."""
        self._copy(state, (), {}, fill=False)
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def copy(self, state: dict) -> dict:
        """`state` with every tensor replaced by its host copy; returns once the copies have ended. The copy stays
        valid until the next call."""
        copied = self._copy(state, (), {}, fill=True)
        if self.pin_memory:
            torch.cuda.synchronize()
        return copied

    def _copy(self, value: object, path: tuple, seen: dict[int, torch.Tensor], fill: bool) -> object:
        if isinstance(value, dict):
            return {key: self._copy(item, (*path, key), seen, fill) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._copy(item, (*path, i), seen, fill) for i, item in enumerate(value))
        if not isinstance(value, torch.Tensor):
            return value  # numbers, strings, None: nothing training changes in place
        if id(value) in seen:  # a tied weight, under two keys: one copy, as in the model
            return seen[id(value)]
        local = value.to_local() if isinstance(value, DTensor) else value
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            # pinned memory comes from torch's caching host allocator, whose blocks are powers of two (as much as
            # twice the state's size, pinned). Page-locking plain memory in place (cudaHostRegister) would not
            # round, but two buffers sharing a page cannot both be registered.
            buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.pin_memory)
            self._buffers[path] = buffer
        if fill:
            buffer.copy_(local, non_blocking=self.pin_memory)
        if isinstance(value, DTensor):
            buffer = DTensor.from_local(buffer, value.device_mesh, value.placements, run_check=False,
                                        shape=value.shape, stride=value.stride())
        seen[id(value)] = buffer
        return buffer
