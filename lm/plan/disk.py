"""What a checkpoint of a config writes to disk, for the run directory's space probe."""

from lm.config import JobConfig
from lm.plan.counts import num_params

_MARGIN = 1.02
"""DCP and DeepSpeed store each tensor with its own header and write metadata files: about 2 KiB a tensor."""
_FIXED = 2 * 2**20
"""config.yaml, state.json, manifest.json, the RNG states: a few KiB; the rest is headroom for small models."""


def checkpoint_bytes(cfg: JobConfig) -> int:
    """Bytes of one checkpoint of `cfg` (all ranks' files together), an upper estimate.

    ddp and fsdp: fp32 weights and AdamW's two fp32 moments, 12 bytes a parameter, and the tied output head's
    weight a second time (the model's state dict names it under both names). deepspeed: its module states
    (fp32 weights, or bf16 ones beside an fp32 master copy) and the two moments: 16 bytes a parameter in
    float32 (measured: 16.02 for ZeRO-1), 14 in bf16, the tied head stored once.
    """
    model = cfg.model
    n = num_params(model)
    if cfg.parallel.engine == "deepspeed":
        raw = 16 * n
    else:
        tied = model.padded_vocab_size * model.d_model if model.tie_embeddings else 0
        raw = 12 * n + 4 * tied
    return int(raw * _MARGIN) + _FIXED
