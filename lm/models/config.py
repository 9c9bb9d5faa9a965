"""Model hyperparameters, shared by the model code and the job config.

Lives beside the models (not in `lm.config`) so model files import only model code.
"""

from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range; the message names the key."""


@dataclass
class ModelConfig:
    arch: str = "gpt"
    """Model family: gpt (decoder-only)."""
    vocab_size: int = 50257
    """Tokenizer vocabulary size (the embedding is padded up to a multiple of 64)."""
    block_size: int = 1024
    """Longest sequence the learned position table covers."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads per block."""
    d_model: int = 768
    """Residual stream width."""
    dropout: float = 0.0
    """Dropout on attention weights, residual branches and embeddings."""
    bias: bool = True
    """Biases in linear layers and LayerNorms, as in GPT-2."""

    def __post_init__(self) -> None:
        if self.arch != "gpt":
            raise ConfigError(f"model.arch: unknown architecture {self.arch!r}; expected 'gpt'")
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}: must be positive, got {getattr(self, key)}")
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model.d_model: {self.d_model} is not divisible by model.n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: must be in [0, 1), got {self.dropout}")

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows: vocab_size rounded up to a multiple of 64 for efficient matmuls."""
        return (self.vocab_size + 63) // 64 * 64

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head
