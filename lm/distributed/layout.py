"""How the ranks of a run are laid out: tensor-parallel groups of parallel.tp consecutive ranks, and data
parallelism over the rest, as one device mesh with named dimensions ("dp", "tp").

Consecutive ranks share a node under torchrun, so a tensor-parallel group, which talks in every layer, stays
on one node's fast links while FSDP2's once-per-block traffic crosses nodes.
"""

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lm.config import JobConfig
from lm.distributed.env import DistEnv
from lm.errors import ConfigError


def check_world(cfg: JobConfig, world_size: int) -> None:
    """Refuse, before any process group starts, a layout that does not divide the world size."""
    tp = cfg.parallel.tp
    if world_size % tp:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"parallel.tp={tp} does not divide the world size {world_size} (ranks torchrun started); "
                          f"use one of {', '.join(map(str, fits))}, or start a multiple of {tp} ranks")

def device_mesh(env: DistEnv) -> DeviceMesh:
    """The run's mesh: ("dp", "tp") of shape (world size / tp, tp), tensor-parallel ranks innermost."""
    device_type = "cuda" if env.device.type == "cuda" else "cpu"
    return init_device_mesh(device_type, (env.dp_size, env.tp), mesh_dim_names=("dp", "tp"))

