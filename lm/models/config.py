"""What every model family's config has in common, and the rules a job's other sections must keep with it.

Each family (`lm/models/<family>/`) has its own config dataclass, a subclass of `ModelConfig` holding the keys
that family reads and no others; `model.arch` names the family (`lm.models.registry`). The config loader
builds the family's class from the `model` section, so a key the family does not read is refused by name.
`TransformerConfig` adds the keys of the shared transformer layers (`lm.models.layers`, `lm.models.attention`,
`lm.models.block`).

Nothing here imports torch: reading a config (lm.prepare) needs none.
"""

from dataclasses import dataclass
from typing import ClassVar

from lm.errors import ConfigError

POSITIONS = ("learned", "sinusoidal", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "relu", "relu2", "swiglu")
NORM_POSITIONS = ("pre", "post")
ROPE_SCALINGS = ("none", "linear", "llama3")


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    """ConfigError naming model.`key` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ConfigError(f"model.{key}: unknown value {value!r}; expected one of {list(allowed)}")


@dataclass
class ModelConfig:
    """The keys of every family. A family's config subclasses this one (its `arch` default is its name)."""

    arch: str = "gpt"
    """Model family: gpt (decoder-only), encdec (encoder-decoder, span corruption), encoder (bidirectional,
    masked LM or a fine-tuning head) or lstm (recurrent baseline); `python -m lm.train --help` lists each
    family's keys."""
    vocab_size: int = 50257
    """Tokenizer vocabulary size (the embedding is padded up to a multiple of vocab_multiple)."""
    block_size: int = 1024
    """Longest sequence the model takes."""
    n_layer: int = 12
    """Number of layers (transformer blocks, or LSTM layers)."""
    d_model: int = 768
    """Residual stream width (an LSTM's embedding width and hidden size)."""
    dropout: float = 0.0
    """Dropout probability in training (where a family applies it: see its model file)."""
    bias: bool = True
    """Biases in linear layers and LayerNorms, as in GPT-2; Llama has none."""
    tie_embeddings: bool = True
    """Output head shares its weight with the (target) token embedding."""
    vocab_multiple: int = 64
    """Embedding and head rows: the vocabulary rounded up to a multiple of this, for efficient matmuls. A model
    imported from Hugging Face keeps its own rows (1): padding rows would add to every softmax's normaliser."""

    training_keys: ClassVar[tuple[str, ...]] = ("dropout", "loss_chunk")
    """Keys that change how the model trains, not its weights or its function: free to differ from a
    checkpoint's when a run starts from or resumes it."""
    extra_ids: ClassVar[int] = 0
    """Ids a family adds after the tokenizer's (sentinels, [MASK], padding): part of total_vocab_size."""
    title: ClassVar[str] = "a model"
    """How messages name the family: "a decoder-only GPT"."""
    document_masking: ClassVar[bool] = False
    """Whether the family keeps attention inside each document of a packed window (data.document_mask)."""
    z_loss: ClassVar[bool] = False
    """Whether the family's loss adds the z-loss term (optim.z_loss)."""
    muon_matrices: ClassVar[bool] = True
    """Whether the family's hidden matrices are nn.Linear weights, which optim.name=muon steps with Muon."""
    masked_lm: ClassVar[bool] = False
    """Whether the family's objective is the masked LM that data.mlm_rate, mlm_mask_fraction and
    mlm_random_fraction set."""

    def free_keys(self, saved: "ModelConfig") -> tuple[str, ...]:
        """The keys whose values may differ between a checkpoint's model (`saved`) and this one, neither weights
        nor buffers changing: `training_keys`."""
        return self.training_keys

    def __post_init__(self) -> None:
        for key in ("vocab_size", "block_size", "n_layer", "d_model", "vocab_multiple"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}: must be positive, got {getattr(self, key)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: must be in [0, 1), got {self.dropout}")

    def depth_steps(self) -> list[tuple[dict[str, int], int]]:
        """How this config's depth is built of repeated steps: each (the keys one step adds to, how many such steps
        this config has beyond a shallow config of the same model), so that a planner counts a deep model off a
        few shallow ones (`lm.plan.counts`). Every block alike: steps of one block beyond two."""
        return [({"n_layer": 1}, max(0, self.n_layer - 2))]

    @property
    def task_head(self) -> str | None:
        """The fine-tuning head this config trains on labelled rows (task.file), classify or regress; None for a
        model pretrained on token shards."""
        return None

    @property
    def summary(self) -> str:
        """The model in a few words, for a dry run: `gpt, 12 layers, d_model 768, 12 heads (12 key/value)`."""
        return f"{self.arch}, {self.n_layer} layers, d_model {self.d_model}"

    @property
    def total_vocab_size(self) -> int:
        """Ids the model knows: the tokenizer's and the family's own (`extra_ids`)."""
        return self.vocab_size + self.extra_ids

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows: total_vocab_size rounded up to a multiple of vocab_multiple."""
        m = self.vocab_multiple
        return (self.total_vocab_size + m - 1) // m * m


@dataclass
class TransformerConfig(ModelConfig):
    """The keys of the shared transformer layers. The defaults are GPT-2's; a Llama-style stack sets
    `pos: rope`, `norm: rmsnorm`, `mlp: swiglu`, `bias: false` and optionally `n_kv_head`."""

    n_head: int = 12
    """Attention (query) heads per block."""
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention); 0 means n_head, i.e. ordinary multi-head attention."""
    d_ff: int = 0
    """Feed-forward hidden width; 0 means 4 * d_model (gelu, relu, relu2) or 8/3 * d_model rounded up to 64 (swiglu)."""
    pos: str = "learned"
    """Positions: learned (GPT-2 table), sinusoidal (fixed, as in the original transformer) or rope (rotary)."""
    norm: str = "layernorm"
    """Normalisation: layernorm or rmsnorm."""
    norm_eps: float = 1e-5
    """Epsilon of every norm."""
    norm_position: str = "pre"
    """pre: norm before each sublayer, and a final norm (GPT-2, stabler); post: after each residual add (original)."""
    mlp: str = "gelu"
    """Feed-forward: gelu (tanh approximation, GPT-2), relu (original transformer), relu2 (relu squared) or swiglu."""

    # Options of the shared layers that only some families expose: a family that takes one as a key declares
    # it as a field of its own config; the others build the layers with these values.
    rope_theta: ClassVar[float] = 10000.0
    rope_scaling: ClassVar[str] = "none"
    rope_factor: ClassVar[float] = 1.0
    rope_low_freq_factor: ClassVar[float] = 1.0
    rope_high_freq_factor: ClassVar[float] = 4.0
    rope_original_context: ClassVar[int] = 8192
    d_head: ClassVar[int] = 0
    qk_norm: ClassVar[bool] = False
    qk_norm_scope: ClassVar[str] = "head"
    qkv_bias: ClassVar[bool] = False
    positions: ClassVar[tuple[str, ...]] = POSITIONS
    """The values of `pos` the family takes."""
    norm_positions: ClassVar[tuple[str, ...]] = NORM_POSITIONS
    """The values of `norm_position` the family takes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, allowed in (("pos", self.positions), ("norm", NORMS), ("mlp", MLPS),
                             ("norm_position", self.norm_positions)):
            check_choice(key, getattr(self, key), allowed)
        for key in ("n_head", "rope_theta", "norm_eps"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}: must be positive, got {getattr(self, key)}")
        for key in ("n_kv_head", "d_ff"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}: must be >= 0 (0 picks the default), got {getattr(self, key)}")
        if self.d_head < 0:
            raise ConfigError(f"model.d_head: must be >= 0 (0 means d_model / n_head), got {self.d_head}")
        if not self.d_head and self.d_model % self.n_head:
            raise ConfigError(f"model.d_model: {self.d_model} is not divisible by model.n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ConfigError(
                f"model.n_kv_head: {self.n_kv_head} does not divide model.n_head={self.n_head}; "
                "each key/value head must serve the same number of query heads"
            )
        if self.pos == "rope" and self.head_dim % 2:
            raise ConfigError(f"model.pos: rope needs an even head size, got {self.head_dim}")

    @property
    def summary(self) -> str:
        return f"{super().summary}, {self.n_head} heads ({self.kv_heads} key/value)"

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used (n_kv_head, or n_head when it is 0)."""
        return self.n_kv_head or self.n_head

    @property
    def ff_dim(self) -> int:
        """Feed-forward hidden width actually used."""
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":
            # Llama's choice: 2/3 of 4d keeps the parameter count of a 4d two-matrix MLP with three matrices.
            return (8 * self.d_model // 3 + 63) // 64 * 64
        return 4 * self.d_model

    @property
    def head_dim(self) -> int:
        """Channels of one attention head: d_head, or d_model / n_head when it is 0."""
        return self.d_head or self.d_model // self.n_head

    @property
    def final_norm(self) -> bool:
        """Whether the stack ends in a norm: not after post-norm blocks, whose every sublayer already ends in one."""
        return self.norm_position != "post"
