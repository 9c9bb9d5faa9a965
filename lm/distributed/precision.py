"""Mixed precision as the engines apply it: bf16 autocast where `lm.config.use_bf16` says so."""

import contextlib

import torch

from lm.config import use_bf16


def autocast_for(dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast where `use_bf16` says so of train.dtype `dtype` (on CUDA by default); plain fp32 otherwise."""
    if not use_bf16(dtype, device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
