"""The model family spec: everything about a family that the rest of lm asks, in one small object per family.

A family (the decoder-only GPT, the encoder-decoder, the encoder, the LSTM baseline, or one a user adds) lives in
its own folder `lm/models/<family>/`: its config dataclass (`config.py`), its model (`model.py`, torch only)
and its spec (`family.py`), a `Family` instance registered by name (`lm.models.registry`); `model.arch` picks
it. The trainer, the engines, the planner, the checkpoints, the evaluation and sampling tools and the Hugging
Face mapping ask the spec, never which family they have. A spec holds:

- `name`, `config_class`: its model.arch and its config dataclass, which also says what the job's other
  sections may ask of it (document masking, z-loss, a fine-tuning head: `ModelConfig`);
- `build`, `blocks`, `output_layers`, `check_precision`, `float8_linears`: the model (on the meta device too), its
  repeated blocks (what FSDP shards and activation checkpointing recomputes), the layers Muon leaves to AdamW, a
  refusal of bf16 on a device type it cannot run it on, and which linear layers train.float8 converts;
- `training`: the objective that turns token windows into its batches, the loss of a batch as named terms
  (`lm.models.terms`), the scores of a validation batch, its fine-tuning head if it has one, and what it updates
  outside the gradients after each optimizer step;
- `parallel`: its tensor-parallel styles and pipeline stages, and why a config cannot split over tp, cp or pp
  ranks, asked before launch;
- `sampler`: how it writes text (None: it writes none);
- `hf`: the transformers classes it exports to and imports from (`lm.hf.targets`);
- `estimates`: what the planner cannot count on a built model: activation bytes, FLOPs beyond 6 per parameter.

Parameter counts are not the family's: `lm.plan.counts` reads them off the model built on the meta device.

The batches of a family are its own business: its objective makes them (a tuple of arrays, the model's inputs
and targets in an order the family picks) and its loss and scores read them. Model forwards return one tensor,
the final hidden states (the trunk); a family's loss applies the output head to them.
"""

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lm.errors import ConfigError
from lm.models.config import ModelConfig

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from lm.data.config import DataConfig
    from lm.data.objectives import Objective
    from lm.hf.targets import HFReader, Target
    from lm.models.terms import Losses

Run = Callable[..., "torch.Tensor"]
"""The model's forward as an engine calls it (through DDP's, FSDP's or DeepSpeed's wrapper and their hooks)."""
LossFn = Callable[["nn.Module", Run, list["torch.Tensor"]], "Losses"]
"""A micro-batch's loss as the step calls it: (model, its forward through the engine, batch) -> named terms
(`lm.models.terms`): a family's `training.loss` with the run's loss options bound."""


class LossOptions(Protocol):
    """The job's settings a family's loss may read (the optim section)."""

    z_loss: float
    """The z-loss coefficient: 0 for none; a family whose config allows it (`ModelConfig.z_loss`) adds the term"""


@dataclass(frozen=True)
class PlainLoss:
    """Loss options that add nothing to the model's own loss: what code outside a training run passes."""

    z_loss: float = 0.0


PLAIN_LOSS = PlainLoss()


class TPStyle(enum.Enum):
    """What one module is under tensor parallelism, in a family's plan (`Parallel.tensor_styles`). Between
    blocks each rank holds a slice of the sequence; inside a sublayer each rank holds some heads or hidden units."""

    COLUMNS = "columns"
    """A Linear whose output rows split over ranks (q, k, v: whole heads; an MLP's first matrices: hidden units)"""
    ROWS = "rows"
    """A Linear whose input columns split over ranks (a sublayer's output projection); its output, summed over
    ranks, comes back as sequence slices"""
    SEQUENCE = "sequence"
    """A norm over channels, run on each rank's slice of the sequence"""
    HEADS = "heads"
    """A norm over each head's channels (QK-norm), run on each rank's heads (B, nh, T, hs)"""
    GATHER = "gather"
    """A sublayer whose first input arrives as sequence slices and is gathered whole"""
    SCATTER = "scatter"
    """The module that makes the embedded sequence, before the first block: its output, whole on every rank, is
    cut into sequence slices. Not the first block's input: a compiled block would hold the cut in its graph, and
    torch 2.13 compiles its backward to pass on only this rank's slice of the gradient (tensor parallelism with
    rotary positions trained a wrong embedding)"""
    EMBEDDING = "embedding"
    """The token embedding: vocabulary rows split; every rank gets the whole embedded sequence"""
    HEAD = "head"
    """The output head: vocabulary rows split, logits left split for a vocabulary-parallel loss"""
    REPLICATE = "replicate"
    """Whole on every rank, fed whole inputs (a learned position table)"""
    WHOLE = "whole"
    """A sublayer run whole on every rank (a mixture of experts, whose router must see every token of the sequence):
    its input gathered from sequence slices, its output cut back into this rank's slice"""
    EXPERTS = "experts"
    """A mixture's routed experts, their weights whole on every rank, run on the plain rows the router sorted"""


