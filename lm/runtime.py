"""Process-wide settings that make CPU training fast; no effect on results."""

import ctypes
import ctypes.util
import logging

import torch

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def tune_cpu() -> None:
    """Flush denormals and keep freed memory in the heap.

    Denormal weights and gradients make CPU matmuls 10-20x slower after a few AdamW steps. And glibc
    serves every allocation over 32 MiB (logits over a 50k vocabulary are hundreds of MiB) with a fresh
    mmap that it unmaps on free, so every step page-faults and zeroes those tensors again: measured
    here as a third of a small GPT's step time. Serving them from the heap, and never trimming it,
    lets the next step reuse the same pages.
    """
    torch.set_flush_denormal(True)
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):  # not glibc (musl, macOS): keep the allocator's defaults
        return
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**30 - 1)):
        log.warning("could not tune the C allocator; CPU steps may be slower")
