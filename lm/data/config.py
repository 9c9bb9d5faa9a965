"""The `data` section of a job's config: where the text comes from, how it is tokenized and prepared, and
the windows training reads. Lives beside the data code (as ModelConfig beside the models), so that
preparing data imports nothing above this package."""

import re
from dataclasses import dataclass, field
from pathlib import Path

from lm.data.masking import check_masking
from lm.errors import ConfigError
from lm.schema import Spec, check, nonblank, nonnegative
from lm.tokenizer import VOCAB_SIZES, is_tokenizer_file

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _metric_name(value: str) -> str:
    ok = bool(_NAME.fullmatch(value))
    return "" if ok else "a name of letters, digits, '_', '.' and '-' (it names the source's metrics)"


# The loader has made each value its field's type, a finite float for the weight; these are the ranges.
_SOURCE_KEYS: dict[str, Spec] = {"dir": nonblank, "weight": nonnegative, "name": _metric_name}


@dataclass
class MixtureSource:
    """One prepared dataset of a mixture (`data.mixture`) and its share of the training samples."""

    dir: str = ""
    """Directory holding the source's prepared shards and manifest.json (made by lm.prepare)."""
    weight: float = 1.0
    """Relative share of training samples drawn from this source (the weights are normalised to sum to 1)."""
    name: str = ""
    """Name in the metrics (val/<name>/loss, data/<name>/tokens); default: the directory's last part."""

    def __post_init__(self) -> None:
        if self.dir == "":
            raise ConfigError("dir: missing; each entry names the directory lm.prepare wrote, such as "
                              "{dir: data/a, weight: 1}")
        self.name = self.name or Path(self.dir).name
        check(vars(self), _SOURCE_KEYS, None, ConfigError)  # named data.mixture[i].key by the loader


@dataclass
class DataConfig:
    source: str = "shakespeare"
    """Built-in corpus (shakespeare: 38 plays; kjv: the King James Bible by chapter); hf:NAME[:CONFIG[:SPLIT]], a
    dataset on the Hugging Face Hub; or comma-separated paths/globs of .txt/.md/.json/.jsonl/.parquet/.arrow
    files and directories that `datasets`' save_to_disk wrote."""
    text_column: str = "text"
    """Column holding the text in json/jsonl/parquet/arrow files and `datasets` datasets."""
    document_separator: str = ""
    """What splits a .txt/.md file into documents: "" none (one document per file); "\\n\\n" any run of blank
    lines (lines holding only whitespace); any other string itself, dropped. Empty or blank documents are
    skipped. Rows of json/jsonl/parquet files and the built-in corpus's plays are one document each."""
    tokenizer: str = "gpt2"
    """tiktoken encoding: gpt2 (r50k_base ids) or cl100k_base; or the path of a Hugging Face tokenizer.json (an
    imported model's own, with its BOS/EOS from the tokenizer_config.json beside it)."""
    dir: str = "data/shakespeare"
    """Directory holding the prepared shards and manifest.json."""
    val_fraction: float = 0.05
    """Fraction of documents held out for validation (whole documents, evenly spaced)."""
    shard_tokens: int = 100_000_000
    """Tokens per shard file when preparing."""
    num_workers: int = 0
    """Tokenizer threads when preparing, 0 for one per core (tiktoken and `tokenizers` release the GIL, so
    they run in parallel)."""
    seq_len: int = 256
    """Tokens per training sample (each sample reads seq_len + 1 tokens)."""
    verify_hashes: bool = False
    """Check each shard's sha256 against manifest.json when training starts and when lm.prepare reuses data."""
    mixture: list[MixtureSource] = field(default_factory=list)
    """Train on several prepared directories, a list of {dir, weight, name}; empty: train on data.dir alone."""
    document_mask: bool = False
    """Attention stays inside each document of a packed window, whose positions restart at the document's start."""
    mlm_rate: float = 0.3
    """Masked LM (model.arch encoder): share of each window's positions after [CLS] that are targets, exactly
    round(rate * (seq_len - 1)) (at least 1) per window. 0.3 as ModernBERT: Wettig et al. 2023 ("Should You
    Mask 15% in Masked Language Modeling?") find higher rates than BERT's 0.15 train better at this scale."""
    mlm_mask_fraction: float = 0.8
    """Of the targets, the share shown as [MASK]: 0.8 as BERT (ModernBERT: 1.0, all [MASK]). Measured here
    (docs/experiments.md, "Fine-tuning an encoder"): at 1.0 the pretrained encoder's features fine-tuned
    worse than a random encoder's; with BERT's 80/10/10 the same 10-minute pretraining fine-tuned 3.5 points
    better."""
    mlm_random_fraction: float = 0.1
    """Of the targets, the share shown as a uniformly random token id; the rest keep their own token, so
    mlm_mask_fraction + mlm_random_fraction <= 1. 0.1 as BERT: with some targets visible, the model must
    represent the tokens it sees, not only the [MASK]s, and fine-tuning sees no [MASK]."""

    def __post_init__(self) -> None:
        # only the form: a config stored in a checkpoint is read again where the file may not be
        if self.tokenizer not in VOCAB_SIZES and not is_tokenizer_file(self.tokenizer):
            raise ConfigError(
                f"data.tokenizer: unknown tokenizer {self.tokenizer!r}; expected one of {sorted(VOCAB_SIZES)} "
                "or the path of a Hugging Face tokenizer.json (ending in .json)"
            )
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction: must be in [0, 1), got {self.val_fraction}")
        for key in ("shard_tokens", "seq_len"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"data.{key}: must be positive, got {getattr(self, key)}")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers: must be 0 (one per core) or positive, got {self.num_workers}")
        if re.search(r"\\[nrtf]", self.document_separator):
            raise ConfigError(
                f"data.document_separator: {self.document_separator!r} holds a backslash escape as two "
                "characters; for a newline, form feed or tab write it in YAML double quotes, e.g. "
                "--data.document_separator='\"\\n\\n\"'"
            )
        if not self.source.strip():
            raise ConfigError("data.source: must name a corpus or files, got an empty string")
        if not self.mixture and not self.dir.strip():
            raise ConfigError(f"data.dir: expected a non-empty string, got {self.dir!r}")
        check_masking(self.mlm_rate, self.mlm_mask_fraction, self.mlm_random_fraction)
        self._check_mixture()

    def _check_mixture(self) -> None:
        if self.mixture and not any(s.weight > 0 for s in self.mixture):
            raise ConfigError("data.mixture: the weights sum to 0; give at least one source a positive weight")
        names: dict[str, str] = {}
        for source in self.mixture:
            if source.name in names:
                raise ConfigError(f"data.mixture: {names[source.name]!r} and {source.dir!r} share the name "
                                  f"{source.name!r}; give one of them another `name`")
            names[source.name] = source.dir

    @property
    def sources(self) -> list[MixtureSource]:
        """What training draws from: the mixture's sources, or data.dir alone with weight 1."""
        return self.mixture or [MixtureSource(dir=self.dir)]
