"""Mixed precision as the engines apply it: bf16 autocast where `lm.config.use_bf16` says so."""

import contextlib

import torch
import torch.nn as nn

from lm.config import JobConfig, use_bf16
from lm.errors import ConfigError


def autocast_for(cfg: JobConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast where `use_bf16` says so (on CUDA by default); plain fp32 otherwise."""
    if not use_bf16(cfg.train.dtype, device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def check_lstm_autocast(cfg: JobConfig, device: torch.device) -> None:
    """Refuse bf16 autocast of an LSTM on a CPU whose oneDNN cannot run it, before the first step would.

    CPU autocast hands nn.LSTM to oneDNN in bf16, which CPUs without bf16 support reject with an opaque
    "could not create a primitive descriptor"; a one-unit LSTM tells which kind of CPU this is.
    """
    if cfg.model.arch != "lstm" or device.type != "cpu" or not use_bf16(cfg.train.dtype, device.type):
        return
    with torch.device("meta"):  # uninitialised weights: the probe draws nothing from the RNG the run seeded
        probe = nn.LSTM(1, 1)
    probe.to_empty(device="cpu")
    try:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            probe(torch.zeros(1, 1, 1))
    except RuntimeError:
        raise ConfigError("train.dtype: bfloat16 autocasts model.arch=lstm to bf16, which this CPU's LSTM kernel "
                          "(oneDNN) cannot run; use train.dtype=float32 (or auto) on the CPU") from None