@dataclass
class Scored:
    """What a validation batch scores: the mean loss over its targets and how many there were, and (for families
    that report it) how many of them the model predicts right."""

    loss: "torch.Tensor"
    """float32 scalar, the mean over the targets"""
    count: "torch.Tensor"
    """int scalar, the targets scored"""
    correct: "torch.Tensor | None" = None
    """int scalar, the targets whose argmax is right; None where the family reports no accuracy"""


@dataclass(frozen=True)
class SampleOptions:
    """How to sample: `max_new_tokens` at `temperature` (0: greedy) from the `top_k` and `top_p` filtered
    distribution, seeded by `seed`. `stop_at_end`: stop at the end-of-text token (lm.sample); otherwise sample
    exactly max_new_tokens without a host sync per token (periodic samples, where every rank takes the same
    number of steps) and cut the text at an end-of-text."""

    max_new_tokens: int
    temperature: float = 0.8
    top_k: int | None = 200
    top_p: float | None = None
    seed: int = 1337
    stop_at_end: bool = True
    device: "torch.device | None" = None
    """Where the prompt goes: the device the model computes on (None: its weights')"""
    compiled: bool = False
    """Decode through a static KV cache with the per-token step compiled (lm.sample --compile); a family that
    cannot raises ConfigError"""


Problem = Callable[[ModelConfig, int], "str | None"]
"""(config, ranks) -> why the model cannot split over that many ranks, or None when it can."""


@dataclass(frozen=True)
class Refusal:
    """A parallelism the family has not got, refused for every config: "<title> (model.arch=<arch>) <reason>"."""

    reason: str

    def __call__(self, cfg: ModelConfig, ranks: int) -> str:
        return f"{cfg.title} (model.arch={cfg.arch}) {self.reason}"


def no_problem(cfg: ModelConfig, ranks: int) -> None:
    """Any number of ranks: the family splits every config."""
    return None


@dataclass(frozen=True)
class Parallel:
    """How a family splits over ranks beyond data parallelism. Each `*_problem` says why a config cannot split over
    that many tensor-parallel, context-parallel or pipeline ranks; the job config and the layout planner ask them,
    so a run is refused before any process group forms."""

    tensor_styles: "Callable[[nn.Module], dict[str, TPStyle]] | None" = None
    """Module name -> its style under tensor parallelism (parallel.tp > 1), which `lm.distributed.tensor_parallel`
    applies"""
    tensor_problem: Problem = Refusal("has no tensor-parallel plan")
    context_problem: Problem = Refusal("has no context-parallel attention (its attention layers gather no keys)")
    stage: "Callable[[nn.Module, range, int], nn.Module] | None" = None
    """(model, layers, sequence_shards) -> the pipeline stage of `model` (built, on the meta device too) that runs
    its blocks `layers` (with the embeddings when layers start at 0, the head when they end at the last block): a
    module sharing the model's own submodules under their whole-model names. Its forward takes the previous
    stage's output (token ids on the first stage); the last stage's output is what the loss reads from `run`.
    `sequence_shards`: how many tensor-parallel sequence slices the stream between stages is cut into"""
    pipeline_problem: Problem = Refusal("has no pipeline stages")
    """(config, stages) -> why the model cannot be cut into that many pipeline stages"""
    experts: "Callable[[nn.Module], list[nn.Module]] | None" = None
    """model -> its modules of routed experts, which expert parallelism (parallel.ep) splits: stacked weights whose
    first dimension counts the experts, and forward(rows sorted by expert (N, C), counts (n_experts,)) -> (N, C)"""
    expert_problem: Problem = Refusal("has no experts to split over expert-parallel ranks; expected parallel.ep=1")
    """(config, ep) -> why the model's experts cannot split over that many expert-parallel ranks"""


StepUpdate = Callable[["nn.Module", Callable[["torch.Tensor"], "torch.Tensor"], "torch.Tensor"], None]
"""`Training.after_step`'s signature: (model, reduce over the data-parallel ranks, the step's size: a 0-dim float, the
learning-rate schedule's factor (lr over the peak lr), 0 where the engine skipped the step)."""


class ObjectiveFn(Protocol):
    """`Training.objective`'s signature."""

    def __call__(self, cfg: Any, data: "DataConfig", seq_len: int, seed: int,
                 document_eot: int | None = None) -> "Objective": ...


