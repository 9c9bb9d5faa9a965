"""Parameter counts from a `ModelConfig` alone: the one place that counts a model's parameters, for the
trainer's log and FLOPs, the memory planner, sweeps and benchmarks. Nothing is built.

`num_params(cfg)` equals the number of distinct parameters of `build_model(cfg)`, a tied head counted once.
Transformers: token embedding (padded vocabulary) and position tables, per block two norms, the fused
q/k/v and output projections (grouped-query heads shrink k and v), the MLP (SwiGLU's first matrix is
2 x d_ff wide), cross-attention in encoder-decoder blocks, final norms, and the output head unless tied.
The encoder adds its embedding norm and its head (`head_params`).
LSTM: the token embedding, per layer the input and recurrent matrices of the four gates (4h x h each,
h = d_model) and their two bias vectors (4h each, as `nn.LSTM` keeps them), and the head unless tied.
"""

from lm.models.config import ModelConfig

__all__ = ["block_params", "head_params", "lstm_layer_params", "num_params", "position_params", "root_params",
           "stack_params", "unit_params"]


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _norm(cfg: ModelConfig) -> int:
    # LayerNorm has a bias only with cfg.bias; RMSNorm never has one
    return cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def block_params(cfg: ModelConfig, cross: bool = False) -> int:
    """Parameters of one transformer block; `cross` adds the encoder-decoder's cross-attention sublayer."""
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    attn = _linear(d, d + 2 * kv, cfg.bias or cfg.qkv_bias) + _linear(d, d, cfg.bias)
    mlp_in = 2 * cfg.ff_dim if cfg.mlp == "swiglu" else cfg.ff_dim  # SwiGLU stacks gate and up
    mlp = _linear(d, mlp_in, cfg.bias) + _linear(cfg.ff_dim, d, cfg.bias)
    n = 2 * _norm(cfg) + attn + mlp + (2 * cfg.head_dim if cfg.qk_norm else 0)  # one RMSNorm for q, one for k
    if cross:
        n += _norm(cfg) + _linear(d, d, cfg.bias) + _linear(d, 2 * kv, cfg.bias) + _linear(d, d, cfg.bias)
    return n


def lstm_layer_params(cfg: ModelConfig) -> int:
    """Parameters of one LSTM layer: weight_ih and weight_hh (4h x h), bias_ih and bias_hh (4h)."""
    h = cfg.d_model
    return 2 * 4 * h * h + (2 * 4 * h if cfg.bias else 0)


def unit_params(cfg: ModelConfig) -> int:
    """Parameters of the largest repeated unit (what FSDP shards and gathers as one): a block or an LSTM layer."""
    if cfg.arch == "lstm":
        return lstm_layer_params(cfg)
    return block_params(cfg, cross=cfg.arch == "encdec")


def stack_params(cfg: ModelConfig, cross: bool = False) -> int:
    """A transformer stack: `n_layer` blocks (`cross`: decoder blocks) and its final norm (pre-norm only:
    post-norm blocks end in a norm, so such a stack has no final one)."""
    return cfg.n_layer * block_params(cfg, cross) + (_norm(cfg) if cfg.norm_position == "pre" else 0)


def position_params(cfg: ModelConfig) -> int:
    """The learned position tables (one per stack; none for sinusoidal or rotary positions or an LSTM)."""
    if cfg.arch == "lstm" or cfg.pos != "learned":
        return 0
    return (2 if cfg.arch == "encdec" else 1) * cfg.block_size * cfg.d_model


def head_params(cfg: ModelConfig) -> int:
    """The encoder's head modules: mlm, the dense layer, its norm and the output layer (its weight only when
    untied; its bias, the one parameter tying leaves it, with `bias`); classify and regress, `score`."""
    d, vocab = cfg.d_model, cfg.padded_vocab_size
    if cfg.head != "mlm":
        return _linear(d, cfg.num_classes or 1, True)
    output = (0 if cfg.tie_embeddings else vocab * d) + (vocab if cfg.bias else 0)
    return _linear(d, d, cfg.bias) + _norm(cfg) + output


def root_params(cfg: ModelConfig) -> int:
    """Parameters outside the blocks or layers: embeddings, position tables, final norms, untied output head
    (the encoder: its embedding norm and head)."""
    d, vocab = cfg.d_model, cfg.padded_vocab_size
    n = vocab * d
    if cfg.arch == "encoder":
        final = _norm(cfg) if cfg.norm_position == "pre" else 0
        return n + _norm(cfg) + final + head_params(cfg) + position_params(cfg)
    if not cfg.tie_embeddings:
        n += vocab * d
    if cfg.arch == "lstm":  # no positions and no norms
        return n
    stacks = 2 if cfg.arch == "encdec" else 1
    if cfg.arch == "encdec" and not cfg.share_embeddings:
        n += vocab * d
    if cfg.norm_position == "pre":  # post-norm blocks end in a norm, so the stacks have no final one
        n += stacks * _norm(cfg)
    return n + position_params(cfg)


def num_params(cfg: ModelConfig, non_embedding: bool = False) -> int:
    """Every parameter of the model `cfg` describes, a tied head counted once. `non_embedding` leaves out
    the position tables (they do no matmul); the token embedding stays in because, tied, it is also the
    output layer (as in GPT-2's counts)."""
    if cfg.arch == "lstm":
        n = root_params(cfg) + cfg.n_layer * lstm_layer_params(cfg)
    elif cfg.arch == "encdec":
        n = root_params(cfg) + cfg.n_layer * (block_params(cfg) + block_params(cfg, cross=True))
    else:
        n = root_params(cfg) + cfg.n_layer * block_params(cfg)
    return n - position_params(cfg) if non_embedding else n
