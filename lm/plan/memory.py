"""How much memory one device needs to train a config on each engine: an estimate, from the config alone.

Nothing is built or allocated; every number is arithmetic on `JobConfig`. It is an estimate of the
bytes torch allocates for tensors at the peak of a training step (the start of the backward pass,
when every saved activation and the loss's gradients are alive). It ignores the CUDA context and
kernels (about 0.5-1 GiB per process), the caching allocator's fragmentation and reserve, NCCL's and
DeepSpeed's communication buffers (DeepSpeed's `reduce_bucket_size` alone is 5e8 elements by default),
temporaries inside kernels and the optimizer step, and the input batch. Plan with headroom.

Parameters. N is counted exactly from `ModelConfig` (`lm.plan.param_count`, equal to
`build_model(cfg).num_params(False)`).

Model state, bytes per parameter, and what each engine shards over W devices (Rajbhandari et al.
2020, "ZeRO", section 3, for the DeepSpeed rows). "bf16" is what the run would use on
this machine (`lm.config.use_bf16`: `train.dtype` bfloat16, or auto on a CUDA device):

| engine | parameters | gradients | AdamW exp_avg + exp_avg_sq |
|---|---|---|---|
| ddp, bf16 | 4 fp32 + 2 bf16 copy cached by autocast | 4 fp32 + 4 DDP bucket (W > 1) | 8 |
| fsdp (FSDP2, bf16 param_dtype) | 4 fp32 / W | 4 fp32 / W | 8 / W |
| deepspeed bf16, ZeRO-1 | 2 bf16 + 4 fp32 master / W | 2 bf16 | 8 / W |
| ZeRO-2 | 2 bf16 + 4 fp32 master / W | 2 bf16 / W | 8 / W |
| ZeRO-3 | (2 bf16 + 4 fp32 master) / W | 2 bf16 / W | 8 / W |

In float32 there is no bf16 copy and no master: ddp 4 + 4 (+ 4 buckets) + 8, fsdp 16 / W, DeepSpeed
weights 4 and gradients 4, sharded by stage as above. DDP keeps a second copy of the gradients in
its all-reduce buckets because our wrapper leaves `gradient_as_bucket_view` off. Sharded counts
round up (ceil(N / W) elements), as FSDP pads its shards.

Gathered. FSDP and ZeRO-3 all-gather full parameters just in time. FSDP2 keeps the root unit (all
parameters outside the blocks: embeddings, position tables, final norms, untied head) gathered
through forward and backward, and prefetches the next block while computing one, so we count the
root plus two blocks (an LSTM: two layers), each as a gathered 16-bit weight and its unsharded 16-bit
gradient before the reduce-scatter (4 + 4 bytes in float32). ZeRO-3 is charged the same.

`cpu_offload` moves state to host memory, reported apart: fsdp offloads its sharded parameters,
gradients and optimizer state (16 / W bytes per parameter; the device keeps only the gathered units),
DeepSpeed its optimizer state (fp32 master and moments, 12 / W in bf16, 8 / W in float32) plus the
fp32 gradient partition its CPU Adam steps on (4 / W).

Activations, per micro-batch of b sequences of s tokens on each device (hidden h = d_model, a heads,
k key/value heads of size hd, d_ff f, t = b * s tokens). We follow Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.1: count every tensor a block saves
for backward. For a GPT-3 layer in 16-bit, with dropout and unfused attention, that count is
s*b*h*(34 + 5*a*s/h) bytes (`fused_attention=False` with c = r = 2 reproduces it exactly). We redo the
count for our blocks rather than scale that constant, because ours differ where it matters (SwiGLU,
grouped-query attention, rotary positions, no dropout by default, fused attention). c is the width
of matmul inputs and outputs (2 in bf16, 4 in float32); r is the residual stream's, which the norms
save: 4 under ddp (autocast computes in bf16 but the weights, the embeddings' output and so the
stream stay fp32), 2 under fsdp and deepspeed in bf16 (bf16 weights, no autocast), 4 in float32:
  attention: norm input r*t*h + q/k/v projection input c*t*h + q c*t*h + k and v 2c*t*k*hd
             + output, which is also the projection's input, c*t*h + softmax logsumexp 4*b*a*s
             + with rope c*t*(h + k*hd): the rotated q and k are new tensors, and v, a view of the
               fused q/k/v output, keeps that whole output alive
  MLP:       norm input r*t*h + first matrix input c*t*h + c*t*f * (2 gelu, 1 relu, 2 relu2, 4 swiglu)
  dropout > 0: a 1-byte mask per dropout (t*h each), as CUDA stores them.
For GPT-2's block in bf16 under fsdp that is 32*t*h + 4*b*a*s bytes. `scaled_dot_product_attention`
runs a fused kernel (flash or memory-efficient) for our calls on a GPU, so the a*s^2 attention matrix
is never stored: that is the default. `fused_attention=False` counts the unfused path (softmax output
c*b*a*s^2, with dropout also its mask and the dropped copy, and a separate projection input).
Encoder-decoder: the encoder runs on the corrupted source (S tokens), the decoder on the target
(U tokens); cross-attention adds a norm, q and output and, outside the block, each layer's keys and
values of the encoder output and that output itself (one copy per layer under ddp's autocast, which
casts it for each layer's projection).

Encoder (`arch: encoder`): its blocks as the GPT's, on all s tokens of each sequence; outside them the
embedding norm's input r*t*h, the final norm's (pre-norm) and a dropout mask. The masked-LM head runs on
the n = b*k targets only (k per sequence, `lm.data.masking.target_count` of data.mlm_rate): the inputs of
its dense layer, GELU, norm and output layer, (3c + r)*n*h (autocast runs the norm in fp32, as wide as
the stream), and the logits as below for n positions. A classify or regress head saves only its pooled
input, c*b*h (a fine-tuning sequence counted as data.seq_len tokens, an upper bound of padded examples).

Activation checkpointing every n-th block (`lm.distributed.activation`: blocks 0, n, 2n, ... in model
order, ceil(L / n) of L) keeps only each checkpointed block's input, r*t*h bytes, plus one block's
full activations while it is recomputed in backward. The other blocks keep everything.

Outside the blocks: the final norm's input and the head's input, then the logits, t*V*(c + 4 + 4 + 4)
bytes for the padded vocabulary V: the model's logits (returned to the trainer), the fp32
log-softmax output the loss saves, and at the start of backward the fp32 gradients of that
log-softmax's output and input. For GPT-2 small (V = 50k, d_model 768) that is twice all its blocks.
With `model.loss_chunk` (gpt, lstm) forward keeps no logits and backward recomputes one chunk at a time:
the same count for min(loss_chunk, t) positions.

LSTM (`arch: lstm`), per layer: 8*c*t*h bytes, what PyTorch's unfused LSTM saves for backward: the
layer's input c*t*h, and at every step the previous hidden state, the four gate activations, the
previous cell state and the tanh of the new one. Outside the layers: the head's input c*t*h, a 1-byte
dropout mask after the embedding and after every layer (dropout > 0), and the logits as above.
Checkpointing keeps each checkpointed layer's input (r*t*h for the first, which reads the embedding,
c*t*h for the others) plus one layer recomputed. This count is exact for the unfused kernel; the fused
ones keep their own buffers instead: cuDNN a reserve space whose size it does not publish (not checked
here: no GPU in the tests), the CPU's oneDNN kernel a workspace of 64 bytes per t*h in float32 (the
tests turn it off), and CPU autocast keeps the cell states in fp32 (4 bytes more per t*h).

Checked against the bytes autograd actually saves (tests/distributed/test_memory.py, on the CPU):
within 2% per block. Not modelled: torch.compile, which fuses some saved tensors away; the CPU's
unfused RMSNorm, which also saves its normalized output (CUDA's fused kernel does not).
"""

