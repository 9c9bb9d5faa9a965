"""The run's device mesh (`lm.distributed.layout`) on a pool of 4 gloo ranks: which ranks each dimension groups.
A layout whose dimensions came out in another order would still train like one process (the same batches on
the same weights), so only the groups themselves show it."""

import pytest
import torch

from lm.config import load_config
from lm.distributed.env import DistEnv
from lm.distributed.layout import check_batch_split, check_world, device_mesh, expert_meshes, shard_mesh
from lm.errors import ConfigError
from tests.workers import pool


def groups(tp: int, cp: int, dp_replicate: int, ep: int) -> dict[str, list[int]]:
    import torch.distributed as dist

    rank = dist.get_rank()
    env = DistEnv(rank=rank, local_rank=rank, world_size=4, device=torch.device("cpu"), tp=tp, cp=cp,
                  dp_replicate=dp_replicate)
    mesh = device_mesh(env)
    found = {name: mesh[name].mesh.tolist() for name in ("tp", "cp", "dp_replicate", "dp_shard")}
    if ep > 1:
        ep_mesh, _ = expert_meshes(mesh, ep)
        found["ep"] = ep_mesh.mesh.tolist()
    return found


@pytest.mark.process
@pytest.mark.parametrize("tp, cp, dp_replicate, ep, expected", [
    # tensor parallelism innermost: consecutive ranks; the data-parallel ranks across them
    (2, 1, 1, 1, lambda r: {"tp": [r // 2 * 2, r // 2 * 2 + 1], "cp": [r], "dp_shard": [r % 2, r % 2 + 2]}),
    (1, 2, 1, 1, lambda r: {"tp": [r], "cp": [r // 2 * 2, r // 2 * 2 + 1], "dp_shard": [r % 2, r % 2 + 2]}),
    # HSDP: replicas of 2 consecutive ranks each
    (1, 1, 2, 1, lambda r: {"dp_replicate": [r % 2, r % 2 + 2], "dp_shard": [r // 2 * 2, r // 2 * 2 + 1]}),
    # experts over consecutive ranks (one node's all-to-all), ep of 2 and of all 4
    (1, 1, 1, 2, lambda r: {"dp_shard": [0, 1, 2, 3], "ep": [r // 2 * 2, r // 2 * 2 + 1]}),
    (1, 1, 1, 4, lambda r: {"ep": [0, 1, 2, 3]}),
], ids=["tp2", "cp2", "hsdp2", "ep2", "ep4"])
def test_each_dimension_groups_the_ranks_the_layout_says(tp, cp, dp_replicate, ep, expected):
    for rank, found in enumerate(r["value"] for r in pool(4).run(groups, tp, cp, dp_replicate, ep)):
        want = expected(rank)
        assert {name: found[name] for name in want} == want, (rank, found)


def test_hsdp_replicas_count_in_the_batch_split():
    # 4 ranks as 2 replicas of 2: a batch of 6 micro-batches is 1.5 per rank
    cfg = load_config(None, ["--parallel.engine=fsdp", "--parallel.dp_replicate=2", "--train.batch_size=6",
                             "--train.micro_batch_size=1"])
    with pytest.raises(ConfigError, match=r"train.batch_size: 6 is not a multiple of train.micro_batch_size \(1\) x "
                                          r"4 data-parallel replica"):
        check_batch_split(cfg, 4)
    check_batch_split(load_config(None, ["--parallel.engine=fsdp", "--parallel.dp_replicate=2",
                                         "--train.batch_size=8", "--train.micro_batch_size=1"]), 4)


@pytest.mark.parametrize("layout, split", [(["--parallel.tp=2"], "tp 2 x cp 1 x pp 1 x dp_replicate 1"),
                                           (["--parallel.dp_replicate=2"], "tp 1 x cp 1 x pp 1 x dp_replicate 2")])
def test_expert_parallel_ranks_are_counted_in_the_data_parallel_ranks_of_one_replica(layout, split):
    # 4 ranks under tp=2, or as 2 HSDP replicas, leave 2 ranks that shard the model: ep=4 divides the world size
    # but not them, and ep=2 fits
    flags = ["--parallel.engine=fsdp", "--model.n_experts=4", *layout]
    with pytest.raises(ConfigError, match=r"parallel.ep=4 does not divide the 2 data-parallel rank\(s\) that shard "
                                          rf"the model \(world size 4 / \({split}\)\)"):
        check_world(load_config(None, [*flags, "--parallel.ep=4"]), 4)
    check_world(load_config(None, [*flags, "--parallel.ep=2"]), 4)


def shard_groups(cp: int, dp_replicate: int) -> list:
    import torch.distributed as dist

    rank = dist.get_rank()
    env = DistEnv(rank=rank, local_rank=rank, world_size=4, device=torch.device("cpu"), cp=cp,
                  dp_replicate=dp_replicate)
    return shard_mesh(device_mesh(env)).mesh.tolist()


@pytest.mark.process
@pytest.mark.parametrize("cp, dp_replicate, expected", [
    # the context-parallel ranks hold the same weights: FSDP2 shards over them with the data-parallel ones
    (2, 1, [0, 1, 2, 3]),
    # HSDP: a replica of 2 consecutive ranks each, the shards all-reduced across the replicas
    (1, 2, [[0, 1], [2, 3]]),
    # both: each replica is one context-parallel pair, and its shards span the pair
    (2, 2, [[0, 1], [2, 3]]),
], ids=["cp2", "hsdp2", "cp2_hsdp2"])
def test_fsdp2_shards_over_the_data_and_context_parallel_ranks_of_each_replica(cp, dp_replicate, expected):
    for rank, found in enumerate(r["value"] for r in pool(4).run(shard_groups, cp, dp_replicate)):
        assert found == expected, (rank, found)
