"""Job configuration: one dataclass per concern, composed into `JobConfig`.

Values come from the dataclass defaults, then a YAML file, then `--section.key=value` overrides on
the command line. Unknown keys, wrong types and impossible values raise `ConfigError` naming the key.
"""

import dataclasses
import difflib
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from lm.models.config import ConfigError, ModelConfig

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "JobConfig", "LogConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "ScheduleConfig", "TrainConfig", "load_config", "parse_cli", "save_config",
]

TOKENIZER_VOCAB = {"gpt2": 50257, "cl100k_base": 100277}


@dataclass
class DataConfig:
    source: str = "shakespeare"
    """Built-in corpus name (shakespeare), or comma-separated paths/globs of .txt/.md/.json/.jsonl/.parquet files."""
    text_column: str = "text"
    """Column holding the text in json/jsonl/parquet files."""
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
    """Check every shard's sha256 against manifest.json when training starts and when lm.prepare reuses data (sizes are always checked)."""

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZER_VOCAB:
            raise ConfigError(
                f"data.tokenizer: unknown tokenizer {self.tokenizer!r}; expected one of {sorted(TOKENIZER_VOCAB)}"
            )
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction: must be in [0, 1), got {self.val_fraction}")
        for key in ("shard_tokens", "num_workers", "seq_len"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"data.{key}: must be positive, got {getattr(self, key)}")
        if not self.source.strip():
            raise ConfigError("data.source: must name a corpus or files, got an empty string")


@dataclass
class OptimConfig:
    lr: float = 6e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on biases, norms or embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr: must be positive, got {self.lr}")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"optim.{key}: must be in [0, 1), got {getattr(self, key)}")
        for key in ("weight_decay", "grad_clip", "eps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"optim.{key}: must be >= 0, got {getattr(self, key)}")


@dataclass
class ScheduleConfig:
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to optim.lr."""
    decay_steps: int = 0
    """Step at which the cosine decay reaches min_lr_ratio * lr (0 means train.steps)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optim.lr."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ConfigError("schedule.warmup_steps and schedule.decay_steps must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"schedule.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps to train for."""
    batch_size: int = 32
    """Global batch in sequences per optimizer step (over all ranks and micro-steps)."""
    micro_batch_size: int = 8
    """Sequences per rank per forward/backward; accumulation makes up the rest."""
    seed: int = 1337
    """Seed for weights and data order."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    dtype: str = "auto"
    """Autocast dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16 or float32."""
    compile: bool = False
    """torch.compile each transformer block (or LSTM layer) under ddp and fsdp; deepspeed runs eager."""
    eval_every: int = 100
    """Run validation every this many steps (and at the end)."""
    eval_batches: int = 20
    """Validation micro-batches per rank at each evaluation."""
    out_dir: str = "runs/default"
    """Run directory: resolved config, checkpoints and TensorBoard logs."""
    max_nonfinite_steps: int = 5
    """Steps with a NaN/inf loss or gradient norm are skipped; this many in a row stop the run (at the next log step)."""

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "micro_batch_size", "eval_every", "eval_batches", "max_nonfinite_steps"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"train.{key}: must be positive, got {getattr(self, key)}")
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.batch_size: {self.batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"train.device: expected auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ConfigError(f"train.dtype: expected auto, bfloat16 or float32, got {self.dtype!r}")


ENGINES = ("ddp", "fsdp", "deepspeed")


@dataclass
class ParallelConfig:
    engine: str = "ddp"
    """How ranks share the work: ddp (replicated model), fsdp (FSDP2, sharded per block) or deepspeed (ZeRO)."""
    zero_stage: int = 0
    """deepspeed only: ZeRO stage 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters); 0 = not set."""
    cpu_offload: bool = False
    """fsdp and deepspeed: keep sharded parameters (fsdp) or optimizer state (deepspeed) in CPU memory."""
    deepspeed_config: str = ""
    """deepspeed only: a DeepSpeed JSON whose keys override the config generated from this job."""
    activation_checkpointing: int = 0
    """Recompute activations in the backward pass: 0 none, 1 every block (full), N every N-th block."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"parallel.engine: unknown engine {self.engine!r}; expected one of {list(ENGINES)}")
        if self.engine == "deepspeed" and self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"parallel.zero_stage: deepspeed takes ZeRO stage 1, 2 or 3, got {self.zero_stage}")
        if self.engine != "deepspeed":
            for key, unset in (("zero_stage", 0), ("deepspeed_config", "")):
                if getattr(self, key) != unset:
                    raise ConfigError(f"parallel.{key}: only the deepspeed engine has it, but parallel.engine is "
                                      f"{self.engine}; set parallel.engine=deepspeed or drop parallel.{key}")
        if self.engine == "ddp" and self.cpu_offload:
            raise ConfigError("parallel.cpu_offload: the ddp engine keeps a whole model per rank and cannot offload; "
                              "use parallel.engine=fsdp or deepspeed")
        if self.activation_checkpointing < 0:
            raise ConfigError(f"parallel.activation_checkpointing: must be >= 0 (0 = none), got {self.activation_checkpointing}")


