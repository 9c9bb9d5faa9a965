"""The job config: one dataclass per concern, composed into `JobConfig`.

The model and data sections live beside their code (`lm.models.config`, `lm.data.config`), so that those
layers import nothing above them; the sections here configure training. Every field has a one-line doc
(the CLI's --help) and `__post_init__` refuses a bad value with `ConfigError` naming the key.
"""

import keyword
from dataclasses import asdict, dataclass, field

from lm.config.parallel import ParallelConfig
from lm.config.rules import DEVICES, DTYPES, MAX_SEED, one_of
from lm.data.config import DataConfig
from lm.data.tasks import parse_tasks
from lm.errors import ConfigError
from lm.models.config import ModelConfig
from lm.models.registry import DEFAULT, config_class, family_of
from lm.tokenizer import VOCAB_SIZES, is_tokenizer_file

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
    """Step at which the cosine decay reaches min_lr_ratio * lr (0 means train.steps)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optim.lr."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ConfigError("schedule.warmup_steps and schedule.decay_steps must be >= 0")
        if 0 < self.decay_steps < self.warmup_steps:  # the rate would fall from its peak to the floor in one step
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
    """A consolidated .safetensors (lm.consolidate) whose weights start a new run; optimizer and data start fresh."""
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


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=lambda: config_class(DEFAULT)())
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    task: TaskConfig = field(default_factory=TaskConfig)

    def __post_init__(self) -> None:
        if self.data.seq_len > self.model.block_size:
            raise ConfigError(
                f"data.seq_len: {self.data.seq_len} exceeds model.block_size={self.model.block_size}"
            )
        model = self.model
        if self.data.document_mask and not model.document_masking:
            raise ConfigError(f"data.document_mask: {model.title} (model.arch={model.arch}) cannot keep attention "
                              "inside each document of a window; set it to false")
        if self.optim.name == "muon" and not model.muon_matrices:
            raise ConfigError(f"optim.name: muon steps a model's hidden nn.Linear matrices, and {model.title} "
                              f"(model.arch={model.arch}) has none; use optim.name=adamw")
        if self.optim.name == "muon" and self.parallel.engine == "deepspeed":
            raise ConfigError("optim.name: muon runs under parallel.engine ddp or fsdp; DeepSpeed steps its own "
                              "optimizer over flattened partitions, where no matrix is whole. Use "
                              "optim.name=adamw or another engine")
        if self.checkpoint.async_ and self.parallel.engine == "deepspeed":
            raise ConfigError("checkpoint.async: DeepSpeed writes its own checkpoints, which cannot be written in the "
                              "background; set checkpoint.async=false or use parallel.engine ddp or fsdp")
        self._check_float8()
        if self.optim.z_loss and not model.z_loss:
            raise ConfigError(f"optim.z_loss: {model.title} (model.arch={model.arch}) adds no z-loss term to its "
                              "loss; set it to 0")
        for key in () if model.masked_lm else MLM_KEYS:
            if getattr(self.data, key) != getattr(DataConfig, key):
                raise ConfigError(f"data.{key}: sets the masked LM of an encoder, and {model.title} "
                                  f"(model.arch={model.arch}) trains no masked LM; drop it")
        self._check_tensor_parallel()
        self._check_pipeline()
        self._check_context_parallel()
        self._check_expert_parallel()
        self._check_task()
        self._check_eval_tasks()
        self._check_vocab_size()

    def _check_float8(self) -> None:
        """The engines and layouts float8 training is applied under; the device is checked at launch
        (`lm.distributed.float8.check_float8`)."""
        mode, par = self.train.float8, self.parallel
        if mode == "off":
            return
        if par.engine == "deepspeed":
            raise ConfigError(f"train.float8={mode}: DeepSpeed wraps and casts the model itself, and torchao's "
                              "float8 layers are not applied under it; use parallel.engine ddp or fsdp, or "
                              "train.float8=off")
        split = [f"parallel.{key}={n}" for key, n in (("tp", par.tp), ("pp", par.pp)) if n > 1]
        if split:
            raise ConfigError(f"train.float8={mode}: not yet under {', '.join(split)} (tensor parallelism would "
                              "need torchao's float8 tensor-parallel styles, pipeline stages float8 layers of "
                              "their own); use parallel.tp=1 and parallel.pp=1, or train.float8=off")
        if par.cpu_offload:
            raise ConfigError(f"train.float8={mode}: float8 speeds up GPU matmuls, and an offloaded run waits on "
                              "host copies; drop parallel.cpu_offload or set train.float8=off")

    def _check_eval_tasks(self) -> None:
        """Downstream tasks in the loop rank choices by a next-token model's likelihoods, each rank its items."""
        if not self.train.eval_tasks:
            return
        if not family_of(self.model).training.causal_lm:
            raise ConfigError(f"train.eval_tasks: tasks rank each choice by a next-token model's likelihood; "
                              f"{self.model.title} (model.arch={self.model.arch}) is not one; drop train.eval_tasks")
        split = [f"parallel.{key}={n}" for key, n in (("tp", self.parallel.tp), ("cp", self.parallel.cp),
                                                      ("pp", self.parallel.pp)) if n > 1]
        if split:
            raise ConfigError(f"train.eval_tasks: scored by whole-sequence forwards on each data-parallel rank, "
                              f"not yet under {', '.join(split)}; drop train.eval_tasks and score the checkpoints "
                              "with python -m lm.eval --tasks")

    def _check_pipeline(self) -> None:
        """What the model and the batch must allow for parallel.pp stages (the world size is checked at launch)."""
        if self.parallel.pp == 1:
            return
        stages = self.parallel.pipeline_stages
        problem = family_of(self.model).parallel.pipeline_problem(self.model, stages)
        if problem:
            raise ConfigError(f"parallel.pp={self.parallel.pp}: {problem}")
        if self.data.document_mask:
            raise ConfigError("data.document_mask: under parallel.pp > 1 each window's document positions would "
                              "have to reach every stage, which they do not yet; set data.document_mask=false")
        if self.checkpoint.init_from:
            raise ConfigError("checkpoint.init_from: a pipeline-parallel run cannot start from a consolidated or "
                              "Hugging Face checkpoint yet; start it with parallel.pp=1, save, and resume that run "
                              "with parallel.pp (checkpoints resume under any layout)")

    def _check_context_parallel(self) -> None:
        """What the model and the sequence must allow for parallel.cp ranks."""
        cp = self.parallel.cp
        if cp == 1:
            return
        problem = family_of(self.model).parallel.context_problem(self.model, cp)
        if problem:
            raise ConfigError(f"parallel.cp={cp}: {problem}")
        if self.data.seq_len % (2 * cp):
            raise ConfigError(f"parallel.cp={cp}: data.seq_len={self.data.seq_len} does not split into {2 * cp} "
                              f"equal slices (2 per context-parallel rank); use a multiple of {2 * cp}")
        if self.data.document_mask:
            raise ConfigError("data.document_mask: under parallel.cp > 1 attention follows the causal order of the "
                              "whole window, not of its documents, yet; set data.document_mask=false")

    def _check_expert_parallel(self) -> None:
        """What the model must allow for parallel.ep ranks (that ep divides the data-parallel ranks is checked at
        launch, `lm.distributed.layout.check_world`)."""
        ep = self.parallel.ep
        if ep == 1:
            return
        problem = family_of(self.model).parallel.expert_problem(self.model, ep)
        if problem:
            raise ConfigError(f"parallel.ep={ep}: {problem}")

    def _check_tensor_parallel(self) -> None:
        """What the model and the sequence must allow for parallel.tp ranks (the world size is checked at launch,
        `lm.distributed.layout`)."""
        tp = self.parallel.tp
        if tp == 1:
            return
        problem = family_of(self.model).parallel.tensor_problem(self.model, tp)
        if problem:
            raise ConfigError(f"parallel.tp={tp}: {problem}")
        if self.data.seq_len % tp:
            raise ConfigError(f"parallel.tp={tp}: data.seq_len={self.data.seq_len} does not split into {tp} "
                              f"sequence slices (sequence parallelism); use a multiple of {tp}")

    def _check_task(self) -> None:
        """A fine-tuning head trains on task.file; nothing else reads one."""
        head = self.model.task_head
        if head and not self.task.file:
            raise ConfigError(f"task.file: model.head={head} trains on a labelled file; name it "
                              "(a .csv, .jsonl or .parquet with the columns task.text_column and task.label_column)")
        if self.task.file and not head:
            raise ConfigError(f"task.file: only a fine-tuning head (an encoder's model.head classify or regress) reads "
                              f"a labelled file, and model.arch={self.model.arch} trains on token shards; drop "
                              "task.file")

    def _check_vocab_size(self) -> None:
        """model.vocab_size must equal a tiktoken encoding's size. A tokenizer.json is not read here (a config
        stored in a checkpoint is read again where the file may not be): that the model holds its ids is
        checked where training opens the data and where eval and sample load it (`check_vocab_size`)."""
        if is_tokenizer_file(self.data.tokenizer):
            return
        expected = VOCAB_SIZES[self.data.tokenizer]
        if self.model.vocab_size != expected:
            raise ConfigError(
                f"model.vocab_size: {self.model.vocab_size} does not match tokenizer "
                f"{self.data.tokenizer!r}, which has {expected} ids"
            )

    def to_dict(self) -> dict:
        """{section: {key: value}}, the layout of the YAML files."""
        return {section: {config_key(name): value for name, value in values.items()}
                for section, values in asdict(self).items()}


def config_key(field_name: str) -> str:
    """The YAML and CLI key of a config field: a field named after a Python keyword ends in an underscore, as PEP 8
    advises (`async_`), and its key is the keyword itself (`checkpoint.async`)."""
    stem = field_name.removesuffix("_")
    return stem if stem != field_name and keyword.iskeyword(stem) else field_name
