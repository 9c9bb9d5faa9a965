"""The peak FLOP/s of known GPUs: with a family's training FLOPs per token (`lm.plan.counts.flops_per_token`), what
TFLOP/s and MFU are made of."""

import torch

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, matched against
# torch.cuda.get_device_name(); order matters where one name contains another.
PEAK_FLOPS = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("V100", 125e12),
]


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a known GPU, or None (CPUs and unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS:
        if key in name:
            return value
    return None
