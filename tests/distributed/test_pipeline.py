"""Pipeline parallelism (parallel.pp) composed with FSDP2 and tensor parallelism on real gloo groups: the same
losses as one process on the same global batches under each schedule, checkpoints that resume under other
layouts, weights drawn as one process draws them, and the layouts refused before a run."""

from pathlib import Path

import pytest
import torch

from lm.config import load_config
from lm.distributed.fsdp import discard_draws
from lm.distributed.layout import check_world
from lm.distributed.pipeline import stage_layers
from lm.errors import ConfigError
from tests.distributed.test_engines import held_share, resume_copy, train, val_losses
from tests.workers import pool

# a 4-block decoder with the Llama options (grouped-query attention) and an untied head, which a pipeline needs
LLAMA4 = ["--parallel.engine=fsdp", "--model.n_layer=4", "--model.n_head=4", "--model.n_kv_head=2",
          "--model.pos=rope", "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.bias=false",
          "--model.tie_embeddings=false", "--train.steps=10", "--checkpoint.every=5", "--train.eval_every=5"]
PP2 = ["--parallel.pp=2"]
INTERLEAVED = ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_stages_per_rank=2"]
SAME_REL = 1e-5  # float32 rounding of sums taken in another order; a pipeline alone is bit-exact here
MICRO4 = ["--train.micro_batch_size=4"]
"""A step's 8 windows in micro-batches of 4, not TINY's 2, for layouts whose every micro-batch costs collectives in
each layer (tensor and context parallelism): half the micro-batches, about half the time. The loader splits the same
global batch however it is cut, so the losses are still those of one process on micro-batches of 2, to rounding."""

_ONE_PROCESS: dict[tuple[str, ...], tuple[Path, dict[int, float]]] = {}


def one_process_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                    *flags: str) -> tuple[Path, dict[int, float]]:
    """The run of `flags` on one process, trained once per session: pipeline, context and tensor parallelism compare
    several layouts with the same one. Its directory (read-only: resume from a `resume_copy`) and losses per step."""
    key = (str(data_dir), *flags)
    if key not in _ONE_PROCESS:
        out = tmp_path_factory.mktemp("one_process") / "run"
        _ONE_PROCESS[key] = out, train(1, out, data_dir, *flags)
    out, losses = _ONE_PROCESS[key]
    return out, dict(losses)


