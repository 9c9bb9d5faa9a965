"""The `data` section of a job's config: where the text comes from, how it is tokenized and prepared, and
the windows training reads. Lives beside the data code (as ModelConfig beside the models), so that
preparing data imports nothing above this package."""

import re
from dataclasses import dataclass

from lm.errors import ConfigError
from lm.tokenizer import VOCAB_SIZES


@dataclass
class DataConfig:
    source: str = "shakespeare"
    """Built-in corpus name (shakespeare), or comma-separated paths/globs of .txt/.md/.json/.jsonl/.parquet files."""
    text_column: str = "text"
    """Column holding the text in json/jsonl/parquet files."""
    document_separator: str = ""
    """What splits a .txt/.md file into documents: "" none (one document per file); "\\n\\n" any run of blank
    lines (lines holding only whitespace); any other string itself, dropped. Empty or blank documents are
    skipped. Rows of json/jsonl/parquet files and the built-in corpus's plays are one document each."""
    tokenizer: str = "gpt2"
    """tiktoken encoding: gpt2 (r50k_base ids) or cl100k_base."""
    dir: str = "data/shakespeare"
    """Directory holding the prepared shards and manifest.json."""
    val_fraction: float = 0.05
    """Fraction of documents held out for validation (whole documents, evenly spaced)."""
    shard_tokens: int = 100_000_000
    """Tokens per shard file when preparing."""
    num_workers: int = 2
    """Tokenizer threads when preparing (tiktoken releases the GIL, so they run in parallel)."""
    seq_len: int = 256
    """Tokens per training sample (each sample reads seq_len + 1 tokens)."""
    verify_hashes: bool = False
    """Check each shard's sha256 against manifest.json when training starts and when lm.prepare reuses data."""

    def __post_init__(self) -> None:
        if self.tokenizer not in VOCAB_SIZES:
            raise ConfigError(
                f"data.tokenizer: unknown tokenizer {self.tokenizer!r}; expected one of {sorted(VOCAB_SIZES)}"
            )
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction: must be in [0, 1), got {self.val_fraction}")
        for key in ("shard_tokens", "num_workers", "seq_len"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"data.{key}: must be positive, got {getattr(self, key)}")
        if re.search(r"\\[nrtf]", self.document_separator):
            raise ConfigError(
                f"data.document_separator: {self.document_separator!r} holds a backslash escape as two "
                "characters; for a newline, form feed or tab write it in YAML double quotes, e.g. "
                "--data.document_separator='\"\\n\\n\"'"
            )
        if not self.source.strip():
            raise ConfigError("data.source: must name a corpus or files, got an empty string")
