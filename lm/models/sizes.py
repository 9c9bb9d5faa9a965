"""Sizes of the shared transformer layers, from a config alone: parameters, and the bytes a block saves for
backward. The transformer families add up their models from these (`family.py` of each); nothing is built.

Parameters. Per block: two norms, the q, k, v and output projections (grouped-query heads shrink k and
v), the MLP (SwiGLU has a gate matrix beside its up matrix), with qk_norm one RMSNorm of head size each for q and k,
and in an encoder-decoder's decoder block the cross-attention sublayer (a norm, q, fused k/v, output).

Activations, per micro-batch of b sequences of s tokens on each device (hidden h = d_model, a heads,
k key/value heads of size hd, d_ff f, t = b * s tokens). We follow Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.1: count every tensor a block saves
for backward. For a GPT-3 layer in 16-bit, with dropout and unfused attention, that count is
s*b*h*(34 + 5*a*s/h) bytes (`fused_attention=False` with c = r = 2 reproduces it exactly). We redo the
count for our blocks rather than scale that constant, because ours differ where it matters (SwiGLU,
grouped-query attention, rotary positions, no dropout by default, fused attention). c is the width
of matmul inputs and outputs (2 in bf16, 4 in float32); r is the residual stream's, which the norms
save (`lm.plan.memory` says which an engine has):
  attention: norm input r*t*h + q/k/v projection input c*t*h + q c*t*h + k and v 2c*t*k*hd
             + output, which is also the projection's input, c*t*h + softmax logsumexp 4*b*a*s
             (with rope the kernel saves the rotated q and k instead, and the unrotated ones are freed)
  MLP:       norm input r*t*h + first matrix input c*t*h + c*t*f * (2 gelu, 1 relu, 2 relu2, 4 swiglu)
  Under autocast (c < r) each linear casts its input to a copy of its own: q, k and v save three copies of
  theirs, SwiGLU's gate and up two.
  dropout > 0: a 1-byte mask per dropout (t*h each), as CUDA stores them.
For GPT-2's block in bf16 under fsdp that is 32*t*h + 4*b*a*s bytes. `scaled_dot_product_attention`
runs a fused kernel (flash or memory-efficient) for our calls on a GPU, so the a*s^2 attention matrix
is never stored: that is the default. `fused_attention=False` counts the unfused path (softmax output
c*b*a*s^2, with dropout also its mask and the dropped copy, and a separate projection input).

Activation checkpointing every n-th block (`lm.distributed.activation`: blocks 0, n, 2n, ... in model
order, ceil(L / n) of L) keeps only each checkpointed block's input, r*t*h bytes, plus one block's
full activations while it is recomputed in backward. The other blocks keep everything.

The logits, t*V*(4 + 4 + 4) bytes for the padded vocabulary V: the fp32 log-softmax output the loss saves,
and at the start of backward the fp32 gradients of that log-softmax's output and input. The head's own output
(c bytes) is not among them: nothing saves it for backward (the float cast and the log-softmax need only their
outputs), so it is freed once the loss is computed; a 16-bit model's float32 copy likewise. Measured on the CPU
at float32 (tests/plan/test_layouts.py), a step's peak is the estimate without that term. A logit soft-cap
saves its tanh's fp32 output as well (4 more; the family adds it). For GPT-2 small (V = 50k, d_model 768)
that is about twice all its blocks.

Checked against the bytes autograd actually saves (tests/plan/test_memory.py, on the CPU): within 2% per
block. Not modelled: torch.compile, which fuses some saved tensors away; the CPU's unfused RMSNorm, which also
saves its normalized output (CUDA's fused kernel does not).
"""

