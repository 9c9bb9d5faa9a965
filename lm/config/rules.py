"""The decisions that every tool makes the same way: which device, whether bf16, what changed in a config.

Each rule has this one home; the trainer, the engines, the memory planner and the tools all call it, so
they cannot drift apart.
"""

from typing import TYPE_CHECKING

from lm.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")
MAX_SEED = 2**63 - 1
"""The largest seed (train.seed, a tool's --seed): torch's seeds are 64-bit, and lm.sample's --num-samples adds
the sample's index."""
DTYPES = ("auto", "bfloat16", "float32")


def one_of(values: tuple[str, ...]) -> str:
    """`a, b or c`, for messages that list the values a setting takes."""
    return f"{', '.join(values[:-1])} or {values[-1]}"


def device_type(requested: str) -> str:
    """`cpu` or `cuda`: `auto` is cuda when torch sees a GPU, cpu otherwise; the others are taken as given."""
    if requested not in DEVICES:
        raise ValueError(f"device: expected {one_of(DEVICES)}, got {requested!r}")
    if requested != "auto":
        return requested
    import torch  # here, not above: reading or writing a config needs no torch (lm.prepare never imports it)

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str, key: str, index: int = 0) -> "torch.device":
    """The device to run on, from a setting `requested` (auto, cpu or cuda) named `key` in errors.

    `cuda` on a machine where torch sees no GPU is one clear ConfigError, for training and every tool
    alike: nothing falls back to the CPU without being asked. `index` picks the GPU (a rank's local rank).
    """
    import torch

    if requested not in DEVICES:
        raise ConfigError(f"{key}: expected {one_of(DEVICES)}, got {requested!r}")
    if device_type(requested) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}: cuda asked for, but torch sees no CUDA device; use cpu (or auto)")
    return torch.device("cuda", index)


def use_bf16(dtype: str, device: str) -> bool:
    """Whether a run computes in bfloat16: `train.dtype` bfloat16, or auto on CUDA. On a CPU auto means
    float32, since bf16 autocast is slower there. `device` is a device type, cpu or cuda (`device_type`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected {one_of(DTYPES)}, got {dtype!r}")
    return dtype == "bfloat16" or (dtype == "auto" and device == "cuda")


def config_diff(old: dict, new: dict, sections: tuple[str, ...] | None = None,
                ignore: tuple[str, ...] = ()) -> dict[str, tuple[object, object]]:
    """{"section.key": (old value, new value)} for every key whose value differs between two config
    dicts (`JobConfig.to_dict()` or its YAML), in `new`'s order. `sections` limits the comparison to
    those sections; `ignore` leaves out sections or dotted keys. A key `old` lacks compares as None."""
    return {
        f"{section}.{key}": (old.get(section, {}).get(key), value)
        for section, values in new.items() if (sections is None or section in sections) and section not in ignore
        for key, value in values.items()
        if f"{section}.{key}" not in ignore and old.get(section, {}).get(key) != value
    }


def batch_split_problem(batch_size: int, micro_batch_size: int, replicas: int, of: str) -> str | None:
    """Why a global batch of `batch_size` samples does not split over `replicas` data-parallel replicas (`of`: how
    they were counted, e.g. `world size 8 / (tp 2)`), or None. Each replica's share must be a whole number of
    micro-batches. Every tool that lays out ranks (the trainer, lm.layouts, the planner) asks this one rule."""
    if batch_size % (micro_batch_size * replicas) == 0:
        return None
    return (f"train.batch_size: {batch_size} is not a multiple of train.micro_batch_size ({micro_batch_size}) x "
            f"{replicas} data-parallel replica(s) ({of}); expected a multiple of {micro_batch_size * replicas}, or a "
            f"number of replicas that divides its {batch_size // micro_batch_size} micro-batches")
