"""How much memory one device needs to train a config on each engine: an estimate, from the config alone.

Nothing is allocated; every number is arithmetic on `JobConfig` and on the model built on the meta device.
It is an estimate of the bytes torch allocates for tensors at the peak of a training step (the start of the
backward pass, when every saved activation and the loss's gradients are alive). It ignores the CUDA context and
kernels (about 0.5-1 GiB per process), the caching allocator's fragmentation and reserve, NCCL's and
DeepSpeed's communication buffers (DeepSpeed's `reduce_bucket_size` alone is 5e8 elements by default),
temporaries inside kernels and the optimizer step, and the input batch. Plan with headroom.

Parameters. N is counted exactly on the model the family builds on the meta device (`lm.plan.counts`).

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
root plus two blocks (the family's largest repeated unit), each as a gathered 16-bit weight and its unsharded
16-bit gradient before the reduce-scatter (4 + 4 bytes in float32). ZeRO-3 is charged the same.

Expert parallelism (parallel.ep, fsdp only). Each of the ep ranks holds n_experts / ep of every mixture-of-experts
layer's routed experts, which FSDP2 shards again over the W / ep ranks holding the same ones: E routed-expert
parameters cost a rank 16 x ceil(ceil(E / ep) / (W / ep)) bytes, the rest 16 x ceil((N - E) / W), about N / W in
all as without ep. What ep shrinks is the gathered unit: a block's experts are gathered over W / ep ranks to their
ep rank's share, so a block gathers its other parameters and 1/ep of its experts.

`cpu_offload` moves state to host memory, reported apart: fsdp offloads its sharded parameters,
gradients and optimizer state (16 / W bytes per parameter; the device keeps only the gathered units),
DeepSpeed its optimizer state (fp32 master and moments, 12 / W in bf16, 8 / W in float32) plus the
fp32 gradient partition its CPU Adam steps on (4 / W).

Activations: what one micro-batch's forward leaves for backward on each device, logits included, is the
model family's to count (`Estimates.activation_bytes`; the transformer layers' terms and their sources are in
`lm.models.sizes`). Two widths enter it: c, the matmul inputs' and outputs' (2 in bf16, 4 in float32), and r,
the residual stream's, which the norms save: 4 under ddp (autocast computes in bf16 but the weights, the
embeddings' output and so the stream stay fp32), 2 under fsdp and deepspeed in bf16 (bf16 weights, no
autocast), 4 in float32.
"""

from dataclasses import dataclass

from lm.config import ENGINES, JobConfig, device_type, use_bf16
from lm.errors import ConfigError
from lm.models.config import ModelConfig
from lm.models.registry import family_of
from lm.models.sizes import ceil_div
from lm.plan.counts import activation_bytes, counts, num_params, root_params, unit_params

__all__ = ["MemoryEstimate", "check_ep", "estimate_memory"]

GIB = 2 ** 30
CUDA_CONTEXT_BYTES = GIB
"""What a process loses to the CUDA context before its first tensor (0.5-1 GiB): counted only in `fits`."""


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


def _gathered_units(cfg: ModelConfig, ep: int = 1) -> int:
    """Parameters unsharded at once under FSDP or ZeRO-3: the root unit and two blocks (one prefetched), each block's
    routed experts gathered to one ep rank's share under expert parallelism."""
    return root_params(cfg) + 2 * unit_params(cfg, ep)


def check_ep(cfg: JobConfig, ep: int, dp: int) -> None:
    """ConfigError unless `ep` expert-parallel ranks can split the model's experts and the `dp` ranks that shard it
    (as `lm.config` and `lm.distributed.layout.check_world` refuse a run)."""
    if ep < 1:
        raise ConfigError(f"parallel.ep: must be >= 1 (1 = no expert parallelism), got {ep}")
    if ep > 1 and (problem := family_of(cfg.model).parallel.expert_problem(cfg.model, ep)):
        raise ConfigError(f"parallel.ep={ep}: {problem}")
    if dp % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the {dp} data-parallel rank(s) planned for, which the "
                          "expert-parallel ranks are taken from; expected a divisor of "
                          f"{dp}: {', '.join(str(d) for d in range(1, dp + 1) if dp % d == 0)}")


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
    """CPU memory per process: the state cpu_offload moves there, or, where more, the whole fp32 model that ddp
    and DeepSpeed build there first (`lm.distributed.materialize`; fsdp draws each rank's shard)"""
    ep: int = 1
    """expert-parallel ranks (fsdp only)"""
    startup: int = 0
    """bytes on the device while the run starts, before the state above exists: the whole fp32 model that ddp and
    DeepSpeed move there (`lm.distributed.materialize`), which under every ZeRO stage each rank holds until DeepSpeed
    casts it and partitions its master copy; fsdp draws each rank's shard alone"""

    @property
    def total(self) -> int:
        """Bytes on the device at the peak, with the configured activation checkpointing."""
        return max(self.parameters + self.gradients + self.optimizer + self.gathered + self.activations, self.startup)

    @property
    def total_no_checkpointing(self) -> int:
        steady = self.parameters + self.gradients + self.optimizer + self.gathered + self.activations_no_checkpointing
        return max(steady, self.startup)

    @property
    def label(self) -> str:
        if self.engine == "deepspeed":
            return f"deepspeed ZeRO-{self.zero_stage}"
        return f"{self.engine} x ep {self.ep}" if self.ep > 1 else self.engine


