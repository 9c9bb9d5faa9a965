"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over ranks, block by block.

The model is built on the meta device, sharded, and only then materialised: each rank allocates its own
shards (`to_empty`) and `init_weights` fills them. Random fills draw the full tensor on the CPU and keep
this rank's slice, one parameter at a time, so the weights equal those of an unsharded model with the
same seed at any world size, and no rank ever holds the whole model.
"""

import inspect
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode

from lm.config import ConfigError, JobConfig
from lm.distributed.activation import checkpoint_blocks, compile_blocks, model_blocks
from lm.distributed.env import DistEnv
from lm.models.factory import build_model

# the random fills the models' init_weights use (normal_: GPT, encoder-decoder; uniform_: LSTM)
_RANDOM_INITS = {init: inspect.signature(init) for init in (torch.nn.init.normal_, torch.nn.init.uniform_)}


class FullTensorInit(TorchFunctionMode):
    """Inside this mode, `nn.init.normal_` or `nn.init.uniform_` of a sharded parameter draws the whole
    tensor from the global CPU generator and copies this rank's slice: every rank consumes the same random
    numbers, in the same order, as an unsharded model would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _RANDOM_INITS:
            return func(*args, **kwargs)
        bound = _RANDOM_INITS[func].bind(*args, **kwargs)
        bound.apply_defaults()
        param = bound.arguments.pop("tensor")
        if not isinstance(param, DTensor):
            return func(*args, **kwargs)
        full = torch.empty(param.shape, dtype=param.dtype)
        func(full, **bound.arguments)  # this mode is off inside its own handler: a plain draw
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        with torch.no_grad():
            param.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        return param


def mixed_precision(cfg: JobConfig, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 parameters in forward/backward with fp32 gradient reduction on CUDA (train.dtype auto or
    bfloat16); fp32 throughout on CPU or with train.dtype float32. The sharded master copy stays fp32."""
    dtype = cfg.train.dtype
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def build_fsdp_model(cfg: JobConfig, env: DistEnv) -> nn.Module:
    """The config's model, sharded with fully_shard per block and at the root, initialised per rank.

    Call after seeding the global RNG, as for an unsharded model. With train.compile each block is
    compiled on its own (`compile_blocks`), as under ddp.
    """
    if cfg.parallel.cpu_offload and env.device.type != "cuda":
        raise ConfigError("parallel.cpu_offload: FSDP2 offloads a GPU run's shards to host memory; this run is "
                          "on the CPU already, so drop parallel.cpu_offload")
    with torch.device("meta"):
        model = build_model(cfg.model)
    checkpoint_blocks(model, cfg.parallel.activation_checkpointing)
    options = {"mp_policy": mixed_precision(cfg, env.device)}
    if cfg.parallel.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    if cfg.train.compile:
        compile_blocks(model)
    for block in model_blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)  # the embeddings, final norm and head: gathered once per forward
    model.to_empty(device="cpu" if cfg.parallel.cpu_offload else env.device)
    with FullTensorInit():
        model.init_weights()
    return model


def load_full_weights(model: nn.Module, path: Path) -> None:
    """Load a consolidated safetensors file (every rank reads it whole) into the sharded model: each rank
    keeps its slices of the full tensors."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lm.consolidate import read_consolidated_config, tied_names

    read_consolidated_config(path)  # a readable lm file, or one clear error
    weights = load_file(str(path), device="cpu")
    for alias, name in tied_names(model).items():  # the tied head is stored once, under its embedding
        weights.setdefault(alias, weights[name])
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
