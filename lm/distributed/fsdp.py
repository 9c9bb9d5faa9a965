"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over ranks, block by block.

The model is built on the meta device, sharded, and only then materialised: each rank allocates its own
shards (`to_empty`) and `init_weights` fills them. Random fills draw the full tensor on the CPU and keep
this rank's slice, one parameter at a time, so the weights equal those of an unsharded model with the
same seed at any world size, and no rank ever holds the whole model.
"""

import contextlib
import inspect
import logging
import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode

from lm.config import OptimConfig, ParallelConfig, TrainConfig, use_bf16
from lm.distributed.activation import checkpoint_blocks, compile_blocks
from lm.distributed.context_parallel import ContextParallel
from lm.distributed.env import DistEnv
from lm.distributed.expert_parallel import apply_expert_parallel
from lm.distributed.float8 import all_gathers_float8, precompute_float8_scales
from lm.distributed.layout import device_mesh, expert_meshes, shard_mesh
from lm.distributed.materialize import WeightLoader
from lm.distributed.tensor_parallel import apply_tensor_parallel
from lm.distributed.torch_engine import TorchEngine
from lm.errors import ConfigError
from lm.models.family import Family, TPStyle

log = logging.getLogger(__name__)

# the random fills the models' init_weights use (normal_ and uniform_ are the ones lm's families draw from)
_RANDOM_INITS = {init: inspect.signature(init) for init in (torch.nn.init.normal_, torch.nn.init.uniform_)}


_DISCARD_CHUNK = 1 << 20


def discard_draws(func, numel: int, arguments: dict) -> None:
    """Advance the global CPU generator exactly as `func` (normal_ or uniform_) drawing `numel` values would,
    a chunk at a time so memory stays small. The fills draw 16 values at a time and redo a short tail on their
    last 16, so every chunk but the last is a multiple of 16 and the last is the whole remainder plus one chunk:
    the generator then ends where one whole draw leaves it (tests/distributed/test_pipeline.py checks it)."""
    chunks, rest = divmod(numel, _DISCARD_CHUNK)
    sizes = [numel] if chunks == 0 else [_DISCARD_CHUNK] * (chunks - 1) + [_DISCARD_CHUNK + rest]
    scratch = torch.empty(max(sizes))
    for size in sizes:
        func(scratch[:size], **arguments)


class FullTensorInit(TorchFunctionMode):
    """Inside this mode, `nn.init.normal_` or `nn.init.uniform_` of a sharded parameter draws the whole
    tensor from the global CPU generator and copies this rank's slice, and of a parameter left on the meta device
    (another pipeline stage's) draws and drops its numbers: every rank consumes the same random numbers, in the
    same order, as an unsharded model would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _RANDOM_INITS:
            return func(*args, **kwargs)
        bound = _RANDOM_INITS[func].bind(*args, **kwargs)
        bound.apply_defaults()
        param = bound.arguments.pop("tensor")
        if param.is_meta:  # another pipeline stage's: consume its numbers so this stage's come out the same
            discard_draws(func, param.numel(), bound.arguments)
            return param
        if not isinstance(param, DTensor):
            return func(*args, **kwargs)
        full = torch.empty(param.shape, dtype=param.dtype)
        func(full, **bound.arguments)  # this mode is off inside its own handler: a plain draw
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        with torch.no_grad():
            param.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        return param


def mixed_precision(dtype: str, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 parameters in forward/backward with fp32 gradient reduction on CUDA (train.dtype `dtype` auto or
    bfloat16); fp32 throughout on CPU or with train.dtype float32. The sharded master copy stays fp32."""
    if use_bf16(dtype, device.type):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def check_offload(parallel: ParallelConfig, device_type: str) -> None:
    """Refuse parallel.cpu_offload for a run on the CPU (at launch, and in a dry run whose config says cpu)."""
    if parallel.cpu_offload and device_type != "cuda":
        raise ConfigError("parallel.cpu_offload: FSDP2 offloads a GPU run's shards to host memory; this run is "
                          "on the CPU already, so drop parallel.cpu_offload")


def parallelize(roots: list[nn.Module], blocks: list[nn.Module], family: Family, model: nn.Module,
                parallel: ParallelConfig, train: TrainConfig, env: DistEnv, mesh: DeviceMesh | None) -> None:
    """Parallelise the model's parts `roots` (the whole model, or this rank's pipeline stages) in place, still on
    the meta device: the family's tensor-parallel plan over the mesh's "tp" dimension (parallel.tp > 1), activation
    checkpointing and torch.compile per block, FSDP2 per block in `blocks` and per root over the "dp" dimension (the
    whole world without a mesh); then allocate each root's shards on this rank's device."""
    check_offload(parallel, env.device.type)
    options = {"mp_policy": mixed_precision(train.dtype, env.device)}
    if mesh is not None:
        options["mesh"] = shard_mesh(mesh)
    experts = family.parallel.experts(model) if parallel.ep > 1 else []
    if experts:
        ep_mesh, experts_mesh = expert_meshes(mesh, parallel.ep)
        apply_expert_parallel(experts, ep_mesh)
    if env.tp > 1:
        # the final norm's sequence slice comes out as a view of its DTensor, which FSDP2 warns about on every rank
        # in case the caller changes it in place; the families' losses never do
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
        plan = family.parallel.tensor_styles(model)
        if experts:  # split over the ep ranks already, whole on every tensor-parallel rank
            plan = {name: style for name, style in plan.items() if style is not TPStyle.EXPERTS}
        for root in roots:  # a stage takes the plan's entries for the modules it holds
            names = {name for name, _ in root.named_modules()}
            apply_tensor_parallel(root, {name: style for name, style in plan.items() if name in names}, mesh["tp"])
    checkpoint_blocks(blocks, parallel.activation_checkpointing)
    if parallel.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    if train.compile:
        compile_blocks(blocks)
    if experts:
        shard_experts(experts, {**options, "mesh": experts_mesh}, env.dp_size)
    for block in blocks:
        fully_shard(block, **options)  # what shard_experts sharded already is left to it
    for root in roots:
        fully_shard(root, **options)  # the embeddings, final norm and head: gathered once per forward
        root.to_empty(device="cpu" if parallel.cpu_offload else env.device)
        if parallel.cpu_offload:  # FSDP2 offloads parameters only: a buffer (a router's bias) is read on the device
            for module in root.modules():
                for name, buffer in list(module._buffers.items()):
                    if buffer is not None:
                        module._buffers[name] = buffer.to(env.device)


def shard_experts(modules: list[nn.Module], options: dict, dp_size: int) -> None:
    """FSDP2 over the dp_shard ranks that hold the same experts (`options["mesh"]`), each module on its own, before
    its block's fully_shard. Along dimension 1 (d_model or the hidden units), not 0: a rank's n / ep experts may be
    fewer than those ranks.

    An expert's gradient arrives summed over the tokens of its whole ep group (the all-to-all's backward), and
    FSDP2's reduction sums it over the groups, so it is divided by all `dp_size` data-parallel ranks, as FSDP2
    divides the other weights' gradients: the step equals one process's. Over 2 or more ranks the division comes
    after a plain sum (gloo has no pre-multiplied sum); over one, not: torch 2.13's FSDP2 then divides a forced
    sum's gradient twice (once in its copy for a single rank, once after), which tests/distributed/
    test_expert_parallel.py's gradient norms catch."""
    ranks = options["mesh"].size(-1)  # the shard dimension (under HSDP the replicas come first)
    for module in modules:
        fully_shard(module, **options, shard_placement_fn=lambda param: Shard(1))
        module.set_gradient_divide_factor(float(dp_size))
        module.set_force_sum_reduction_for_comms(ranks > 1)


