"""The encoder-decoder's keys: the shared transformer keys, its vocabulary's sentinels and its embeddings."""

from dataclasses import dataclass
from typing import ClassVar

from lm.errors import ConfigError
from lm.models.config import TransformerConfig


@dataclass
class EncDecConfig(TransformerConfig):
    """The encoder-decoder of "Attention Is All You Need" (with `pos: sinusoidal`), trained by span corruption:
    `n_layer` encoder blocks and as many decoder blocks; `block_size` is the longest source and the longest
    target. Its vocabulary is the tokenizer's, then `n_sentinels` sentinel ids, then one padding id."""

    arch: str = "encdec"
    title: ClassVar[str] = "an encoder-decoder"
    share_embeddings: bool = True
    """Encoder and decoder share one token embedding."""
    n_sentinels: int = 100
    """Sentinel ids appended to the vocabulary for span corruption."""

    positions: ClassVar[tuple[str, ...]] = ("learned", "sinusoidal")

    def __post_init__(self) -> None:
        if self.pos == "rope":
            raise ConfigError("model.pos: rope is for arch gpt and encoder; encdec takes sinusoidal (as in the "
                              "paper) or learned")
        super().__post_init__()
        if self.n_sentinels < 1:
            raise ConfigError(f"model.n_sentinels: encdec needs at least 1 sentinel id, got {self.n_sentinels}")

    @property
    def total_vocab_size(self) -> int:
        """The tokenizer's ids, the sentinels and one padding id."""
        return self.vocab_size + self.n_sentinels + 1

    @property
    def sentinel_start(self) -> int:
        """Id of sentinel 0; sentinel i is sentinel_start + i."""
        return self.vocab_size

    @property
    def pad_id(self) -> int:
        """The padding id, also the decoder's start token (as in T5)."""
        return self.vocab_size + self.n_sentinels