@pytest.fixture()
def reference(tiny_data_dir, tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The one-process run every layout is compared with: its directory and its losses per step."""
    return one_process_run(tiny_data_dir, tmp_path_factory, *LLAMA4)


def assert_same(got: dict[int, float], want: dict[int, float], steps) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=SAME_REL), (step, got, want)


@pytest.mark.process
@pytest.mark.parametrize("layout", [PP2, INTERLEAVED], ids=["pp2xfsdp2-1f1b", "pp2xfsdp2-interleaved"])
def test_four_ranks_train_like_one_process(layout, reference, tiny_data_dir, tmp_path):
    assert_same(train(4, tmp_path / "run", tiny_data_dir, *LLAMA4, *layout), reference[1], range(1, 11))
    # rank 0 holds the first stage(s): about half the model, sharded over the 2 replicas
    assert 0.2 < held_share(tmp_path / "run") < 0.3


@pytest.mark.process
def test_gpipe_on_two_stages_trains_like_one_process(reference, tiny_data_dir, tmp_path):
    flags = [*PP2, "--parallel.pp_schedule=gpipe"]
    assert_same(train(2, tmp_path / "run", tiny_data_dir, *LLAMA4, *flags), reference[1], range(1, 11))


@pytest.mark.process
def test_tp2_by_pp2_trains_like_one_process_and_checkpoints_move_between_layouts(reference, tiny_data_dir,
                                                                                  tmp_path):
    one_dir, one = reference
    # 4 micro-batches a step on 2 stages: the one layout here that runs 1f1b's steady state, more micro-batches
    # than stages (the others run one per stage)
    assert_same(train(4, tmp_path / "tp2pp2", tiny_data_dir, *LLAMA4, *PP2, "--parallel.tp=2"), one, range(1, 11))
    # one process -> pipeline 2 (interleaved) x FSDP2 2
    run = resume_copy(one_dir, tmp_path / "to_pipeline", step=5)
    assert_same(train(4, run, tiny_data_dir, *LLAMA4, *INTERLEAVED), one, range(6, 11))
    # tensor 2 x pipeline 2 -> one process
    run = resume_copy(tmp_path / "tp2pp2", tmp_path / "from_pipeline", step=5)
    assert_same(train(1, run, tiny_data_dir, *LLAMA4), one, range(6, 11))


@pytest.mark.parametrize("n_layer, stages, sizes", [(4, 2, [2, 2]), (5, 3, [1, 2, 2]), (7, 4, [1, 2, 2, 2]),
                                                    (6, 4, [1, 2, 2, 1]), (3, 3, [1, 1, 1]), (9, 2, [4, 5])])
def test_stages_split_the_blocks_evenly_the_middle_ones_first(n_layer, stages, sizes):
    split = stage_layers(n_layer, stages)
    assert [len(r) for r in split] == sizes
    assert [i for r in split for i in r] == list(range(n_layer))


@pytest.mark.parametrize("fill", [lambda t, **kw: t.normal_(**kw), lambda t, **kw: t.uniform_(**kw)],
                         ids=["normal", "uniform"])
@pytest.mark.parametrize("numel", [1, 15, 16, 17, 1000, (1 << 20), (1 << 20) + 5, 3 * (1 << 20) + 17])
def test_skipping_a_parameter_leaves_the_generator_where_drawing_it_would(fill, numel):
    torch.manual_seed(3)
    fill(torch.empty(numel))
    want = torch.rand(4)
    torch.manual_seed(3)
    discard_draws(fill, numel, {})
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("flags, message", [
    (["--parallel.pp=2"], "parallel.pp: pipeline parallelism composes with FSDP2 (parallel.engine=fsdp)"),
    (["--parallel.engine=fsdp", "--parallel.pp=2", "--model.tie_embeddings=true"],
     "parallel.pp=2: the token embedding sits on the first pipeline stage and the output head on the last"),
    (["--parallel.engine=fsdp", "--parallel.pp=4", "--model.n_layer=2", "--model.tie_embeddings=false"],
     "parallel.pp=4: 4 pipeline stages (parallel.pp x parallel.pp_stages_per_rank) are more than the model's 2 "
     "layers (model.n_layer); use at most 2"),
    (["--parallel.engine=fsdp", "--parallel.pp=2", "--parallel.pp_schedule=zbv_zero_bubble"],
     "parallel.pp_schedule: zbv_zero_bubble is refused: with FSDP2 torch's zero-bubble schedules run without error "
     "but compute wrong gradients"),
    (["--parallel.engine=fsdp", "--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b"],
     "parallel.pp_stages_per_rank: interleaved_1f1b takes 2 or more stages per rank, got 1"),
    (["--parallel.engine=fsdp", "--parallel.pp=2", "--parallel.pp_schedule=looped"],
     "parallel.pp_schedule: expected gpipe, 1f1b or interleaved_1f1b, got 'looped'"),
    (["--parallel.engine=fsdp", "--parallel.pp=2", "--model.tie_embeddings=false", "--data.document_mask=true"],
     "data.document_mask: under parallel.pp > 1"),
    (["--parallel.engine=fsdp", "--parallel.pp=2", "--model.arch=encoder"], "parallel.pp=2: an encoder "
     "(model.arch=encoder) has no pipeline stages"),
])
def test_a_pipeline_the_model_cannot_take_is_refused_by_the_config(flags, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--model.block_size=32", "--data.seq_len=16", "--model.vocab_size=96", *flags])
    assert message in str(err.value)


@pytest.mark.parametrize("world, flags, message", [
    (4, ["--parallel.pp=2", "--train.batch_size=4", "--train.micro_batch_size=2"],
     "parallel.pp=2: 1f1b needs at least one micro-batch per pipeline rank, and a step has 1 (train.batch_size 4 / "
     "(train.micro_batch_size 2 x 2 data-parallel replicas)); raise train.batch_size or lower "
     "train.micro_batch_size"),
    (2, [*INTERLEAVED, "--train.batch_size=10", "--train.micro_batch_size=2"],
     "parallel.pp=2: interleaved_1f1b splits a step's micro-batches into micro-batches // pp rounds of equal size, "
     "and a step's 5 (train.batch_size 10 / (train.micro_batch_size 2 x 1 data-parallel replicas)) do not split "
     "into 2; use a multiple of 2"),
    (6, ["--parallel.pp=4"], "parallel.pp=4 does not divide the world size 6 (ranks torchrun started); the product "
     "must be one of 1, 2, 3, 6, or start a multiple of 4 ranks"),
    # the replicas each take a whole number of micro-batches, or no process group forms (lm.layouts asks the same)
    (8, ["--parallel.pp=2", "--train.batch_size=6", "--train.micro_batch_size=1"],
     "train.batch_size: 6 is not a multiple of train.micro_batch_size (1) x 4 data-parallel replica(s) (world "
     "size 8 / (pp 2)); expected a multiple of 4, or a number of replicas that divides its 6 micro-batches"),
])
def test_a_pipeline_the_world_cannot_feed_is_refused_before_any_group(world, flags, message):
    cfg = load_config(None, ["--parallel.engine=fsdp", "--model.tie_embeddings=false", "--model.n_layer=4", *flags])
    with pytest.raises(ConfigError) as err:
        check_world(cfg, world)
    assert str(err.value) == message


@pytest.mark.parametrize("world, flags", [
    (4, ["--parallel.pp=2", "--parallel.pp_schedule=gpipe", "--train.batch_size=4", "--train.micro_batch_size=2"]),
    (2, [*INTERLEAVED, "--train.batch_size=12", "--train.micro_batch_size=2"]),
    (8, ["--parallel.pp=2", "--parallel.tp=2", "--train.batch_size=8", "--train.micro_batch_size=2"]),
])
def test_layouts_the_world_can_feed_pass(world, flags):
    check_world(load_config(None, ["--parallel.engine=fsdp", "--model.tie_embeddings=false", "--model.n_layer=4",
                                   *flags]), world)


SMALL_PP2 = ["--parallel.engine=fsdp", "--model.n_layer=4", "--model.n_head=2", "--model.d_model=32",
             "--model.block_size=16", "--data.seq_len=16", "--model.tie_embeddings=false", "--train.device=cpu",
             "--train.batch_size=8", "--train.micro_batch_size=2", "--parallel.pp=2"]
"""Two pipeline ranks of 4 small blocks, for what each rank builds (no training)"""


def pipeline_of(flags: list[str]) -> dict:
    """A pool job: the pipeline engine `flags` builds on this rank; what it holds and the schedule it runs."""
    import torch.distributed as dist

    from lm.distributed.env import DistEnv
    from lm.models.registry import family_of
    from lm.training.setup import build_run_engine

    cfg = load_config(None, flags)
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"), pp=cfg.parallel.pp)
    engine = build_run_engine(cfg, family_of(cfg.model), env)
    return {"engine": type(engine).__name__, "schedule": type(engine._schedule).__name__,
            "n_micro": engine._schedule._n_microbatches, "stages": engine.stage_ids,
            "blocks": sorted(int(name) for name in engine.model.blocks.keys())}


@pytest.mark.process
@pytest.mark.parametrize("schedule, kind, per_rank", [("gpipe", "ScheduleGPipe", 1), ("1f1b", "Schedule1F1B", 1),
                                                      ("interleaved_1f1b", "ScheduleInterleaved1F1B", 2)])
def test_each_rank_builds_the_named_schedule_over_the_steps_micro_batches(schedule, kind, per_rank):
    # invisible to the losses: gpipe and 1f1b swapped (the same gradients, gpipe's memory), contiguous instead of
    # looped stages per rank, and on 2 ranks pp=2 run as plain FSDP2
    flags = [*SMALL_PP2, f"--parallel.pp_schedule={schedule}", f"--parallel.pp_stages_per_rank={per_rank}"]
    found = [r["value"] for r in pool(2).run(pipeline_of, flags)]
    for rank, got in enumerate(found):
        stages = [rank + 2 * k for k in range(per_rank)]  # stage s on pipeline rank s mod pp
        blocks = [b for s in stages for b in range(s * 4 // (2 * per_rank), (s + 1) * 4 // (2 * per_rank))]
        assert got == {"engine": "PipelineEngine", "schedule": kind, "n_micro": 4, "stages": stages,
                       "blocks": blocks}, (rank, got)


@pytest.mark.parametrize("batch_size, n_micro", [(10, 5), (12, 6), (20, 10)])
def test_interleaved_1f1b_takes_micro_batches_that_split_into_whole_rounds_not_only_multiples_of_pp(batch_size,
                                                                                                      n_micro):
    # torch's ScheduleInterleaved1F1B runs n micro-batches in max(1, n // pp) rounds and asks only that the rounds
    # divide n: on 4 pipeline ranks 5 and 6 are one round, 10 are two rounds of 5 (its own docstring's example)
    rounds = max(1, n_micro // 4)
    assert n_micro % rounds == 0 and n_micro % 4
    cfg = load_config(None, ["--parallel.engine=fsdp", "--model.tie_embeddings=false", "--model.n_layer=8",
                             "--parallel.pp=4", "--parallel.pp_schedule=interleaved_1f1b",
                             "--parallel.pp_stages_per_rank=2", f"--train.batch_size={batch_size}",
                             "--train.micro_batch_size=2"])
    check_world(cfg, 4)


@pytest.mark.process
def test_four_stages_on_four_ranks_train_and_validate_like_one_process(reference, tiny_data_dir, tmp_path):
    # evaluation runs the stages one after another outside the schedule, each rank receiving the residual stream
    # from the rank of the stage before its own and sending to the one after: with 4 stages those two differ
    one_dir, one = reference
    assert_same(train(4, tmp_path / "pp4", tiny_data_dir, *LLAMA4, "--parallel.pp=4"), one, range(1, 11))
    want = val_losses(one_dir)
    assert want and sorted(val_losses(tmp_path / "pp4")) == sorted(want)
    assert_same(val_losses(tmp_path / "pp4"), want, sorted(want))
