"""Process-group setup and the wrappers that apply parallelism to a model from outside."""

from lm.distributed.ddp import grad_sync, wrap_ddp
from lm.distributed.env import DistEnv, init_distributed

__all__ = ["DistEnv", "grad_sync", "init_distributed", "wrap_ddp"]
