"""The model family spec: everything about a family that the rest of lm asks, in one object per family.

A family (the decoder-only GPT, the encoder-decoder, the encoder, the LSTM baseline, or one a user adds) lives in
its own folder `lm/models/<family>/`: its config dataclass (`config.py`), its model (`model.py`, torch only)
and a `Family` subclass (`family.py`) registered by name (`lm.models.registry`); `model.arch` picks it. The
trainer, the engines, the planner, the checkpoints, the evaluation and sampling tools and the Hugging Face
mapping ask the family, never which family they have:

- config: its dataclass, which also says what the job's other sections may ask of it (document masking,
  z-loss, a fine-tuning head: `ModelConfig`), read without importing torch;
- model: how to build it (on the meta device too), its repeated blocks (what FSDP shards and activation
  checkpointing recomputes), its output layers, a device check, and how it splits over tensor-parallel ranks
  (`tensor_parallel`: a style per module, which `lm.distributed.tensor_parallel` applies);
- training: the objective that turns token windows into its batches, the loss of a batch as named terms
  (`lm.models.terms`), the scores of a validation batch;
- sizes: parameters, FLOPs per token, and the activation bytes the memory planner adds per micro-batch;
- inference: how it samples text (or that it does not);
- Hugging Face: the transformers classes it exports to and imports from (`lm.hf.targets`).

The batches of a family are its own business: its objective makes them (a tuple of arrays, the model's inputs
and targets in an order the family picks) and its `loss` and `score_batch` read them. Model forwards return one
tensor, the final hidden states (the trunk); a family's loss applies the output head to them.
"""

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

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
(`lm.models.terms`): a family's `loss` with the run's loss options bound."""


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
    """What one module is under tensor parallelism, in a family's plan (`Family.tensor_parallel`). Between
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
    """The first block: its first input arrives whole on every rank and is cut into sequence slices"""
    EMBEDDING = "embedding"
    """The token embedding: vocabulary rows split; every rank gets the whole embedded sequence"""
    HEAD = "head"
    """The output head: vocabulary rows split, logits left split for a vocabulary-parallel loss"""
    REPLICATE = "replicate"
    """Whole on every rank, fed whole inputs (a learned position table)"""


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


