"""The sections of the job config that configure training: one dataclass per concern, each field with a one-line
doc (the CLI's --help), and `__post_init__` refusing a bad value with `ConfigError` naming the key. What takes
more than one section to check is `JobConfig`'s (job_config.py)."""

from dataclasses import dataclass

from lm.config.rules import DEVICES, DTYPES, MAX_SEED, one_of
from lm.data.tasks import parse_tasks
from lm.errors import ConfigError

OPTIMIZERS = ("adamw", "muon")
FLOAT8_MODES = ("off", "tensorwise", "rowwise")
"""train.float8's values: torchao's recipes, one scale per tensor or one per row (of the input, weight and
gradient matrices)"""
MUON_KEYS = ("muon_lr", "muon_momentum", "muon_ns_steps")
MLM_KEYS = ("mlm_rate", "mlm_mask_fraction", "mlm_random_fraction")


@dataclass
class OptimConfig:
    name: str = "adamw"
    """adamw, or muon: Muon (orthogonalised momentum) for the hidden weight matrices, AdamW for the rest."""
    lr: float = 6e-4
    """Peak learning rate (AdamW; under muon, of the embeddings, head, norms and biases)."""
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
    muon_lr: float = 0.02
    """muon only: peak learning rate of the Muon matrices; the schedule scales it as it scales optim.lr."""
    muon_momentum: float = 0.95
    """muon only: momentum of the Muon matrices (Nesterov)."""
    muon_ns_steps: int = 5
    """muon only: Newton-Schulz iterations that orthogonalise each matrix's update."""
    z_loss: float = 0.0
    """Weight of the z-loss, mean(logsumexp(logits)^2), added to the training loss (0 = off; GPT and LSTM)."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.name: expected {one_of(OPTIMIZERS)}, got {self.name!r}")
        if self.name != "muon":
            for key in MUON_KEYS:
                if getattr(self, key) != getattr(OptimConfig, key):
                    raise ConfigError(f"optim.{key}: only Muon has it, but optim.name is {self.name}; set "
                                      f"optim.name=muon or drop optim.{key}")
        if self.muon_lr <= 0:
            raise ConfigError(f"optim.muon_lr: must be positive, got {self.muon_lr}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"optim.muon_momentum: must be in [0, 1), got {self.muon_momentum}")
        if self.muon_ns_steps < 1:
            raise ConfigError(f"optim.muon_ns_steps: must be >= 1, got {self.muon_ns_steps}")
        if self.lr <= 0:
            raise ConfigError(f"optim.lr: must be positive, got {self.lr}")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"optim.{key}: must be in [0, 1), got {getattr(self, key)}")
        for key in ("weight_decay", "grad_clip", "eps", "z_loss"):
            if getattr(self, key) < 0:
                raise ConfigError(f"optim.{key}: must be >= 0, got {getattr(self, key)}")


@dataclass
class ScheduleConfig:
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to optim.lr."""
    decay_steps: int = 0
    """Step at which the cosine decay reaches min_lr_ratio * lr (0 means train.steps; warmup_steps means no
    cosine: the floor from the first step after warmup)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optim.lr."""

    def __post_init__(self) -> None:
        for key in ("warmup_steps", "decay_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"schedule.{key}: must be >= 0, got {getattr(self, key)}")
        if 0 < self.decay_steps < self.warmup_steps:  # a decay that would end before warmup reaches the peak
            raise ConfigError(f"schedule.decay_steps: {self.decay_steps} ends the decay before warmup ends "
                              f"(schedule.warmup_steps={self.warmup_steps}); expected at least {self.warmup_steps}, "
                              "or 0 for train.steps")
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
    """torch.compile each transformer block (or LSTM layer) and the float32 loss under ddp and fsdp; deepspeed
    runs eager."""
    float8: str = "off"
    """off, tensorwise or rowwise: train the linear layers in float8 through torchao (a CUDA GPU of compute
    capability 8.9 or later; ddp or fsdp; fast with train.compile)."""
    eval_every: int = 100
    """Run validation every this many steps (and at the end)."""
    eval_batches: int = 20
    """Validation micro-batches per rank at each evaluation."""
    eval_tasks: str = ""
    """Downstream tasks scored during training, comma-separated (hellaswag, arc_easy, ... or core for all; see
    python -m lm.eval --help); empty for none. Next-token models, without tp, cp or pp."""
    eval_tasks_every: int = 0
    """Score train.eval_tasks every this many steps (and at the end); 0: at every validation (train.eval_every)."""
    eval_tasks_limit: int = 0
    """Items of each task scored in the loop (the first ones, the same every time); 0 for all of them."""
    out_dir: str = "runs/default"
    """Run directory: resolved config, checkpoints and TensorBoard logs."""
    max_nonfinite_steps: int = 5
    """Steps with a NaN/inf loss or gradient norm are skipped; this many in a row stop the run (at a log step)."""

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "micro_batch_size", "eval_every", "eval_batches", "max_nonfinite_steps"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"train.{key}: must be positive, got {getattr(self, key)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"train.seed: expected 0 to {MAX_SEED} (a 63-bit seed), got {self.seed}")
        if not self.out_dir.strip():  # "" is the working directory, whose config.yaml the run would replace
            raise ConfigError("train.out_dir: empty; name the run directory, e.g. runs/mine")
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.batch_size: {self.batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}"
            )
        if self.device not in DEVICES:
            raise ConfigError(f"train.device: expected {one_of(DEVICES)}, got {self.device!r}")
        for key in ("eval_tasks_every", "eval_tasks_limit"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}: must be 0 or more, got {getattr(self, key)}")
        if self.eval_tasks:
            parse_tasks(self.eval_tasks, "train.eval_tasks")
        if self.dtype not in DTYPES:
            raise ConfigError(f"train.dtype: expected {one_of(DTYPES)}, got {self.dtype!r}")
        if self.float8 not in FLOAT8_MODES:
            raise ConfigError(f"train.float8: expected {one_of(FLOAT8_MODES)}, got {self.float8!r}")