class FamilyLoss(Protocol):
    """`Training.loss`'s signature."""

    def __call__(self, model: "nn.Module", run: Run, batch: list["torch.Tensor"],
                 optim: LossOptions = PLAIN_LOSS) -> "Losses": ...


@dataclass(frozen=True)
class TaskHead:
    """A fine-tuning head trained on labelled rows (`lm.finetune`), its trunk loaded from a pretrained checkpoint."""

    keys: tuple[str, ...]
    """Config keys that choose the head: free to differ from the checkpoint whose trunk it starts from"""
    is_param: Callable[[str], bool]
    """Whether a parameter (by name) belongs to the head: drawn fresh, not loaded from the trunk"""
    outputs: "Callable[[nn.Module, Run, torch.Tensor, torch.Tensor], torch.Tensor]"
    """(model, run, ids (B, T), padding keep (B, T)) -> (B, classes) logits or (B,) predictions"""


@dataclass(frozen=True)
class Training:
    """How a family trains and is scored."""

    objective: ObjectiveFn
    """(cfg, data, seq_len, seed, document_eot) -> what turns windows of seq_len + 1 tokens into its batches
    (`lm.data.objectives`), with `document_eot` (data.document_mask) each token's position inside its document
    too; refuses, before any weights exist, windows the model cannot take"""
    loss: FamilyLoss
    """(model, run, batch, optim) -> one micro-batch's loss as named terms (`lm.models.terms`), one of them the
    objective that backward differentiates; `run` is the model's forward through the engine, `model` the module
    whose heads the loss applies, `optim` the job's loss options. The step weights every micro-batch's objective
    alike (the log weights the terms by their targets): a family's micro-batches should hold equally many targets,
    as every built-in family's do, or another split of the same batch trains on another mean"""
    score: "Callable[[nn.Module, Run, list[torch.Tensor]], Scored]"
    """(model, run, batch) -> one validation batch's mean loss, targets and right predictions"""
    causal_lm: bool = False
    """A next-token model: lm.eval scores it over strided windows of a text or shards, with bits per byte"""
    head: TaskHead | None = None
    """Its fine-tuning head; None for a family that has none"""
    after_step: "StepUpdate | None" = None
    """(model, reduce, size) -> None, called on every rank after each optimizer step: updates what the model keeps
    outside its gradients from what its training forwards counted since the last step (a mixture of experts'
    balancing biases). `reduce` averages a tensor over the data-parallel ranks in place (the engine layer's
    collective: model code imports no torch.distributed); `size` is the step's 0-dim float (`StepUpdate`), 0 where
    the engine skipped it. None: nothing to update"""


@dataclass(frozen=True)
class Sampler:
    """How a family writes text."""

    sample: "Callable[[nn.Module, Any, str, SampleOptions], str]"
    """(model, tokenizer, prompt, options) -> the text the model writes for `prompt` (its continuation, or its masks
    filled), prompt included; PromptError for a prompt or a length the model cannot take"""
    outside_forward: bool = False
    """Sampling calls methods other than forward, which a sharding engine's hooks do not see: the engine gathers
    the whole model first"""


@dataclass(frozen=True)
class HFAdapter:
    """The transformers classes a family maps to and from (`lm.hf.targets`)."""

    targets: tuple["Target", ...] = ()
    """The classes it exports to, in order of preference"""
    readers: Mapping[str, "HFReader"] = field(default_factory=dict)
    """transformers class name -> how its config.json reads as this family's config"""


class ActivationBytes(Protocol):
    """`Estimates.activation_bytes`'s signature."""

    def __call__(self, cfg: Any, data: "DataConfig", micro_batch: int, act_bytes: int, residual_bytes: int,
                 every: int, fused_attention: bool) -> tuple[int, int]: ...


