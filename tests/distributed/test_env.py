"""The process group a run joins (`lm.distributed.env`)."""

import logging
import os

import pytest
import torch

from lm.distributed.env import DistEnv, group_backend, init_distributed
from tests.workers import pool


def test_cpu_offload_on_cuda_adds_a_cpu_backend_beside_nccl():
    # FSDP2's offloaded gradients are host DTensors whose norm is all-reduced where they are: a group of NCCL
    # alone ended the first step with "No backend type associated with device type cpu"
    cuda = torch.device("cuda", 0)
    assert group_backend(cuda, cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert group_backend(cuda) == "nccl"
    assert group_backend(torch.device("cpu")) == group_backend(torch.device("cpu"), cpu_offload=True) == "gloo"


def reduce_on_two_ranks(tp: int) -> tuple[float, bool, bool]:
    import torch.distributed as dist

    rank = dist.get_rank()
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), tp=tp)
    mean = env.all_reduce_mean(torch.tensor(float(rank))).item()
    return mean, env.any_rank(rank == 1), env.any_rank(False)


@pytest.mark.process
@pytest.mark.parametrize("tp", [1, 2])
def test_a_mean_is_over_every_rank_and_a_flag_of_one_rank_reaches_all(tp):
    # under tensor parallelism too (one data-parallel replica of 2 ranks): the validation loss is each rank's sum
    # over the world, whatever the layout; a stop signal or a failed write on one rank is every rank's
    for rank, reply in enumerate(pool(2).run(reduce_on_two_ranks, tp)):
        assert reply["value"] == (0.5, True, False), rank


@pytest.mark.parametrize("pp, dp, cp, tp", [(2, 2, 1, 2), (1, 2, 2, 2), (1, 4, 1, 2)])
def test_each_ranks_place_follows_the_meshs_order_of_dimensions(pp, dp, cp, tp):
    # ranks laid out as (pp, dp, cp, tp), tp innermost, as the device mesh takes them
    world = pp * dp * cp * tp
    grid = torch.arange(world).reshape(pp, dp, cp, tp)
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    rank = int(grid[p, d, c, t])
                    env = DistEnv(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"), tp=tp,
                                  pp=pp, cp=cp)
                    assert (env.dp_size, env.pp_rank, env.dp_rank, env.cp_rank) == (dp, p, d, c), rank


def joined_env() -> tuple[int, int, int, bool, int]:
    before = os.environ["LOCAL_RANK"]
    os.environ["LOCAL_RANK"] = "0"  # two machines of one process each: both are local rank 0
    try:
        env = init_distributed("cpu")
    finally:
        os.environ["LOCAL_RANK"] = before
    return env.rank, env.local_rank, env.world_size, env.is_main, logging.getLogger().level


@pytest.mark.process
def test_ranks_come_from_torchrun_and_only_rank_0_logs_below_warnings():
    replies = [reply["value"] for reply in pool(2).run(joined_env)]
    assert replies == [(0, 0, 2, True, logging.INFO), (1, 0, 2, False, logging.WARNING)]