from dataclasses import dataclass

from lm.config import ENGINES, JobConfig, device_type, use_bf16
from lm.data.masking import target_count
from lm.data.span_corruption import corrupted_lengths
from lm.models.config import ModelConfig
from lm.plan.param_count import block_params, num_params, root_params, unit_params

__all__ = ["MemoryEstimate", "block_params", "checkpointed_blocks", "estimate_memory", "layer_activation_bytes",
           "lstm_layer_activation_bytes", "num_params"]

GIB = 2 ** 30
CUDA_CONTEXT_BYTES = GIB
"""What a process loses to the CUDA context before its first tensor (0.5-1 GiB): counted only in `fits`."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- model state --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _State:
    kind: str
    """parameters, gradients or optimizer"""
    bytes: int
    """per parameter"""
    sharded: bool
    offloadable: bool


def _states(engine: str, zero_stage: int, mixed: bool, world_size: int) -> list[_State]:
    """The tensors of model state an engine keeps per parameter; see the table in the module docstring."""
    if engine == "ddp":
        states = [_State("parameters", 4, False, False), _State("gradients", 4, False, False),
                  _State("optimizer", 8, False, False)]
        if mixed:  # autocast caches one bf16 copy of every weight until the autocast region exits
            states.append(_State("parameters", 2, False, False))
        if world_size > 1:  # DDP's flat all-reduce buckets, a second copy of every gradient
            states.append(_State("gradients", 4, False, False))
        return states
    if engine == "fsdp":
        return [_State("parameters", 4, True, True), _State("gradients", 4, True, True),
                _State("optimizer", 8, True, True)]
    width = 2 if mixed else 4
    states = [_State("parameters", width, zero_stage == 3, False), _State("gradients", width, zero_stage >= 2, False),
              _State("optimizer", 8, True, True)]
    if mixed:  # the fp32 master weights belong to the optimizer, so every stage shards and offloads them
        states.append(_State("parameters", 4, True, True))
    return states


def _gathered_units(cfg: ModelConfig) -> int:
    """Parameters unsharded at once under FSDP or ZeRO-3: the root unit and two blocks (one prefetched)."""
    return root_params(cfg) + 2 * unit_params(cfg)


# ---- activations ------------------------------------------------------------------------------

def layer_activation_bytes(
    cfg: ModelConfig,
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
    not counted here (see `_cross_memory_bytes`).
    """
    h, f, c = cfg.d_model, cfg.ff_dim, act_bytes
    t = batch * seq
    drop = cfg.dropout > 0
    n = _attention_bytes(cfg, batch, seq, seq, c, residual_bytes, fused_attention, self_attention=True)
    if memory_len:
        n += _attention_bytes(cfg, batch, seq, memory_len, c, residual_bytes, fused_attention, self_attention=False)
    # relu saves only its output, the next input; relu2 its output and the square's
    hidden = {"gelu": 2, "relu": 1, "relu2": 2, "swiglu": 4}[cfg.mlp]
    n += residual_bytes * t * h + c * t * h + hidden * c * t * f + (t * h if drop else 0)
    return n


