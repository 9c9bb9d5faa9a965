"""How the ranks of a run are laid out, as one device mesh with named dimensions ("pp", "dp", "tp"): pipeline
stages outermost, then data-parallel replicas (FSDP2), then tensor-parallel groups of parallel.tp consecutive
ranks. Expert parallelism splits the data-parallel ranks further (`expert_meshes`).

Consecutive ranks share a node under torchrun, so a tensor-parallel group, which talks in every layer, stays
on one node's fast links; FSDP2 gathers once per block and a pipeline sends one activation per micro-batch,
so those can cross nodes.
"""

import warnings

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lm.config import JobConfig
from lm.config.rules import batch_split_problem
from lm.distributed.env import DistEnv
from lm.errors import ConfigError


def check_world(cfg: JobConfig, world_size: int) -> None:
    """Refuse, before any process group starts, a layout that does not divide the world size or whose global batch
    does not split over its data-parallel replicas."""
    par = cfg.parallel
    tp, pp, cp, replicas = par.tp, par.pp, par.cp, par.dp_replicate
    if world_size % (tp * pp * cp * replicas):
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        what = " x ".join(f"parallel.{key}={n}" for key, n in (("tp", tp), ("cp", cp), ("pp", pp),
                                                                ("dp_replicate", replicas)) if n > 1)
        raise ConfigError(f"{what} does not divide the world size {world_size} (ranks torchrun started); "
                          f"the product must be one of {', '.join(map(str, fits))}, or start a multiple of "
                          f"{tp * pp * cp * replicas} ranks")
    dp_shard = world_size // (tp * pp * cp * replicas)
    if dp_shard % par.ep:
        fits = [str(d) for d in range(1, dp_shard + 1) if dp_shard % d == 0]
        raise ConfigError(f"parallel.ep={par.ep} does not divide the {dp_shard} data-parallel rank(s) that shard the "
                          f"model (world size {world_size} / (tp {tp} x cp {cp} x pp {pp} x dp_replicate "
                          f"{replicas})), which the expert-parallel ranks are taken from; expected one of "
                          f"{', '.join(fits)}, or start a multiple of {tp * pp * cp * replicas * par.ep} ranks")
    check_batch_split(cfg, world_size)
    if pp > 1:
        check_micro_batches(cfg, world_size // (tp * pp * cp))


def check_batch_split(cfg: JobConfig, world_size: int) -> None:
    """Every data-parallel replica's share of a global batch is a whole number of micro-batches. The replicas are
    world size / (tp x cp x pp): the ranks of one tensor- or context-parallel group, and the stages of one pipeline,
    read the same samples."""
    par, train = cfg.parallel, cfg.train
    model_ranks = par.tp * par.cp * par.pp
    split = " x ".join(f"{key} {n}" for key, n in (("tp", par.tp), ("cp", par.cp), ("pp", par.pp)) if n > 1)
    of = f"world size {world_size} / ({split})" if model_ranks > 1 else f"world size {world_size}"
    if problem := batch_split_problem(train.batch_size, train.micro_batch_size, world_size // model_ranks, of):
        raise ConfigError(problem)


def check_micro_batches(cfg: JobConfig, replicas: int) -> None:
    """What torch's pipeline schedules need of a step's micro-batches: 1F1B at least one per stage, interleaved
    1F1B a count its n // pp rounds split evenly (a step whose batch does not split evenly is refused by the
    loader)."""
    par, train = cfg.parallel, cfg.train
    n = train.batch_size // (train.micro_batch_size * replicas)
    split = (f"train.batch_size {train.batch_size} / (train.micro_batch_size {train.micro_batch_size} x "
             f"{replicas} data-parallel replicas)")
    if par.pp_schedule != "gpipe" and n < par.pp:
        raise ConfigError(f"parallel.pp={par.pp}: {par.pp_schedule} needs at least one micro-batch per pipeline "
                          f"rank, and a step has {n} ({split}); raise train.batch_size or lower "
                          "train.micro_batch_size")
    rounds = max(1, n // par.pp)
    if par.pp_schedule == "interleaved_1f1b" and n % rounds:
        raise ConfigError(f"parallel.pp={par.pp}: interleaved_1f1b splits a step's micro-batches into "
                          f"micro-batches // pp rounds of equal size, and a step's {n} ({split}) do not split into "
                          f"{rounds}; use a multiple of {par.pp}")


def device_mesh(env: DistEnv) -> DeviceMesh:
    """The run's mesh: ("pp", "dp_replicate", "dp_shard", "cp", "tp"), the data-parallel ranks world size /
    (tp x cp x pp) as dp_replicate HSDP groups of dp_shard."""
    device_type = "cuda" if env.device.type == "cuda" else "cpu"
    shape = (env.pp, env.dp_replicate, env.dp_size // env.dp_replicate, env.cp, env.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: the data-parallel ranks, and with context parallelism its ranks too (they hold
    the same weights and add their gradients like replicas); 2-D (replicate, shard) under HSDP."""
    shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if mesh["cp"].size() > 1 else mesh["dp_shard"]
    if mesh["dp_replicate"].size() == 1:
        return shard
    if mesh["cp"].size() > 1:
        # torch 2.13 warns on every rank that slicing a flattened dimension from the root mesh will change (after
        # 2.11); it is the way torchtitan builds this mesh today
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            return mesh["dp_replicate", "dp_shard_cp"]
    return mesh["dp_replicate", "dp_shard"]


def expert_meshes(mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """The ep ranks that split the experts between them, and the mesh FSDP2 shards each rank's experts over: the
    run's dp_shard dimension split as (dp_shard_mod_ep, ep), ep innermost (torchtitan's layout) so that the
    all-to-all of every layer runs between consecutive ranks, on one node; under HSDP the replicas too."""
    dp_shard = mesh["dp_shard"].size()
    # by index: torch 2.11's _unflatten refuses every dimension given by name
    split = mesh._unflatten(mesh.mesh_dim_names.index("dp_shard"), (dp_shard // ep, ep), ("dp_shard_mod_ep", "ep"))
    # the experts' weights are sharded over these two dimensions together (replicated over HSDP's replicas);
    # flattened once, a norm over them is one all-reduce, the same on every rank, not one per dimension (which
    # torch warns of)
    split["dp_shard_mod_ep", "ep"]._flatten()
    shard = ("dp_replicate", "dp_shard_mod_ep") if mesh["dp_replicate"].size() > 1 else ("dp_shard_mod_ep",)
    return split["ep"], split[shard]