def shard_model(model: nn.Module, family: Family, parallel: ParallelConfig, train: TrainConfig, env: DistEnv,
                mesh: DeviceMesh | None = None) -> nn.Module:
    """`model` (built on the meta device) sharded in place with fully_shard per block (its family's `blocks`)
    and at the root, then allocated and initialised per rank: every rank draws the whole model's numbers and
    keeps its slices. With parallel.tp > 1 the family's tensor-parallel plan splits the model over the mesh's
    "tp" dimension first, and FSDP2 shards over its "dp" dimension (2-D parallelism).

    Call after seeding the global RNG, as for an unsharded model. With train.compile each block is
    compiled on its own (`compile_blocks`), as under ddp. `mesh`: the run's mesh under tensor or context
    parallelism (`lm.distributed.layout.device_mesh`), else None (the whole world shards).
    """
    parallelize([model], family.blocks(model), family, model, parallel, train, env, mesh)
    with FullTensorInit():
        model.init_weights()
    return model


class FSDPEngine(TorchEngine):
    """FSDP2: parameters, gradients and optimizer state sharded per block; bf16 by its mixed-precision
    policy (no autocast)."""

    name = "fsdp"

    def __init__(self, model: nn.Module, family: Family, parallel: ParallelConfig, train: TrainConfig,
                 optim: OptimConfig, env: DistEnv, load_weights: WeightLoader | None) -> None:
        mesh = device_mesh(env) if max(env.tp, env.cp, env.dp_replicate, parallel.ep) > 1 else None
        shard_model(model, family, parallel, train, env, mesh)
        if parallel.ep > 1:
            experts = family.parallel.experts(model)
            params = [p for m in experts for p in m.parameters()]
            if env.is_main:  # the split as built, which a test reads: an ep ignored would train the same
                log.info("expert parallelism: %d ranks split the experts of %d layers; rank 0 holds %s of their %s "
                         "parameters", parallel.ep, len(experts), f"{sum(p.to_local().numel() for p in params):,}",
                         f"{sum(p.numel() for p in params):,}")
        if load_weights is not None:
            load_weights(model)  # each rank keeps its slices of the full tensors
        # under context parallelism the forward runs this rank's share of each window's tokens
        run = ContextParallel(model, mesh["cp"]).run if env.cp > 1 else model
        super().__init__(model, run, family, train, optim, env, eval_run=run)  # fully_shard works in place
        self.float8_all_gather = all_gathers_float8(train, fsdp=True)

    def optimizer_step(self, norm: torch.Tensor) -> torch.Tensor:
        applied = super().optimizer_step(norm)
        if self.float8_all_gather:  # the next forward all-gathers float8 weights, scaled by their new maxima
            precompute_float8_scales(self.model)
        return applied

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def full_weights(self):
        """Every parameter whole on every rank inside the block, so any method of the model runs (sampling
        that calls methods other than forward, which FSDP's forward hooks never see)."""
        sharded = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for module in sharded:
            module.unshard()
        try:
            yield
        finally:
            for module in sharded:
                module.reshard()
