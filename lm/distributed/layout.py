"""How the ranks of a run are laid out, as one device mesh with named dimensions ("pp", "dp", "tp"): pipeline
stages outermost, then data-parallel replicas (FSDP2), then tensor-parallel groups of parallel.tp consecutive
ranks.

Consecutive ranks share a node under torchrun, so a tensor-parallel group, which talks in every layer, stays
on one node's fast links; FSDP2 gathers once per block and a pipeline sends one activation per micro-batch,
so those can cross nodes.
"""

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lm.config import JobConfig
from lm.distributed.env import DistEnv
from lm.errors import ConfigError


def check_world(cfg: JobConfig, world_size: int) -> None:
    """Refuse, before any process group starts, a layout that does not divide the world size."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if world_size % (tp * pp):
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        what = " x ".join(f"parallel.{key}={n}" for key, n in (("tp", tp), ("pp", pp)) if n > 1)
        raise ConfigError(f"{what} does not divide the world size {world_size} (ranks torchrun started); "
                          f"the product must be one of {', '.join(map(str, fits))}, or start a multiple of "
                          f"{tp * pp} ranks")


def device_mesh(env: DistEnv) -> DeviceMesh:
    """The run's mesh: ("pp", "dp", "tp") of shape (pp, world size / (tp x pp), tp)."""
    device_type = "cuda" if env.device.type == "cuda" else "cpu"
    return init_device_mesh(device_type, (env.pp, env.dp_size, env.tp), mesh_dim_names=("pp", "dp", "tp"))