class Family:
    """One model family's spec; see the module docstring. Subclasses set the class attributes and implement the
    methods that raise NotImplementedError here."""

    name: ClassVar[str]
    """Registry key, the value of model.arch"""
    config_class: ClassVar[type[ModelConfig]]

    causal_lm: ClassVar[bool] = False
    """A next-token model: scored over strided windows of a text or shards, with bits per byte."""
    generates: ClassVar[bool] = True
    """Whether it writes text (lm.sample, the trainer's periodic samples)."""
    samples_outside_forward: ClassVar[bool] = False
    """Sampling calls methods other than forward, which a sharding engine's hooks do not see: the engine
    gathers the whole model first."""
    head_keys: ClassVar[tuple[str, ...]] = ()
    """Config keys that choose a fine-tuning head: free to differ from the checkpoint whose trunk it starts from."""
    memory_note: ClassVar[str] = ""
    """A caveat the memory plan prints under its table."""
    hf_targets: ClassVar[tuple["Target", ...]] = ()
    """The transformers classes it exports to, in order of preference (`lm.hf.targets`)."""
    hf_readers: ClassVar[dict[str, "HFReader"]] = {}
    """transformers class name -> how its config.json reads as this family's config (`lm.hf.targets`)."""

    @property
    def title(self) -> str:
        """How messages call it: "a decoder-only GPT"."""
        return self.config_class.title

    # ---- config ----------------------------------------------------------------------------------

    def is_head_param(self, name: str) -> bool:
        """Whether a parameter belongs to the fine-tuning head (drawn fresh, not loaded from the trunk)."""
        return False

    # ---- model -----------------------------------------------------------------------------------

    def build(self, cfg: ModelConfig) -> "nn.Module":
        """The model `cfg` describes, its weights drawn from the global torch RNG (on the default device; under
        `torch.device("meta")` nothing is allocated or drawn, and `model.init_weights()` draws later)."""
        raise NotImplementedError

    def blocks(self, model: "nn.Module") -> list["nn.Module"]:
        """The repeated units in model order: what FSDP shards one by one, activation checkpointing recomputes
        and torch.compile compiles."""
        raise NotImplementedError

    def output_layers(self, model: "nn.Module") -> list["nn.Module"]:
        """The layers that map hidden states to outputs (their rows score one token or class each): Muon leaves
        them to AdamW."""
        head = getattr(model, "lm_head", None)
        return [] if head is None else [head]

    def tensor_parallel(self, model: "nn.Module") -> dict[str, TPStyle]:
        """Module name -> its style under tensor parallelism (parallel.tp > 1). A family without a plan says why
        in its config's `tensor_parallel_problem`, so such a run is refused before it starts."""
        raise NotImplementedError

    def pipeline_stage(self, model: "nn.Module", layers: range, sequence_shards: int = 1) -> "nn.Module":
        """The pipeline stage of `model` (built, on the meta device too) that runs its blocks `layers` (with the
        embeddings when layers start at 0, the head when they end at the last block): a module sharing the
        model's own submodules under their whole-model names. Its forward takes the previous stage's output (token
        ids on the first stage), and the last stage's output is what the family's loss reads from `run`.
        `sequence_shards`: how many tensor-parallel sequence slices the stream between stages is cut into. A
        family without stages says why in its config's `pipeline_problem`."""
        raise NotImplementedError

    def check_precision(self, cfg: ModelConfig, device_type: str, bf16: bool) -> None:
        """Refuse, with ConfigError, bf16 autocast (`bf16`) on a device type this family cannot run it on,
        before any step would."""

    # ---- training --------------------------------------------------------------------------------

    def objective(self, cfg: ModelConfig, data: "DataConfig", seq_len: int, seed: int,
                  document_eot: int | None = None) -> "Objective":
        """What turns windows of seq_len + 1 tokens into this family's batches (`lm.data.objectives`), with
        `document_eot` (data.document_mask) each token's position inside its document too. Refuses, before any
        weights exist, windows the model cannot take."""
        raise NotImplementedError

    def loss(self, model: "nn.Module", run: Run, batch: list["torch.Tensor"],
             optim: LossOptions = PLAIN_LOSS) -> "Losses":
        """One training micro-batch's loss as named terms (`lm.models.terms`), one of them the objective that
        backward differentiates. `run` is the model's forward through the engine; `model` the module whose heads
        the loss applies; `optim` the job's loss options."""
        raise NotImplementedError

    def score_batch(self, model: "nn.Module", run: Run, batch: list["torch.Tensor"]) -> Scored:
        """One validation batch (of the objective's making): its mean loss, targets and right predictions."""
        raise NotImplementedError

    def task_outputs(self, model: "nn.Module", run: Run, ids: "torch.Tensor",
                     keep: "torch.Tensor") -> "torch.Tensor":
        """A fine-tuned head's outputs for labelled rows ids (B, T) with padding `keep` (B, T): (B, classes)
        logits or (B,) predictions."""
        raise ConfigError(f"model.arch: {self.title} (model.arch={self.name}) has no fine-tuning head")

    # ---- sizes -----------------------------------------------------------------------------------

    def num_params(self, cfg: ModelConfig, non_embedding: bool = False) -> int:
        """Distinct parameters of the model (a tied head counted once); `non_embedding` leaves out position
        tables (they do no matmul). This default counts the model built on the meta device."""
        import torch

        with torch.device("meta"):
            model = self.build(cfg)
        return sum(p.numel() for p in model.parameters())

    def params_outside_embeddings(self, cfg: ModelConfig) -> int:
        """Parameters outside every embedding table (tokens, positions, token types): what "non-embedding"
        means in scaling-law counts. A tied head is the token embedding, so it is left out; an untied one
        counts. Read off the model built on the meta device, so it holds for every family."""
        import torch
        import torch.nn as nn

        with torch.device("meta"):
            model = self.build(cfg)
        tables = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        return sum(p.numel() for p in model.parameters() if id(p) not in tables)

    def flops_per_token(self, cfg: ModelConfig, seq_len: int, data: "DataConfig") -> float:
        """Training FLOPs per token of windows of `seq_len` tokens: by default 6 per parameter (forward and
        backward), which a family with attention raises by its scores."""
        return 6 * self.num_params(cfg, non_embedding=True)

    def unit_params(self, cfg: ModelConfig) -> int:
        """Parameters of the largest repeated unit (what FSDP gathers as one)."""
        import torch

        with torch.device("meta"):
            model = self.build(cfg)
        return max(sum(p.numel() for p in block.parameters()) for block in self.blocks(model))

    def root_params(self, cfg: ModelConfig) -> int:
        """Parameters outside the repeated units (embeddings, final norms, head): FSDP's root unit."""
        import torch

        with torch.device("meta"):
            model = self.build(cfg)
        in_blocks = {id(p) for block in self.blocks(model) for p in block.parameters()}
        return sum(p.numel() for p in set(model.parameters()) if id(p) not in in_blocks)

    def activation_bytes(self, cfg: ModelConfig, data: "DataConfig", micro_batch: int, act_bytes: int,
                         residual_bytes: int, every: int, fused_attention: bool) -> tuple[int, int]:
        """(activations, logits): bytes one device keeps for the backward of one micro-batch of `micro_batch`
        windows of data.seq_len tokens, logits included, with every `every`-th block checkpointed (0: none);
        `act_bytes` wide matmul outputs, a `residual_bytes` wide residual stream (`lm.plan.memory`)."""
        raise NotImplementedError(f"{self.title} (model.arch={self.name}) gives no activation estimate")

    # ---- inference -------------------------------------------------------------------------------

    def sample(self, model: "nn.Module", tokenizer, prompt: str, options: SampleOptions) -> str:
        """The text the model writes for `prompt` (its continuation, or its masks filled), prompt included.
        PromptError for a prompt or a length the model cannot take."""
        raise ConfigError(f"{self.title} (model.arch={self.name}) generates no text")