def lstm_layer_activation_bytes(cfg: ModelConfig, batch: int, seq: int, act_bytes: int = 2) -> int:
    """Bytes one LSTM layer saves for backward on `batch` sequences of `seq` tokens: its input and, per
    step, the previous hidden state, four gates, the previous cell state and tanh of the new one."""
    return 8 * act_bytes * batch * seq * cfg.d_model


def _attention_bytes(cfg: ModelConfig, batch: int, q_len: int, kv_len: int, c: int, residual: int,
                     fused: bool, self_attention: bool) -> int:
    """One attention sublayer's saved tensors: norm, projection inputs, q (k, v for self-attention), output."""
    h, heads = cfg.d_model, cfg.n_head
    t = batch * q_len
    n = residual * t * h + c * t * h + c * t * h  # norm input, projection input, q
    if self_attention:
        kv = cfg.kv_heads * cfg.head_dim
        n += 2 * c * t * kv
        if cfg.pos == "rope":
            # rotation makes new q and k, but v stays a view of the fused q/k/v output and keeps all of it alive
            n += c * t * (h + kv)
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


def _cross_memory_bytes(cfg: ModelConfig, batch: int, memory_len: int, c: int, residual: int) -> int:
    """All decoder layers' cross-attention inputs, computed outside the blocks: the keys and values of the
    encoder output, and the encoder output their projection saves. Under autocast (a wider residual
    stream than the matmuls) every layer casts and saves its own copy; otherwise they share one."""
    m = batch * memory_len
    keys_values = 2 * c * m * cfg.kv_heads * cfg.head_dim * cfg.n_layer
    copies = cfg.n_layer if residual > c else 1
    return keys_values + copies * c * m * cfg.d_model


