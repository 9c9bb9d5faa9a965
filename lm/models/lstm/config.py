"""The LSTM baseline's keys: the keys every family has (`ModelConfig`), and chunked loss."""

from dataclasses import dataclass
from typing import ClassVar

from lm.errors import ConfigError
from lm.models.config import ModelConfig


@dataclass
class LSTMConfig(ModelConfig):
    """A stacked LSTM language model: `n_layer` layers of width `d_model`; `dropout` on the embeddings and on each
    layer's output; `bias` on the gates. A transformer config without its attention, feed-forward, position and
    norm keys becomes an LSTM by `arch: lstm`."""

    arch: str = "lstm"
    title: ClassVar[str] = "an LSTM"
    z_loss: ClassVar[bool] = True
    muon_matrices: ClassVar[bool] = False  # its gates' matrices are nn.LSTM's own, stacked four to a tensor
    loss_chunk: int = 0
    """Compute the output head and loss this many of the B*T positions at a time, recomputing each chunk's
    logits in backward, so the full (B*T, vocab) logits never exist. 0: off, the whole head at once."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_chunk < 0:
            raise ConfigError(f"model.loss_chunk: must be >= 0 (0 turns chunking off), got {self.loss_chunk}")
