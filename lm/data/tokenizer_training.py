"""Train a byte-level BPE tokenizer.json on a corpus read as lm.prepare reads it, and measure it on held-out text.

The corpus streams through `Corpus.pieces`, the path lm.prepare tokenizes, and the documents prepare puts in the
val split (`is_val_document`) are held out: the tokenizer never sees the text a model trained with it is
validated on, and that text measures its compression. Training runs in `tokenizers` (Rust, on every core).

The tokenizer is GPT-2's design: text is split with GPT-2's pre-tokenizer regex, each piece is mapped to bytes,
and BPE merges bytes. All 256 bytes are in the vocabulary whatever the corpus holds, so any UTF-8 text
encodes and decodes back exactly. Splitting like GPT-2 also means prepare's pieces (cut only where GPT-2's regex
splits) count the same words as whole documents. The end-of-text token `<|endoftext|>`, first of the special
tokens, is one `lm.tokenizer` takes as the end of every document.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from lm.data.corpora import Corpus
from lm.data.pieces import Piece
from lm.data.prepare import is_val_document
from lm.errors import ConfigError
from lm.tokenizer import ENDOFTEXT

__all__ = [
    "BYTE_TOKENS", "MAX_VOCAB_SIZE", "Compression", "Tally", "check_vocab_size", "compression", "corpus_pieces",
    "special_tokens", "train_bpe",
]

BYTE_TOKENS = 256
"""Tokens every byte-level vocabulary starts from, one per byte value, before any merge."""
MAX_VOCAB_SIZE = 1 << 20
"""The most ids a tokenizer may be asked for: 1,048,576, four times the largest vocabularies in use (262,144). The
tokenizers library takes a u32 and reserves about 66 bytes per id asked for before it counts a pair, and a
failed allocation (or a size past u32) aborts the whole process in Rust rather than raising."""
_BATCH_CHARS = 1 << 20  # text encoded per call when measuring: `tokenizers` spreads a batch over the cores


def special_tokens(extra: Iterable[str]) -> list[str]:
    """The special tokens of a new tokenizer: the end-of-text token, then `extra` in order. ConfigError for an
    empty one or one named twice."""
    tokens = [ENDOFTEXT]
    for token in extra:
        if not token:
            raise ConfigError("--special-token: got an empty string; expected the text of a token, e.g. <|pad|>")
        if token in tokens:
            why = "is the end-of-text token, always the first" if token == ENDOFTEXT else "is named twice"
            raise ConfigError(f"--special-token: {token!r} {why}")
        tokens.append(token)
    return tokens


def check_vocab_size(vocab_size: int, specials: list[str]) -> None:
    """ConfigError unless `vocab_size` holds the 256 byte tokens and the special tokens, and is at most
    MAX_VOCAB_SIZE."""
    if vocab_size > MAX_VOCAB_SIZE:
        digits = str(vocab_size)
        shown = f"{vocab_size:,}" if len(digits) <= 24 else f"{digits[:6]}... ({len(digits)} digits)"
        raise ConfigError(f"--vocab-size: {shown} is too large; at most {MAX_VOCAB_SIZE:,} (the largest vocabularies "
                          "in use hold 262,144 ids)")
    least = BYTE_TOKENS + len(specials)
    if vocab_size < least:
        raise ConfigError(f"--vocab-size: {vocab_size} is too small; a byte-level BPE holds {BYTE_TOKENS} byte tokens "
                          f"and {len(specials)} special token{'s' * (len(specials) > 1)} before any merge, so at least "
                          f"{least}")


def corpus_pieces(corpus: Corpus, text_column: str, val_fraction: float, held_out: bool) -> Iterator[Piece]:
    """The pieces of the documents lm.prepare puts in the val split (`held_out`), or of the others, in corpus
    order."""
    document = 0
    for piece in corpus.pieces(text_column):
        if is_val_document(document, val_fraction) == held_out:
            yield piece
        document += piece.ends_document


@dataclass
class Tally:
    """Documents and UTF-8 bytes of the pieces that went through `texts`."""

    documents: int = 0
    bytes: int = 0

    def texts(self, pieces: Iterable[Piece]) -> Iterator[str]:
        """The pieces' texts, counted as they pass."""
        for text, ends_document in pieces:
            self.documents += ends_document
            self.bytes += len(text.encode("utf-8"))
            yield text


def train_bpe(texts: Iterable[str], vocab_size: int, specials: list[str]) -> tokenizers.Tokenizer:
    """A byte-level BPE of at most `vocab_size` ids trained on `texts`: `specials` take ids 0, 1, ..., the byte
    tokens the next 256, merges the rest (fewer when the texts run out of pairs to merge)."""
    check_vocab_size(vocab_size, specials)
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # offsets only: a text's tokens are the model's alone; lm adds its end-of-text itself
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


@dataclass(frozen=True)
class Compression:
    """How many tokens tokenizers make of the same text."""

    documents: int
    """Documents of the text (0: nothing was measured)."""
    bytes: int
    """Its size in UTF-8 bytes."""
    tokens: dict[str, int]
    """Tokens each tokenizer makes of it, by name."""

    def bytes_per_token(self, name: str) -> float:
        """UTF-8 bytes per token of tokenizer `name`: higher is better compression."""
        return self.bytes / self.tokens[name]


def compression(pieces: Iterable[Piece], encoders: dict[str, Callable[[list[str]], list[list[int]]]]) -> Compression:
    """Bytes and tokens of the pieces' texts, each encoder (a name and its batch encode of ordinary text) encoding
    about 1 MB of text per call."""
    tally = Tally()
    tokens = dict.fromkeys(encoders, 0)
    batch: list[str] = []
    chars = 0
    for text in tally.texts(pieces):
        batch.append(text)
        chars += len(text)
        if chars >= _BATCH_CHARS:
            _count(batch, encoders, tokens)
            batch, chars = [], 0
    _count(batch, encoders, tokens)
    return Compression(tally.documents, tally.bytes, tokens)


def _count(batch: list[str], encoders: dict[str, Callable[[list[str]], list[list[int]]]], tokens: dict[str, int]
           ) -> None:
    for name, encode in encoders.items():
        tokens[name] += sum(map(len, encode(batch)))