def checkpointed_blocks(n_blocks: int, every: int, start: int = 0) -> int:
    """How many of the blocks start .. start + n_blocks - 1 (in model order, encoder first) are checkpointed
    when every `every`-th one is: `lm.distributed.activation.checkpoint_blocks` takes blocks 0, n, 2n, ..."""
    if not every:
        return 0
    return _ceil_div(start + n_blocks, every) - _ceil_div(start, every)


def _stack_bytes(n_layer: int, checkpointed: int, full: int, boundary: int) -> int:
    """Blocks of one stack: checkpointed ones keep only their input (`boundary` bytes), the others `full`."""
    return checkpointed * boundary + (n_layer - checkpointed) * full


def _activation_bytes(cfg: JobConfig, c: int, residual: int, every: int, fused: bool) -> tuple[int, int]:
    """(activations, logits) per device for one micro-batch; activations include the logits."""
    model, b, s = cfg.model, cfg.train.micro_batch_size, cfg.data.seq_len
    h, vocab, n_layer = model.d_model, model.padded_vocab_size, model.n_layer
    drop = 1 if model.dropout > 0 else 0
    final_norm = residual if model.norm_position == "pre" else 0

    def tail(tokens: int) -> int:  # final norm and head input, embedding dropout mask
        return (final_norm + c + drop) * tokens * h

    def head(tokens: int) -> int:  # logits, their fp32 log-softmax and both gradients; one chunk's when chunked
        return min(tokens, model.loss_chunk or tokens) * vocab * (c + 12)

    if model.arch == "lstm":
        t = b * s
        full = lstm_layer_activation_bytes(model, b, s, c)
        k = checkpointed_blocks(n_layer, every)
        layers = _stack_bytes(n_layer, k, full, c * t * h)
        if k:  # one layer recomputed; the first checkpoint holds the embedding output, as wide as the residual
            layers += full + (residual - c) * t * h
        logits = head(t)
        return layers + (c + drop * (n_layer + 1)) * t * h + logits, logits
    if model.arch in ("gpt", "encoder"):
        t = b * s
        full = layer_activation_bytes(model, b, s, c, residual, fused)
        k = checkpointed_blocks(n_layer, every)
        blocks = _stack_bytes(n_layer, k, full, residual * t * h) + (full if k else 0)  # + one recomputed block
        if model.arch == "encoder":
            return _encoder_outside_blocks(cfg, c, residual, blocks)
        logits = head(t)
        return blocks + tail(t) + logits, logits
    src, tgt = corrupted_lengths(s + 1)  # the span-corruption objective's source and target lengths
    enc = layer_activation_bytes(model, b, src, c, residual, fused)
    dec = layer_activation_bytes(model, b, tgt, c, residual, fused, memory_len=src)
    k_enc, k_dec = checkpointed_blocks(n_layer, every), checkpointed_blocks(n_layer, every, start=n_layer)
    blocks = (_stack_bytes(n_layer, k_enc, enc, residual * b * src * h)
              + _stack_bytes(n_layer, k_dec, dec, residual * b * tgt * h)
              + (max(enc, dec) if k_enc + k_dec else 0))
    memory = _cross_memory_bytes(model, b, src, c, residual)
    logits = b * tgt * vocab * (c + 12)
    return blocks + memory + tail(b * src) + tail(b * tgt) + logits, logits


def _encoder_outside_blocks(cfg: JobConfig, c: int, residual: int, blocks: int) -> tuple[int, int]:
    """(activations, logits) of an encoder given its blocks' bytes: the norms around the stack and the head,
    which masked-LM runs on the targets alone (see the module docstring)."""
    model, b, s = cfg.model, cfg.train.micro_batch_size, cfg.data.seq_len
    h, t = model.d_model, b * s
    final_norm = residual if model.norm_position == "pre" else 0
    trunk = (residual + final_norm + (1 if model.dropout > 0 else 0)) * t * h  # embedding norm, final norm, mask
    if model.head != "mlm":
        return blocks + trunk + c * b * h, 0
    n = b * target_count(s, cfg.data.mlm_rate)
    logits = n * model.padded_vocab_size * (c + 12)
    return blocks + trunk + (3 * c + residual) * n * h + logits, logits


