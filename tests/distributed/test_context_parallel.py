"""Context parallelism (parallel.cp) with FSDP2 on real gloo groups: each window's tokens split over ranks,
keys and values gathered in every attention layer; the same losses as one process, checkpoints that resume
without it, the same token-to-rank map as torch's `context_parallel`, and the layouts refused."""

import pytest
import torch
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

from lm.config import load_config
from lm.distributed.context_parallel import shard_indices
from lm.distributed.layout import check_world
from lm.errors import ConfigError
from tests.distributed.test_engines import held_share, resume_copy, train, val_losses
from tests.distributed.test_pipeline import LLAMA4, MICRO4, assert_same, one_process_run


@pytest.mark.process
def test_cp2_by_fsdp2_trains_like_one_process_and_resumes_without_it(tiny_data_dir, tmp_path, tmp_path_factory):
    _, one = one_process_run(tiny_data_dir, tmp_path_factory, *LLAMA4)  # the pipeline layouts' reference
    # one micro-batch a rank (the next test accumulates 2 under cp)
    cp2dp2 = train(4, tmp_path / "cp2dp2", tiny_data_dir, *LLAMA4, "--parallel.cp=2", *MICRO4)
    assert_same(cp2dp2, one, range(1, 11))
    assert held_share(tmp_path / "cp2dp2") == pytest.approx(1 / 4, abs=0.02)  # sharded over dp x cp
    run = resume_copy(tmp_path / "cp2dp2", tmp_path / "resumed", step=5)
    assert_same(train(1, run, tiny_data_dir, *LLAMA4), one, range(6, 11))


@pytest.mark.process
def test_cp2_matches_one_process_with_learned_positions_recomputation_and_z_loss(tiny_data_dir, tmp_path,
                                                                                   tmp_path_factory):
    # tensor parallelism's gpt2 case in the same order: its one-process run serves both
    flags = ["--parallel.engine=fsdp", "--model.n_head=4", "--train.steps=4", "--parallel.activation_checkpointing=1",
             "--optim.z_loss=1e-4", *MICRO4]  # 2 micro-batches a step
    # micro-batches of 4 on one process too: validation reads train.eval_batches micro-batches, so their size sets
    # the windows it scores
    one_dir, one = one_process_run(tiny_data_dir, tmp_path_factory, *flags)
    cp2 = train(2, tmp_path / "cp2", tiny_data_dir, *flags, "--parallel.cp=2")
    assert_same(cp2, one, range(1, 5))
    want = val_losses(one_dir)  # validation through the context-parallel forward too
    assert want and sorted(val_losses(tmp_path / "cp2")) == sorted(want)
    assert_same(val_losses(tmp_path / "cp2"), want, sorted(want))


@pytest.mark.parametrize("length, cp", [(8, 2), (16, 2), (24, 3), (32, 4), (64, 8)])
def test_ranks_hold_the_tokens_torchs_head_tail_balancer_gives_them(length, cp):
    # torch's context_parallel (the CUDA ring attention) reorders a window by these indices and cuts it in cp parts
    torch_order = _HeadTailLoadBalancer(length, cp, "cpu")._generate_indices().view(cp, -1)
    assert torch.equal(torch.stack([shard_indices(length, cp, r) for r in range(cp)]), torch_order)


def test_every_token_is_held_once_and_each_rank_does_the_same_causal_work():
    length, cp = 64, 4
    held = [shard_indices(length, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(length))
    # a query at position p attends to p + 1 keys: every rank's queries attend to as many keys in all
    assert len({int((positions + 1).sum()) for positions in held}) == 1


@pytest.mark.parametrize("flags, message", [
    (["--parallel.cp=2"], "parallel.cp: context parallelism composes with FSDP2 (parallel.engine=fsdp)"),
    (["--parallel.engine=fsdp", "--parallel.cp=2", "--parallel.tp=2"], "parallel.cp: context parallelism does "
     "not combine with parallel.tp or parallel.pp yet"),
    (["--parallel.engine=fsdp", "--parallel.cp=3", "--data.seq_len=16"], "parallel.cp=3: data.seq_len=16 does not "
     "split into 6 equal slices (2 per context-parallel rank); use a multiple of 6"),
    (["--parallel.engine=fsdp", "--parallel.cp=2", "--data.document_mask=true"], "data.document_mask: under "
     "parallel.cp > 1"),
    (["--parallel.engine=fsdp", "--parallel.cp=2", "--model.arch=lstm"], "parallel.cp=2: an LSTM (model.arch=lstm) "
     "has no context-parallel attention"),
    (["--parallel.cp=0"], "parallel.cp: must be >= 1"),
])
def test_a_context_split_the_model_cannot_take_is_refused_by_the_config(flags, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--model.block_size=32", "--data.seq_len=16", "--model.vocab_size=96", *flags])
    assert message in str(err.value)


def test_a_world_size_that_cp_does_not_divide_is_refused():
    cfg = load_config(None, ["--parallel.engine=fsdp", "--parallel.cp=2"])
    with pytest.raises(ConfigError) as err:
        check_world(cfg, 3)
    assert str(err.value).startswith("parallel.cp=2 does not divide the world size 3")


def test_the_ranks_of_a_context_parallel_group_read_the_same_samples():
    # 4 ranks under cp=2 are 2 data-parallel replicas: a batch of 2 micro-batches is one each, and 3 do not split
    flags = ["--parallel.engine=fsdp", "--parallel.cp=2", "--train.micro_batch_size=2"]
    check_world(load_config(None, [*flags, "--train.batch_size=4"]), 4)
    with pytest.raises(ConfigError, match=r"train.batch_size: 6 is not a multiple of train.micro_batch_size \(2\) x "
                                          r"2 data-parallel replica\(s\) \(world size 4 / \(cp 2\)\)"):
        check_world(load_config(None, [*flags, "--train.batch_size=6"]), 4)
