"""The run's device mesh (`lm.distributed.layout`) on a pool of 4 gloo ranks: which ranks each dimension groups.
A layout whose dimensions came out in another order would still train like one process (the same batches on
the same weights), so only the groups themselves show it."""

import pytest
import torch

from lm.config import load_config
from lm.distributed.env import DistEnv
from lm.distributed.layout import check_batch_split, device_mesh, expert_meshes
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
