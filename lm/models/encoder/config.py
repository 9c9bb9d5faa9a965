"""The encoder's keys: the shared transformer keys, rotary positions, and its head."""

from dataclasses import dataclass
from typing import ClassVar

from lm.errors import ConfigError
from lm.models.config import TransformerConfig, check_choice

HEADS = ("mlm", "classify", "regress")
POOLINGS = ("first", "mean")


MAX_CLASSES = 2**20
"""The most classes a classify head takes: more than a vocabulary's ids, each class needing its labelled rows."""


@dataclass
class EncoderConfig(TransformerConfig):
    """The encoder alone (BERT, ModernBERT): bidirectional blocks under a masked-LM head (`head: mlm`,
    pretraining) or a classification or regression head on a pooled position (fine-tuning). Its vocabulary is
    the tokenizer's plus three ids, [MASK], [CLS] and padding (`mask_id`, `cls_id`, `pad_id`)."""

    arch: str = "encoder"
    title: ClassVar[str] = "an encoder"
    document_masking: ClassVar[bool] = True
    masked_lm: ClassVar[bool] = True
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (pos: rope)."""
    head: str = "mlm"
    """mlm (masked-LM pretraining; its output layer tied to the embedding by tie_embeddings), classify
    (num_classes logits, cross-entropy) or regress (one number, mean squared error)."""
    num_classes: int = 0
    """With head classify: the number of classes (>= 2); 0 for the other heads."""
    pooling: str = "first"
    """With head classify or regress: the vector the head reads, first (the [CLS] position) or mean (the mean
    over the real, unpadded tokens)."""

    extra_ids: ClassVar[int] = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("head", self.head, HEADS)
        check_choice("pooling", self.pooling, POOLINGS)
        if self.head == "classify" and self.num_classes < 2:
            raise ConfigError(f"model.num_classes: head classify needs at least 2 classes, got {self.num_classes}")
        if self.num_classes > MAX_CLASSES:  # a head of d_model x num_classes, and a labelled file filling them all
            raise ConfigError(f"model.num_classes: {self.num_classes:,} is more than {MAX_CLASSES:,}, a head's "
                              "largest; a task of more classes is a language-modelling one")
        if self.head != "classify" and self.num_classes:
            raise ConfigError(f"model.num_classes: only head classify has classes; head {self.head} needs "
                              f"model.num_classes=0, got {self.num_classes}")

    @property
    def task_head(self) -> str | None:
        return None if self.head == "mlm" else self.head

    @property
    def mask_id(self) -> int:
        """[MASK], the id masked-LM training puts in place of a token to predict."""
        return self.vocab_size

    @property
    def cls_id(self) -> int:
        """[CLS], the first token of every sequence, where pooling `first` reads."""
        return self.vocab_size + 1

    @property
    def pad_id(self) -> int:
        """The padding of fine-tuning batches, always under a key-padding mask."""
        return self.vocab_size + 2
