"""The peak FLOP/s of known GPUs: with a family's training FLOPs per token (`lm.plan.counts.flops_per_token`), what
TFLOP/s and MFU are made of."""

import re

import torch

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, matched against the words of
# torch.cuda.get_device_name() ("NVIDIA A100-SXM4-80GB"); the first that matches wins, so a longer name comes first.
PEAK_FLOPS = [
    ("GH200", 989e12),
    # the NVL cards: 1,671 TFLOP/s with sparsity on the datasheet, half of it dense; not the SXM's 989
    ("H200 NVL", 835e12),
    ("H100 NVL", 835e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("V100", 125e12),
]


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a known GPU, or None (CPUs and unlisted GPUs)."""
    if device.type != "cuda":
        return None
    return peak_of(torch.cuda.get_device_name(device))


def peak_of(name: str) -> float | None:
    """The peak of the GPU that `name` names, matched as whole words: an L40 is not an L4, an A10G not an A10."""
    for key, value in PEAK_FLOPS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            return value
    return None