from lm.models.config import ModelConfig, TransformerConfig


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def linear_params(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def norm_params(cfg: TransformerConfig) -> int:
    """One norm over d_model: LayerNorm has a bias only with cfg.bias; RMSNorm never has one."""
    return cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def block_params(cfg: TransformerConfig, cross: bool = False) -> int:
    """Parameters of one transformer block; `cross` adds the encoder-decoder's cross-attention sublayer."""
    d, q, kv = cfg.d_model, cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attn = linear_params(d, q + 2 * kv, cfg.bias or cfg.qkv_bias) + linear_params(q, d, cfg.bias)
    mlp_in = 2 * cfg.ff_dim if cfg.mlp == "swiglu" else cfg.ff_dim  # SwiGLU stacks gate and up
    mlp = linear_params(d, mlp_in, cfg.bias) + linear_params(cfg.ff_dim, d, cfg.bias)
    # one RMSNorm for q, one for k: over a head's channels, or over the whole projection (scope all)
    qk_norm = (q + kv if cfg.qk_norm_scope == "all" else 2 * cfg.head_dim) if cfg.qk_norm else 0
    n = 2 * norm_params(cfg) + attn + mlp + qk_norm
    if cross:
        n += (norm_params(cfg) + linear_params(d, d, cfg.bias) + linear_params(d, 2 * kv, cfg.bias)
              + linear_params(d, d, cfg.bias))
    return n


def final_norm_params(cfg: TransformerConfig) -> int:
    """A stack's final norm: none after post-norm blocks, which end in a norm."""
    return norm_params(cfg) if cfg.final_norm else 0


def stack_params(cfg: TransformerConfig, cross: bool = False) -> int:
    """A transformer stack: `n_layer` blocks (`cross`: decoder blocks) and its final norm."""
    return cfg.n_layer * block_params(cfg, cross) + final_norm_params(cfg)


def embedding_params(cfg: ModelConfig) -> int:
    """One token embedding (or untied head) over the padded vocabulary."""
    return cfg.padded_vocab_size * cfg.d_model


def position_params(cfg: TransformerConfig) -> int:
    """One learned position table (none for sinusoidal or rotary positions)."""
    return cfg.block_size * cfg.d_model if cfg.pos == "learned" else 0


# ---- activations ------------------------------------------------------------------------------

def layer_activation_bytes(
    cfg: TransformerConfig,
    batch: int,
    seq: int,
    act_bytes: int = 2,
    residual_bytes: int = 2,
    fused_attention: bool = True,
    memory_len: int = 0,
) -> int:
    """Bytes one block saves for backward on `batch` sequences of `seq` tokens (see the module docstring).

    `act_bytes` is the width of the matmul inputs and outputs (2 in bf16), `residual_bytes` that of the
    residual stream, which the norms save.

    `memory_len` > 0 makes it an encoder-decoder decoder block whose cross-attention reads an encoder
    output of that length; the keys and values of that output are computed outside the block and are
    not counted here.
    """
    h, f, c = cfg.d_model, cfg.ff_dim, act_bytes
    t = batch * seq
    drop = cfg.dropout > 0
    n = attention_bytes(cfg, batch, seq, seq, c, residual_bytes, fused_attention, self_attention=True)
    if memory_len:
        n += attention_bytes(cfg, batch, seq, memory_len, c, residual_bytes, fused_attention, self_attention=False)
    # relu saves only its output, the next input; relu2 its output and the square's
    hidden = {"gelu": 2, "relu": 1, "relu2": 2, "swiglu": 4}[cfg.mlp]
    inputs = cast_copies(2 if cfg.mlp == "swiglu" else 1, c, residual_bytes)  # SwiGLU: gate's and up's
    n += residual_bytes * t * h + inputs * c * t * h + hidden * c * t * f + (t * h if drop else 0)
    return n


def cast_copies(linears: int, c: int, residual: int) -> int:
    """How many copies of one input the `linears` that read it save: under autocast (matmuls narrower than the
    residual stream) each casts the input to its own copy; otherwise they share the one tensor."""
    return linears if c < residual else 1


def attention_bytes(cfg: TransformerConfig, batch: int, q_len: int, kv_len: int, c: int, residual: int,
                    fused: bool, self_attention: bool) -> int:
    """One attention sublayer's saved tensors: norm, projection inputs, q (k, v for self-attention), output."""
    h, heads = cfg.d_model, cfg.n_head
    t = batch * q_len
    # norm input, projection input(s), q: self-attention's x feeds q, k and v; cross-attention's feeds q alone
    n = residual * t * h + cast_copies(3 if self_attention else 1, c, residual) * c * t * h + c * t * h
    if self_attention:
        kv = cfg.kv_heads * cfg.head_dim
        n += 2 * c * t * kv
    scores = batch * heads * q_len * kv_len
    if fused:
        # the kernel returns (B, T, nh, hs) memory, so the output projection's input is the same tensor
        n += c * t * h + 4 * batch * heads * q_len
    else:
        n += c * scores + c * t * h  # softmax output; the projection's input is a copy of the merged heads
        if cfg.dropout > 0:
            n += scores + c * scores  # the dropout mask and the dropped probabilities
    if cfg.dropout > 0:
        n += t * h
    return n


def checkpointed_blocks(n_blocks: int, every: int, start: int = 0) -> int:
    """How many of the blocks start .. start + n_blocks - 1 (in model order, encoder first) are checkpointed
    when every `every`-th one is: `lm.distributed.activation.checkpoint_blocks` takes blocks 0, n, 2n, ..."""
    if not every:
        return 0
    return ceil_div(start + n_blocks, every) - ceil_div(start, every)


def stack_bytes(n_layer: int, checkpointed: int, full: int, boundary: int) -> int:
    """Blocks of one stack: checkpointed ones keep only their input (`boundary` bytes), the others `full`."""
    return checkpointed * boundary + (n_layer - checkpointed) * full


def stack_peak_bytes(n_layer: int, every: int, full: int, boundary: int, start: int = 0) -> int:
    """The most a stack's blocks hold in a step with every `every`-th block checkpointed (`checkpointed_blocks`;
    `start`: the stack's first block in model order): what they keep when backward starts (`stack_bytes`), or,
    if more, what the blocks before the last checkpointed one keep while backward recomputes it (`full` beside
    its input), the blocks after it freed by then. With a block after it not checkpointed, the first is more."""
    kept = stack_bytes(n_layer, checkpointed_blocks(n_layer, every, start), full, boundary)
    if not checkpointed_blocks(n_layer, every, start):
        return kept
    last = (start + n_layer - 1) // every * every - start  # the last checkpointed block, from the stack's first
    before = stack_bytes(last, checkpointed_blocks(last, every, start), full, boundary)
    return max(kept, before + boundary + full)


def logits_bytes(positions: int, vocab: int) -> int:
    """The fp32 log-softmax of the logits of `positions` positions and both its gradients (see the module
    docstring)."""
    return kept_logits_bytes(positions, vocab) + positions * vocab * 8


def kept_logits_bytes(positions: int, vocab: int) -> int:
    """Of `logits_bytes`, the fp32 log-softmax output, which the loss keeps from its forward to its backward."""
    return positions * vocab * 4
