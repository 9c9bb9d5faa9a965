"""HSDP (parallel.dp_replicate): FSDP2 within groups of ranks, the groups replicating each other, on real gloo
groups: the same losses as one process, and its checkpoint resumes in one process."""

import pytest

from lm.config import load_config
from lm.distributed.layout import check_world
from lm.errors import ConfigError
from tests.distributed.test_engines import held_share, resume_copy, train
from tests.distributed.test_pipeline import LLAMA4, assert_same, one_process_run


@pytest.mark.process
def test_two_groups_of_two_train_like_one_process_and_resume_in_one(tiny_data_dir, tmp_path, tmp_path_factory):
    _, one = one_process_run(tiny_data_dir, tmp_path_factory, *LLAMA4)  # the pipeline layouts' reference
    assert_same(train(4, tmp_path / "hsdp", tiny_data_dir, *LLAMA4, "--parallel.dp_replicate=2"), one, range(1, 11))
    # sharded over a group of 2, not over all 4 ranks
    assert held_share(tmp_path / "hsdp") == pytest.approx(1 / 2, abs=0.02)
    run = resume_copy(tmp_path / "hsdp", tmp_path / "resumed", step=5)
    assert_same(train(1, run, tiny_data_dir, *LLAMA4), one, range(6, 11))


@pytest.mark.parametrize("flags, message", [
    (["--parallel.dp_replicate=2"], "parallel.dp_replicate: HSDP composes with FSDP2 (parallel.engine=fsdp); the "
     "ddp engine"),
    (["--parallel.dp_replicate=0", "--parallel.engine=fsdp"], "parallel.dp_replicate: must be >= 1"),
])
def test_hsdp_outside_fsdp_is_refused(flags, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, flags)
    assert message in str(err.value)


def test_replica_groups_that_do_not_divide_the_world_are_refused():
    cfg = load_config(None, ["--parallel.engine=fsdp", "--parallel.dp_replicate=3", "--parallel.tp=2",
                             "--model.n_head=6", "--model.d_model=48"])
    with pytest.raises(ConfigError) as err:
        check_world(cfg, 4)
    assert str(err.value).startswith("parallel.tp=2 x parallel.dp_replicate=3 does not divide the world size 4")