@dataclass(frozen=True)
class Estimates:
    """What the planner cannot count on a built model (`lm.plan`)."""

    activation_bytes: ActivationBytes | None = None
    """(cfg, data, micro_batch, act_bytes, residual_bytes, every, fused_attention) -> (activations, logits): bytes
    one device keeps for the backward of one micro-batch of `micro_batch` windows of data.seq_len tokens, logits
    included, with every `every`-th block checkpointed (0: none); `act_bytes` wide matmul outputs, a
    `residual_bytes` wide residual stream (`lm.plan.memory`)"""
    flops_per_token: "Callable[[Any, int, DataConfig, int], float] | None" = None
    """(cfg, seq_len, data, params) -> training FLOPs per token of windows of seq_len tokens, given the model's
    active `params` that a matmul reads (every one but those of embedding tables only looked up; `lm.plan.counts`);
    None: 6 per such parameter (forward and backward), which a family with attention raises by its scores"""
    memory_note: str = ""
    """A caveat the memory plan prints under its table"""
    idle_params: "Callable[[Any], int] | None" = None
    """cfg -> the parameters a token does not go through, which its FLOPs leave out (a mixture of experts' experts
    its router does not choose); None: every parameter is active"""
    kept_logits: "Callable[[Any, DataConfig, int], int] | None" = None
    """(cfg, data, micro_batch) -> of activation_bytes' logits, the bytes the loss's forward keeps until its
    backward (not the gradients backward makes): what a pipeline running every forward first (GPipe) holds for each
    micro-batch; None: all of them"""
    context_kv: "Callable[[Any], int] | None" = None
    """cfg -> the key and value elements per token that each block gathers from the other context-parallel ranks
    (`lm.distributed.context_parallel`); None: the planner does not estimate the family under parallel.cp"""


def lm_head(model: "nn.Module") -> list["nn.Module"]:
    """The model's `lm_head`, if it has one."""
    head = getattr(model, "lm_head", None)
    return [] if head is None else [head]


def any_precision(cfg: ModelConfig, device_type: str, bf16: bool) -> None:
    """Every precision runs on every device type."""


Float8Filter = Callable[[str, int, int], bool]
"""(module name, in_features, out_features) -> whether train.float8 trains that nn.Linear in float8."""

FLOAT8_MULTIPLE = 16
"""What both dimensions of a float8 weight must be multiples of: float8 matmuls (torch._scaled_mm) take no others."""


def float8_except(*names: str) -> Float8Filter:
    """Every linear layer whose dimensions are multiples of 16 trains in float8, except those called `names`: a
    module's full name or its last dotted parts ("router.gate" is "blocks.3.mlp.router.gate"). Embeddings are no
    linear layers and never convert; a head is kept in the run's dtype by naming it here, as float8 recipes do
    (torchtitan, OLMo-core): its logits go straight into the softmax, and a tied head shares the embedding's weight."""

    def convert(name: str, in_features: int, out_features: int) -> bool:
        if in_features % FLOAT8_MULTIPLE or out_features % FLOAT8_MULTIPLE:
            return False
        return not any(name == kept or name.endswith(f".{kept}") for kept in names)

    return convert


@dataclass(frozen=True)
class Family:
    """One model family's spec; see the module docstring."""

    name: str
    """Registry key, the value of model.arch"""
    config_class: type[ModelConfig]
    build: "Callable[[Any], nn.Module]"
    """The model a config describes, its weights drawn from the global torch RNG (on the default device; under
    `torch.device("meta")` nothing is allocated or drawn, and `model.init_weights()` draws later)"""
    blocks: "Callable[[nn.Module], list[nn.Module]]"
    """The repeated units in model order: what FSDP shards one by one, activation checkpointing recomputes and
    torch.compile compiles"""
    training: Training
    parallel: Parallel = Parallel()
    sampler: Sampler | None = None
    """How it writes text (lm.sample, the trainer's periodic samples); None: it writes none"""
    hf: HFAdapter = HFAdapter()
    estimates: Estimates = Estimates()
    output_layers: "Callable[[nn.Module], list[nn.Module]]" = lm_head
    """The layers that map hidden states to outputs (their rows score one token or class each): Muon leaves them
    to AdamW"""
    check_precision: Callable[[Any, str, bool], None] = any_precision
    """(cfg, device_type, bf16) -> None, or ConfigError for bf16 autocast on a device type the family cannot run it
    on, before any step would"""
    float8_linears: Float8Filter = float8_except("lm_head")
    """(module name, in_features, out_features) -> whether train.float8 converts that nn.Linear; by default every
    one whose dimensions are multiples of 16 but the output head"""

    @property
    def title(self) -> str:
        """How messages call it: "a decoder-only GPT"."""
        return self.config_class.title

    def build_meta(self, cfg: ModelConfig) -> "nn.Module":
        """The model `cfg` describes on the meta device: shapes only, nothing allocated or drawn. A weight past
        what torch can describe (2^63 bytes) is a ConfigError, where torch's is a traceback."""
        import torch

        try:
            with torch.device("meta"):
                return self.build(cfg)
        except (RuntimeError, TypeError) as e:
            if "overflow" not in str(e).lower():
                raise
            raise ConfigError(f"model: {self.title} (model.arch={self.name}) of this size has a weight larger than "
                              f"torch can hold (2^63 bytes): {str(e).splitlines()[0]}; lower model.d_model, "
                              "model.vocab_size or the width it overflows") from None