@dataclass
class CheckpointConfig:
    every: int = 500
    """Save a checkpoint every this many steps (and at the end)."""
    keep: int = 3
    """Complete checkpoints to keep; older ones are deleted after a successful save."""
    resume: str = "auto"
    """auto (newest complete checkpoint if any), never, or required (fail without one)."""
    init_from: str = ""
    """A consolidated .safetensors (python -m lm.consolidate) whose weights start a new run; optimizer and data start fresh."""
    allow_data_change: bool = False
    """Resume even though data.dir now holds other data than the checkpoint trained on (its loader position carries over)."""

    def __post_init__(self) -> None:
        if self.every <= 0 or self.keep <= 0:
            raise ConfigError("checkpoint.every and checkpoint.keep must be positive")
        if self.resume not in ("auto", "never", "required"):
            raise ConfigError(f"checkpoint.resume: expected auto, never or required, got {self.resume!r}")


@dataclass
class LogConfig:
    every: int = 10
    """Log training metrics every this many steps."""
    tensorboard: bool = True
    """Also write metrics to TensorBoard under <out_dir>/tb (with the run's hyperparameters and samples)."""
    sample_every: int = 500
    """Every this many steps (and at the end) continue log.sample_prompt and log the text (TensorBoard and stdout); 0 = never."""
    sample_prompt: str = ""
    """The periodic samples' prompt (empty: start from end-of-text); fixed, so the samples show the model learning."""
    sample_tokens: int = 64
    """New tokens per periodic sample, at most model.block_size - 1 (temperature 0.8, top-k 200, seeded by train.seed)."""

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise ConfigError(f"log.every: must be positive, got {self.every}")
        if self.sample_every < 0:
            raise ConfigError(f"log.sample_every: must be >= 0 (0 = never), got {self.sample_every}")
        if self.sample_tokens <= 0:
            raise ConfigError(f"log.sample_tokens: must be positive, got {self.sample_tokens}")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if self.data.seq_len > self.model.block_size:
            raise ConfigError(
                f"data.seq_len: {self.data.seq_len} exceeds model.block_size={self.model.block_size}"
            )
        expected = TOKENIZER_VOCAB[self.data.tokenizer]
        if self.model.vocab_size != expected:
            raise ConfigError(
                f"model.vocab_size: {self.model.vocab_size} does not match tokenizer "
                f"{self.data.tokenizer!r}, which has {expected} ids"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def _coerce(key: str, value: object, kind: object) -> object:
    """Check `value` against the annotation `kind`; ints are accepted where floats are expected."""
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    name = getattr(kind, "__name__", str(kind))
    raise ConfigError(f"{key}: expected {name}, got {type(value).__name__} {value!r}")


def _build(cls: type, values: dict, prefix: str) -> object:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{prefix}{key}: unknown key; {hint}expected one of {sorted(known)}")
    kwargs = {}
    for name, value in values.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{name}: expected a mapping of keys, got {value!r}")
            kwargs[name] = _build(kind, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", value, kind)
    return cls(**kwargs)


def _merge(base: dict, key: str, value: object) -> None:
    section, _, leaf = key.partition(".")
    if not leaf:
        raise ConfigError(f"{key}: overrides take the form --section.key=value")
    base.setdefault(section, {})
    if not isinstance(base[section], dict):
        raise ConfigError(f"{section}: expected a mapping of keys")
    base[section][leaf] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Build a JobConfig from an optional YAML file and `section.key=value` override strings."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: no such file {str(path)!r}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    for item in overrides or []:
        key, eq, text = item.removeprefix("--").partition("=")
        if not eq:
            raise ConfigError(f"{item}: overrides take the form --section.key=value")
        value = yaml.safe_load(text) if text else ""
        # every key is a scalar, so text that YAML reads as a mapping or list ("KING: hi") is meant literally
        _merge(raw, key, text if isinstance(value, (dict, list)) else value)
    try:
        return _build(JobConfig, raw, "")
    except TypeError as err:  # a dataclass rejected its arguments in a way _build did not foresee
        raise ConfigError(str(err)) from None


def save_config(cfg: JobConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically, so a crash never leaves half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)


def config_help() -> str:
    """Every config key with its type, default and docstring, for `--help`."""
    lines = []
    for section in dataclasses.fields(JobConfig):
        cls = typing.get_type_hints(JobConfig)[section.name]
        docs = _field_docs(cls)
        lines.append(f"{section.name}:")
        for f in dataclasses.fields(cls):
            kind = getattr(typing.get_type_hints(cls)[f.name], "__name__", "")
            lines.append(f"  --{section.name}.{f.name}={f.default!r} ({kind}) {docs.get(f.name, '')}")
    return "\n".join(lines)


def _field_docs(cls: type) -> dict[str, str]:
    """Read the string literal that follows each field in the class body (its one-line doc)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)  # type: ignore[attr-defined]
    return docs


def parse_cli(argv: list[str], description: str, extra: "types.FunctionType | None" = None, prog: str | None = None):
    """Parse `--config FILE` plus dotted overrides; `extra(parser)` may add tool-specific flags.

    Returns (JobConfig, argparse.Namespace of the extra flags).
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="config keys (override any with --section.key=value):\n" + config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config file (see configs/)")
    if extra is not None:
        extra(parser)
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for item in rest:
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            parser.error(f"unrecognized argument {item!r}; config overrides look like --section.key=value")
        overrides.append(item)
    return load_config(args.config, overrides), args