@dataclass
class CheckpointConfig:
    every: int = 500
    """Save a checkpoint every this many steps (and at the end); 0 = never (a benchmark's run, which a signal stops
    unsaved)."""
    keep: int = 3
    """Complete checkpoints to keep; older ones are deleted after a successful save."""
    resume: str = "auto"
    """auto (newest complete checkpoint if any), never, or required (fail without one)."""
    init_from: str = ""
    """A consolidated .safetensors (lm.consolidate) or a transformers checkpoint directory whose weights start a new
    run; optimizer and data start fresh."""
    allow_unverified: bool = False
    """Resume from a checkpoint that has no manifest.json (an older lm's), whose files cannot be checked."""
    allow_data_change: bool = False
    """Resume though data.dir now holds other data than the checkpoint trained on (its loader position carries over)."""
    async_: bool = False
    """Training waits only for a copy of the state to host memory; the write goes on in the background."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every: must be >= 0 (0 = never), got {self.every}")
        if self.keep <= 0:
            raise ConfigError(f"checkpoint.keep: must be positive, got {self.keep}")
        if self.resume not in ("auto", "never", "required"):
            raise ConfigError(f"checkpoint.resume: expected auto, never or required, got {self.resume!r}")


@dataclass
class LogConfig:
    every: int = 10
    """Log training metrics every this many steps."""
    tensorboard: bool = True
    """Also write metrics to TensorBoard under <out_dir>/tb (with the run's hyperparameters and samples)."""
    sample_every: int = 500
    """Every this many steps (and at the end) log a continuation of log.sample_prompt; 0 = never."""
    sample_prompt: str = ""
    """The periodic samples' prompt (empty: start from end-of-text); fixed, so the samples show the model learning."""
    sample_tokens: int = 64
    """New tokens per periodic sample (temperature 0.8, top-k 200, seed train.seed); more than model.block_size - 1
    are cut to that, so the default suits a model of any context."""

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise ConfigError(f"log.every: must be positive, got {self.every}")
        if self.sample_every < 0:
            raise ConfigError(f"log.sample_every: must be >= 0 (0 = never), got {self.sample_every}")
        if self.sample_tokens <= 0:
            raise ConfigError(f"log.sample_tokens: must be positive, got {self.sample_tokens}")


TASK_FILE_SUFFIXES = (".csv", ".json", ".jsonl", ".parquet")


@dataclass
class TaskConfig:
    file: str = ""
    """Fine-tuning (model.head classify or regress): a labelled .csv, .jsonl/.json or .parquet file, a row each."""
    text_column: str = "text"
    """Column of task.file holding each example's text."""
    label_column: str = "label"
    """Column of task.file holding each label: a class 0..model.num_classes-1 (classify) or a number (regress)."""
    val_fraction: float = 0.1
    """Fraction of task.file's rows held out for validation (evenly spaced rows, the same in every run)."""

    def __post_init__(self) -> None:
        if self.file and not self.file.endswith(TASK_FILE_SUFFIXES):
            raise ConfigError(f"task.file: {self.file!r} must end in one of {list(TASK_FILE_SUFFIXES)}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"task.val_fraction: must be in (0, 1), got {self.val_fraction}")
        for key in ("text_column", "label_column"):
            if not getattr(self, key).strip():
                raise ConfigError(f"task.{key}: must name a column, got an empty string")