def _model_state(cfg: JobConfig, n: int, engine: str, zero_stage: int, mixed: bool, world_size: int, ep: int,
                 cpu_offload: bool) -> dict[str, int]:
    """Bytes of the `n` parameters' model state (`_states`) per device by kind, "host" what cpu_offload moves off."""
    experts = counts(cfg.model).experts if ep > 1 else 0
    # a rank's sharded state: the dense parameters over every rank, its ep rank's experts over the W / ep sharing them
    shard = ceil_div(n - experts, world_size) + ceil_div(ceil_div(experts, ep), world_size // ep)
    sums = {"parameters": 0, "gradients": 0, "optimizer": 0, "host": 0}
    for state in _states(engine, zero_stage, mixed, world_size):
        size = (shard if state.sharded else n) * state.bytes
        sums["host" if cpu_offload and state.offloadable else state.kind] += size
    if cpu_offload and engine == "deepspeed":  # ZeRO-Offload's CPU Adam steps on an fp32 gradient partition
        sums["host"] += ceil_div(n, world_size) * 4
    return sums


def estimate_memory(
    cfg: JobConfig,
    world_size: int,
    engine: str | None = None,
    zero_stage: int | None = None,
    cpu_offload: bool | None = None,
    activation_checkpointing: int | None = None,
    fused_attention: bool = True,
    ep: int | None = None,
) -> MemoryEstimate:
    """Per-device memory of training `cfg` on `world_size` devices; None takes the value from `cfg.parallel`.

    Asking for another engine than the config's takes its ZeRO stage and offload from the arguments
    (stage required for deepspeed, offload off unless given); `ep` is the config's parallel.ep under fsdp, 1 on
    the other engines. See the module docstring for the model.
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

    if ep is None:
        ep = par.ep if engine == "fsdp" else 1
    if ep > 1 and engine != "fsdp":
        raise ValueError(f"ep {ep} goes with engine fsdp only, got {engine}")
    check_ep(cfg, ep, world_size)

    mixed = use_bf16(cfg.train.dtype, device_type(cfg.train.device))  # as the run on this machine would
    n = num_params(cfg.model)
    sums = _model_state(cfg, n, engine, zero_stage, mixed, world_size, ep, cpu_offload)
    whole = 4 * n if engine != "fsdp" else 0  # the fp32 model ddp and DeepSpeed build whole on the host first
    sums["host"] = max(sums["host"], whole)  # moved to the device before any offloaded state is made
    sharded_params = engine == "fsdp" or zero_stage == 3
    gathered = _gathered_units(cfg.model, ep) * (2 + 2 if mixed else 4 + 4) if sharded_params else 0

    c = 2 if mixed else 4
    # the residual stream has the embedding's dtype: fp32 weights under ddp autocast, bf16 weights otherwise
    residual = 2 if mixed and engine != "ddp" else 4
    b = cfg.train.micro_batch_size
    acts, logits = activation_bytes(cfg.model, cfg.data, b, c, residual, activation_checkpointing, fused_attention)
    acts_none, _ = activation_bytes(cfg.model, cfg.data, b, c, residual, 0, fused_attention)
    return MemoryEstimate(
        engine=engine, zero_stage=zero_stage, world_size=world_size, cpu_offload=cpu_offload,
        activation_checkpointing=activation_checkpointing, mixed_precision=mixed, num_params=n,
        parameters=sums["parameters"], gradients=sums["gradients"], optimizer=sums["optimizer"],
        gathered=gathered, activations=acts, activations_no_checkpointing=acts_none, logits=logits,
        host=sums["host"], ep=ep, startup=whole,
    )