# ---- the estimate ------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (and per host process, for offloaded state) of one training setup."""

    engine: str
    zero_stage: int
    """deepspeed's ZeRO stage; 0 for ddp and fsdp"""
    world_size: int
    cpu_offload: bool
    activation_checkpointing: int
    """the setting `activations` describes: 0 none, n every n-th block"""
    mixed_precision: bool
    """bf16 autocast (and bf16 weights under fsdp and deepspeed); False is float32 throughout"""
    num_params: int
    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    """full parameters and gradients of the units FSDP or ZeRO-3 unshard at once"""
    activations: int
    """saved activations at the peak, logits included, with `activation_checkpointing`"""
    activations_no_checkpointing: int
    logits: int
    """the logits' share of the activations"""
    host: int
    """state moved to CPU memory by cpu_offload"""

    @property
    def total(self) -> int:
        """Bytes on the device at the peak, with the configured activation checkpointing."""
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations

    @property
    def total_no_checkpointing(self) -> int:
        return self.total - self.activations + self.activations_no_checkpointing

    @property
    def label(self) -> str:
        return f"deepspeed ZeRO-{self.zero_stage}" if self.engine == "deepspeed" else self.engine


def estimate_memory(
    cfg: JobConfig,
    world_size: int,
    engine: str | None = None,
    zero_stage: int | None = None,
    cpu_offload: bool | None = None,
    activation_checkpointing: int | None = None,
    fused_attention: bool = True,
) -> MemoryEstimate:
    """Per-device memory of training `cfg` on `world_size` devices; None takes the value from `cfg.parallel`.

    Asking for another engine than the config's takes its ZeRO stage and offload from the arguments
    (stage required for deepspeed, offload off unless given). See the module docstring for the model.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    par = cfg.parallel
    same_engine = engine is None or engine == par.engine
    engine = engine or par.engine
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {list(ENGINES)}")
    if zero_stage is None:
        zero_stage = par.zero_stage if same_engine else 0
    if cpu_offload is None:
        cpu_offload = par.cpu_offload if same_engine else False
    if activation_checkpointing is None:
        activation_checkpointing = par.activation_checkpointing
    if (engine == "deepspeed") != (zero_stage in (1, 2, 3)):
        raise ValueError(f"zero_stage {zero_stage} does not go with engine {engine}: deepspeed takes 1, 2 or 3, "
                         "the others 0")
    if engine == "ddp" and cpu_offload:
        raise ValueError("the ddp engine cannot offload to the CPU")
    if activation_checkpointing < 0:
        raise ValueError(f"activation_checkpointing must be >= 0, got {activation_checkpointing}")

    mixed = use_bf16(cfg.train.dtype, device_type(cfg.train.device))  # as the run on this machine would
    n = num_params(cfg.model)
    sums = {"parameters": 0, "gradients": 0, "optimizer": 0, "host": 0}
    for state in _states(engine, zero_stage, mixed, world_size):
        size = (_ceil_div(n, world_size) if state.sharded else n) * state.bytes
        sums["host" if cpu_offload and state.offloadable else state.kind] += size
    if cpu_offload and engine == "deepspeed":  # ZeRO-Offload's CPU Adam steps on an fp32 gradient partition
        sums["host"] += _ceil_div(n, world_size) * 4
    sharded_params = engine == "fsdp" or zero_stage == 3
    gathered = _gathered_units(cfg.model) * (2 + 2 if mixed else 4 + 4) if sharded_params else 0

    c = 2 if mixed else 4
    # the residual stream has the embedding's dtype: fp32 weights under ddp autocast, bf16 weights otherwise
    residual = 2 if mixed and engine != "ddp" else 4
    acts, logits = _activation_bytes(cfg, c, residual, activation_checkpointing, fused_attention)
    acts_none, _ = _activation_bytes(cfg, c, residual, 0, fused_attention)
    return MemoryEstimate(
        engine=engine, zero_stage=zero_stage, world_size=world_size, cpu_offload=cpu_offload,
        activation_checkpointing=activation_checkpointing, mixed_precision=mixed, num_params=n,
        parameters=sums["parameters"], gradients=sums["gradients"], optimizer=sums["optimizer"],
        gathered=gathered, activations=acts, activations_no_checkpointing=acts_none, logits=logits,
        host=sums["host"],
    )
