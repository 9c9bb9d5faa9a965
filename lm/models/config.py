"""Model hyperparameters, shared by the model code and the job config.

Lives beside the models (not in `lm.config`) so model files import only model code.

The defaults are GPT-2. A Llama-style decoder sets `pos: rope`, `norm: rmsnorm`, `mlp: swiglu`,
`bias: false` and optionally `n_kv_head` (grouped-query attention). `arch: encdec` is the encoder-decoder
of "Attention Is All You Need" (with `pos: sinusoidal`), trained by span corruption: its vocabulary is
the tokenizer's plus `n_sentinels` sentinel ids plus one padding id. `arch: lstm` is the recurrent
baseline: it reads vocab_size, block_size, n_layer, d_model (embedding and hidden width), dropout, bias and
tie_embeddings, and ignores the attention, feed-forward, position and norm keys, so a transformer config
turns into an LSTM by changing `arch` alone. `arch: encoder` is the encoder alone (BERT, ModernBERT):
bidirectional blocks under a masked-LM head (`head: mlm`, pretraining) or a classification or regression
head on a pooled position (fine-tuning); its vocabulary is the tokenizer's plus three ids, [MASK], [CLS] and
padding (`mask_id`, `cls_id`, `pad_id`).
"""

from dataclasses import dataclass

from lm.errors import ConfigError

ARCHS = ("gpt", "encdec", "lstm", "encoder")
POSITIONS = ("learned", "sinusoidal", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "relu", "relu2", "swiglu")
NORM_POSITIONS = ("pre", "post")
HEADS = ("mlm", "classify", "regress")
POOLINGS = ("first", "mean")
TRAINING_KEYS = ("dropout", "loss_chunk")
"""Model keys that change how a model trains, not its weights or its function: free to differ from a
checkpoint's when a run starts from or resumes it."""


