"""Model code: imports only torch and this package."""

from lm.models.config import ConfigError, ModelConfig
from lm.models.generate import generate
from lm.models.gpt import GPT
from lm.models.kv_cache import KVCache

__all__ = ["GPT", "ConfigError", "KVCache", "ModelConfig", "generate"]
