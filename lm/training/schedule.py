"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

import math

from lm.config import ScheduleConfig


def lr_at(step: int, peak_lr: float, cfg: ScheduleConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Warmup rises linearly so that step 0 already takes a small non-zero step; the cosine then falls
    from `peak_lr` at the end of warmup to `min_lr_ratio * peak_lr` at `decay_steps` (default: the
    last training step) and stays there.
    """
    min_lr = cfg.min_lr_ratio * peak_lr
    if step < cfg.warmup_steps:
        return peak_lr * (step + 1) / cfg.warmup_steps
    decay_end = cfg.decay_steps or total_steps
    if step >= decay_end:
        return min_lr
    progress = (step - cfg.warmup_steps) / max(1, decay_end - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak_lr - min_lr)
