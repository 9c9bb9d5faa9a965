"""The job config: one dataclass per concern, composed into `JobConfig`, which checks what takes more than one
section (a layout against the model, a family's keys against the data's).

The model and data sections live beside their code (`lm.models.config`, `lm.data.config`), so that those
layers import nothing above them; the training sections are in sections.py, the parallel one in parallel.py.
"""

import keyword
from dataclasses import asdict, dataclass, field

from lm.config.parallel import ParallelConfig
from lm.config.sections import (
    MLM_KEYS,
    CheckpointConfig,
    LogConfig,
    OptimConfig,
    ScheduleConfig,
    TaskConfig,
    TrainConfig,
)
from lm.data.config import DataConfig
from lm.errors import ConfigError
from lm.models.config import ModelConfig
from lm.models.registry import DEFAULT, config_class, family_of
from lm.tokenizer import VOCAB_SIZES, is_tokenizer_file


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
