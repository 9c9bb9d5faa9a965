"""The worker pools of `tests.workers`: jobs run in every rank of a live gloo group, each in the environment the
test gives it, and a job that fails on one rank fails with that rank's error, its pool replaced by a fresh one."""

import os
import time
from pathlib import Path

import pytest

from tests.workers import WorkerError, job_env, pool, train_in_pool

pytestmark = pytest.mark.process  # it starts worker pools


def ranks_and_sum(add: int) -> tuple[int, int, float, str | None]:
    import torch
    import torch.distributed as dist

    value = torch.tensor(float(dist.get_rank() + add))
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item(), os.environ.get("LM_WORKERS_PROBE")


def fail_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    print("rank 0 waits in a barrier", flush=True)
    dist.barrier()  # rank 0 waits for a rank that never comes


def test_a_job_runs_in_every_rank_of_one_group_with_the_tests_environment(monkeypatch):
    monkeypatch.setenv("LM_WORKERS_PROBE", "yes")
    replies = pool(2).run(ranks_and_sum, 10)
    assert [r["value"] for r in replies] == [(0, 2, 21.0, "yes"), (1, 2, 21.0, "yes")]
    monkeypatch.delenv("LM_WORKERS_PROBE")
    assert pool(2).run(ranks_and_sum, 0)[1]["value"] == (1, 2, 1.0, None)


def test_a_job_that_fails_on_one_rank_fails_with_its_error_and_the_next_job_gets_a_fresh_pool():
    before = pool(2)
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)rank 1: Traceback.*ValueError: rank 1 gives up.*"
                                          r"rank 0 did not answer in time\n--- stdout:\nrank 0 waits in a barrier"):
        before.run(fail_on_rank_one, grace_s=2)
    assert time.monotonic() - started < 60
    assert not before.alive
    after = pool(2)
    assert after is not before
    assert [r["value"][2] for r in after.run(ranks_and_sum, 0)] == [1.0, 1.0]


def abort_on_rank_one() -> None:
    import sys

    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("rank 1 is about to abort", file=sys.stderr, flush=True)
        os.abort()  # as a C++ exception no one catches ends a process: SIGABRT, no Python traceback
    dist.barrier()


def test_a_rank_that_dies_fails_the_job_with_what_it_wrote_its_python_stack_and_the_pools_earlier_tests(monkeypatch):
    workers = pool(2)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/earlier.py::test_before (call)")
    workers.run(ranks_and_sum, 0)
    monkeypatch.undo()
    with pytest.raises(WorkerError, match=r"(?s)rank 1 died \(exit code -6\).*rank 1 is about to abort.*"
                                          r"Fatal Python error: Aborted.*in abort_on_rank_one.*this one last:\n.*"
                                          r"tests/earlier.py::test_before\n"
                                          r"tests/test_workers.py::test_a_rank_that_dies\w+$"):
        workers.run(abort_on_rank_one, grace_s=2)


def test_lm_trains_error_line_reaches_the_test(tmp_path):
    with pytest.raises(WorkerError, match=r"error: train.steps"):
        train_in_pool(2, ["--train.steps=0", f"--train.out_dir={tmp_path / 'run'}"], job_env())


def destroy_group() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def test_a_job_that_destroys_the_pools_group_fails_and_the_next_job_gets_a_fresh_pool():
    with pytest.raises(WorkerError, match="the job destroyed the pool's process group"):
        pool(2).run(destroy_group)
    assert pool(2).run(ranks_and_sum, 0)[0]["value"][:3] == (0, 2, 1.0)


def make_groups(n: int) -> tuple[int, int, int]:
    """Make and use `n` groups of both ranks: how many distinct ones that gave, this rank's process groups, and
    its gloo event-loop threads."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    made = [dist.new_group([0, 1]) for _ in range(n)]
    for group in made:
        dist.all_reduce(torch.ones(1), group=group)
    threads = [Path(t, "comm").read_text().strip() for t in Path("/proc/self/task").iterdir()]
    # gloo's event loops: named by torch 2.13 (so counted by name there); torch 2.11 leaves them the main thread's
    named = threads.count("gloo_tcp_loop")
    loops = named if named or torch.__version__ >= "2.13" else threads.count("python") - 1
    return len(set(map(id, made))), len(distributed_c10d._world.pg_map), loops


def test_a_job_gets_the_groups_earlier_jobs_made_and_distinct_ones_within_itself():
    workers = pool(2)
    groups = workers.run(make_groups, 0)[0]["value"][1]
    # two event loops whatever the groups: the pool's group's device, and the one device all later groups share
    assert workers.run(make_groups, 2)[0]["value"] == (2, groups + 2, 2)
    assert workers.run(make_groups, 2)[0]["value"] == (2, groups + 2, 2)  # no new group
    assert workers.run(make_groups, 3)[0]["value"] == (3, groups + 3, 2)


def destroy_a_group() -> None:
    import torch.distributed as dist

    dist.destroy_process_group(dist.new_group([0, 1]))


def test_a_job_asking_for_a_group_an_earlier_job_destroyed_fails_and_the_next_job_gets_a_fresh_pool():
    workers = pool(2)
    workers.run(destroy_a_group)
    with pytest.raises(WorkerError, match=r"an earlier job destroyed the group of ranks \[0, 1\]"):
        workers.run(destroy_a_group)
    assert pool(2).run(ranks_and_sum, 0)[0]["value"][:3] == (0, 2, 1.0)