@dataclass
class ModelConfig:
    arch: str = "gpt"
    """Model family: gpt (decoder-only), encdec (encoder-decoder, span corruption), lstm (recurrent baseline) or
    encoder (bidirectional, masked LM or a fine-tuning head)."""
    vocab_size: int = 50257
    """Tokenizer vocabulary size (the embedding is padded up to a multiple of vocab_multiple)."""
    block_size: int = 1024
    """Longest sequence the model takes (for encdec: the longest source and the longest target)."""
    n_layer: int = 12
    """Number of transformer blocks (encdec: in the encoder, and as many in the decoder; lstm: LSTM layers)."""
    n_head: int = 12
    """Attention (query) heads per block (not lstm)."""
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention); 0 means n_head, i.e. ordinary multi-head attention."""
    d_model: int = 768
    """Residual stream width (lstm: embedding width and hidden size of every layer)."""
    d_ff: int = 0
    """Feed-forward hidden width; 0 means 4 * d_model (gelu, relu, relu2) or 8/3 * d_model rounded up to 64 (swiglu)."""
    dropout: float = 0.0
    """Dropout on attention weights, residual branches and embeddings (lstm: embeddings and each layer's output)."""
    bias: bool = True
    """Biases in linear layers and LayerNorms, as in GPT-2; Llama has none (lstm: the gates' biases)."""
    qkv_bias: bool = False
    """gpt: biases on the query/key/value projection even without `bias`, as in Qwen2 (`bias` implies them)."""
    pos: str = "learned"
    """Positions: learned (GPT-2 table), sinusoidal (fixed, as in the original transformer) or rope (rotary; gpt,
    encoder)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm: str = "layernorm"
    """Normalisation: layernorm or rmsnorm."""
    norm_eps: float = 1e-5
    """Epsilon of every norm."""
    norm_position: str = "pre"
    """pre: norm before each sublayer, and a final norm (GPT-2, stabler); post: after each residual add (original)."""
    mlp: str = "gelu"
    """Feed-forward: gelu (tanh approximation, GPT-2), relu (original transformer), relu2 (relu squared) or swiglu."""
    qk_norm: bool = False
    """gpt: RMSNorm on each head's queries and keys (learned weight of head size), before rotary positions."""
    logit_softcap: float = 0.0
    """gpt: squash the logits into (-c, c) as c * tanh(logits / c), in float32 (Gemma 2, modded-nanogpt); 0: off."""
    tie_embeddings: bool = True
    """Output head shares its weight with the (target) token embedding."""
    share_embeddings: bool = True
    """encdec: encoder and decoder share one token embedding."""
    n_sentinels: int = 100
    """encdec: sentinel ids appended to the vocabulary for span corruption."""
    vocab_multiple: int = 64
    """Embedding and head rows: the vocabulary rounded up to a multiple of this, for efficient matmuls. A model
    imported from Hugging Face keeps its own rows (1): padding rows would add to every softmax's normaliser."""
    head: str = "mlm"
    """encoder: mlm (masked-LM pretraining; its output layer tied to the embedding by tie_embeddings), classify
    (num_classes logits, cross-entropy) or regress (one number, mean squared error)."""
    num_classes: int = 0
    """encoder with head classify: the number of classes (>= 2); 0 for every other head and arch."""
    pooling: str = "first"
    """encoder with head classify or regress: the vector the head reads, first (the [CLS] position) or mean
    (the mean over the real, unpadded tokens)."""
    loss_chunk: int = 0
    """gpt, lstm: compute the output head and loss this many of the B*T positions at a time, recomputing each
    chunk's logits in backward, so the full (B*T, vocab) logits never exist; forward then returns no
    logits with a loss. 0: off, the whole head at once."""

    def __post_init__(self) -> None:
        for key, allowed in (("arch", ARCHS), ("pos", POSITIONS), ("norm", NORMS), ("mlp", MLPS),
                             ("norm_position", NORM_POSITIONS), ("head", HEADS), ("pooling", POOLINGS)):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"model.{key}: unknown value {getattr(self, key)!r}; expected one of {list(allowed)}")
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "rope_theta", "norm_eps",
                    "vocab_multiple"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}: must be positive, got {getattr(self, key)}")
        for key in ("n_kv_head", "d_ff"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}: must be >= 0 (0 picks the default), got {getattr(self, key)}")
        if self.arch != "lstm":  # an LSTM has no heads: its d_model need not split into them
            self._check_heads()
        if self.arch == "encdec":
            if self.pos == "rope":
                raise ConfigError("model.pos: rope is for arch gpt and encoder; encdec takes sinusoidal (as in the "
                                  "paper) or learned")
            if self.n_sentinels < 1:
                raise ConfigError(f"model.n_sentinels: encdec needs at least 1 sentinel id, got {self.n_sentinels}")
        if self.logit_softcap < 0 or (self.logit_softcap and self.arch != "gpt"):
            raise ConfigError(f"model.logit_softcap: must be >= 0 (0 = off) and is for arch gpt only, got "
                              f"{self.logit_softcap} with model.arch={self.arch}")
        if self.loss_chunk < 0:
            raise ConfigError(f"model.loss_chunk: must be >= 0 (0 turns chunking off), got {self.loss_chunk}")
        if self.loss_chunk and self.arch in ("encdec", "encoder"):
            raise ConfigError(f"model.loss_chunk: chunked loss is for arch gpt and lstm; {self.arch} computes its "
                              "loss whole, so set model.loss_chunk=0")
        self._check_head()
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: must be in [0, 1), got {self.dropout}")

    def _check_head(self) -> None:
        """The encoder's head keys: off their defaults only for an encoder, and consistent with each other."""
        if self.arch != "encoder":
            for key, default in (("head", "mlm"), ("num_classes", 0), ("pooling", "first")):
                if getattr(self, key) != default:
                    raise ConfigError(f"model.{key}: only arch encoder has a head to configure, got "
                                      f"{getattr(self, key)!r} with model.arch={self.arch}")
            return
        if self.head == "classify" and self.num_classes < 2:
            raise ConfigError(f"model.num_classes: head classify needs at least 2 classes, got {self.num_classes}")
        if self.head != "classify" and self.num_classes:
            raise ConfigError(f"model.num_classes: only head classify has classes; head {self.head} needs "
                              f"model.num_classes=0, got {self.num_classes}")

    def _check_heads(self) -> None:
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model.d_model: {self.d_model} is not divisible by model.n_head={self.n_head}"
            )
        if self.n_head % self.kv_heads:
            raise ConfigError(
                f"model.n_kv_head: {self.n_kv_head} does not divide model.n_head={self.n_head}; "
                "each key/value head must serve the same number of query heads"
            )
        if self.qk_norm and self.arch != "gpt":
            raise ConfigError(f"model.qk_norm: only arch gpt has it, got model.arch={self.arch}")
        if self.qkv_bias and self.arch != "gpt":
            raise ConfigError(f"model.qkv_bias: only arch gpt has it, got model.arch={self.arch}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ConfigError(f"model.pos: rope needs an even head size, got d_model/n_head = {self.head_dim}")

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
    def total_vocab_size(self) -> int:
        """Ids the model knows: the tokenizer's, then (encdec) the sentinels and one padding id, or (encoder)
        [MASK], [CLS] and padding."""
        if self.arch == "encdec":
            return self.vocab_size + self.n_sentinels + 1
        if self.arch == "encoder":
            return self.vocab_size + 3
        return self.vocab_size

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows: total_vocab_size rounded up to a multiple of vocab_multiple."""
        m = self.vocab_multiple
        return (self.total_vocab_size + m - 1) // m * m

    @property
    def sentinel_start(self) -> int:
        """encdec: id of sentinel 0; sentinel i is sentinel_start + i."""
        return self.vocab_size

    @property
    def mask_id(self) -> int:
        """encoder: [MASK], the id masked-LM training puts in place of a token to predict."""
        return self.vocab_size

    @property
    def cls_id(self) -> int:
        """encoder: [CLS], the first token of every sequence, where pooling `first` reads."""
        return self.vocab_size + 1

    @property
    def pad_id(self) -> int:
        """encdec: the padding id, also the decoder's start token (as in T5); encoder: the padding of
        fine-tuning batches, always under a key-padding mask."""
        if self.arch == "encoder":
            return self.vocab_size + 2
        return self.vocab_size + self.n_sentinels

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head
