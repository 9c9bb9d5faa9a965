"""The trainer's periodic sample: the model in training continues one fixed prompt (or fills its masks), the
same way each time."""

import contextlib

import torch

from lm.config import JobConfig
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.distributed.precision import autocast_for
from lm.models.family import Family, SampleOptions

TEMPERATURE = 0.8
TOP_K = 200


def sample_options(cfg: JobConfig, device: torch.device) -> SampleOptions:
    """log.sample_tokens new tokens (leaving the prompt at least one position) at a fixed temperature and top-k,
    seeded by train.seed so every rank draws the same tokens, and exactly that many: every rank takes the same
    number of steps, without waiting for each token to test it for the end of the text."""
    n = min(cfg.log.sample_tokens, cfg.model.block_size - 1)
    return SampleOptions(n, TEMPERATURE, TOP_K, None, cfg.train.seed, stop_at_end=False, device=device)


@torch.no_grad()
def periodic_sample(engine: Engine, family: Family, cfg: JobConfig, tokenizer, env: DistEnv) -> str:
    """log.sample_prompt as the family writes on from it, with the weights in training, on every rank.

    A sample through forward gathers a sharded model's blocks as in training; a family that samples through
    other methods has the whole weights gathered first. autocast: a bf16 FSDP forward meets a cache of the
    weights' dtype. Eager: compiled blocks would compile again for every cache length.
    """
    gathered = engine.full_weights() if family.sampler.outside_forward else contextlib.nullcontext()
    with gathered, autocast_for(cfg.train.dtype, env.device), torch.compiler.set_stance("force_eager"):
        return family.sampler.sample(engine.model, tokenizer, cfg.log.sample_prompt, sample_options(cfg, env.device))
