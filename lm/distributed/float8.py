"""float8 training through torchao (train.float8), applied from outside the model like the engines' other wrappers.

The family says which linear layers convert (`Family.float8_linears`: module name and shape -> yes or no); those
become torchao's `Float8Linear` on the model still on the meta device, before an engine compiles and shards it.
Their matmuls then run on float8 copies of their inputs, weights and gradients, each scaled by its absolute
maximum: one scale per tensor (tensorwise, the fastest) or one per row (rowwise, more accurate). Under fsdp the
tensorwise weights are all-gathered in float8 (half the bytes of bf16), their scales computed for every weight in
one pass after each optimizer step (`precompute_float8_scales`).

The parameters stay what they were (the fp32 master weights, same names and dtypes), so checkpoints are those of
a bf16 run: a float8 run resumes without float8 and the other way round. torchao is imported only here, and only
when a run asks for float8: `pip install 'lm[float8]'` installs it.
"""

import dataclasses
import importlib.util
import logging

import torch
import torch.nn as nn

from lm.config import TrainConfig, resolve_device
from lm.errors import ConfigError
from lm.models.family import Family, Float8Filter

log = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)
"""The first CUDA compute capability with float8 tensor cores: Ada (8.9), then Hopper (9.0) and later"""
INSTALL = "pip install 'lm[float8]' (or pip install torchao)"


def check_float8(mode: str, device: torch.device) -> None:
    """Refuse train.float8 `mode` on a `device` that cannot run it (not a CUDA GPU of compute capability 8.9 or
    later), or without torchao; nothing for mode off. Called at launch, before any process group or file."""
    if mode == "off":
        return
    need = f"train.float8={mode} needs a CUDA GPU of compute capability 8.9 or later (Ada, Hopper)"
    if device.type != "cuda":
        raise ConfigError(f"{need}; this run's device is {device.type}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise ConfigError(f"{need}; this run's GPU, {torch.cuda.get_device_name(device)}, has {major}.{minor}")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"train.float8={mode} trains through torchao, which is not installed: {INSTALL}")


def check_float8_launch(train: TrainConfig) -> None:
    """`check_float8` of train.device as this machine resolves it (its first GPU: a node's are alike), before any
    process group forms, any data is read or any run directory is made."""
    if train.float8 != "off":
        check_float8(train.float8, resolve_device(train.device, "train.device"))


def float8_layers(model: nn.Module, choose: Float8Filter) -> list[str]:
    """The names of `model`'s nn.Linear layers that `choose` (a family's `float8_linears`) converts, in model order."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and choose(name, module.in_features, module.out_features)]


def float8_config(mode: str, fsdp: bool, emulate: bool = False):
    """torchao's `Float8LinearConfig` of recipe `mode` (tensorwise or rowwise). Tensorwise weights are all-gathered
    in float8 under fsdp; torchao has no such all-gather for rowwise scales. `emulate`: float8 matmuls emulated in
    the input's dtype, which runs anywhere (the tests' CPU)."""
    from torchao.float8 import Float8LinearConfig

    if mode == "rowwise":
        return dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp, emulate=emulate)


def convert_float8(model: nn.Module, choose: Float8Filter, config) -> list[str]:
    """Swap the nn.Linear layers of `model` that `choose` picks for torchao's Float8Linear of `config`, in place
    (on the meta device too); their names. Parameters keep their names, shapes and dtypes."""
    from torchao.float8 import convert_to_float8_training

    chosen = set(float8_layers(model, choose))
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    return [name for name in float8_layers(model, choose) if name in chosen]


def apply_float8(model: nn.Module, family: Family, train: TrainConfig, fsdp: bool, device: torch.device,
                 is_main: bool) -> None:
    """train.float8's layers converted in `model` (built on the meta device, not yet wrapped) of `family`: nothing
    for off. `fsdp`: the engine shards the model, so tensorwise weights are all-gathered in float8."""
    if train.float8 == "off":
        return
    check_float8(train.float8, device)  # at launch already; again for the tools that build an engine themselves
    chosen = float8_layers(model, family.float8_linears)
    if not chosen:
        raise ConfigError(f"train.float8={train.float8}: {family.title} (model.arch={family.name}) has no linear "
                          "layer to train in float8 (outside its head, with both dimensions multiples of 16); set "
                          "train.float8=off")
    convert_float8(model, family.float8_linears, float8_config(train.float8, fsdp))
    if is_main:
        log.info("float8 (%s): %d linear layers, from %s to %s", train.float8, len(chosen), chosen[0], chosen[-1])
        if not train.compile:
            log.warning("train.float8 without train.compile: torchao's float8 casts run unfused, and eager float8 "
                        "steps are slower than bf16 ones; set train.compile=true")


def all_gathers_float8(train: TrainConfig, fsdp: bool) -> bool:
    """Whether FSDP2 all-gathers the weights in float8 (tensorwise under fsdp): then their scales are computed
    after each optimizer step (`precompute_float8_scales`)."""
    return fsdp and train.float8 == "tensorwise"


def precompute_float8_scales(model: nn.Module) -> None:
    """The float8 scales of every FSDP-sharded float8 weight of `model`, after an optimizer step changed them: one
    all-reduce of their absolute maxima for all weights, instead of one per weight in the next forward."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
