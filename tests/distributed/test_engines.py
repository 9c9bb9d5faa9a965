"""Every engine on real 2-process gloo groups: same losses as one process, exact resume at the same world
size, and resume from 2 processes to 1 (resharding) that continues the loss trajectory."""

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lm.checkpoint.resume import check_engine
from lm.cli import train_command
from lm.config import load_config
from lm.distributed.engine import build_engine
from lm.distributed.env import DistEnv, init_distributed
from lm.distributed.fsdp import mixed_precision
from lm.distributed.zero import deepspeed_config
from lm.errors import CheckpointError, ConfigError
from lm.models.registry import family_of
from lm.training.setup import build_run_engine
from lm.training.step import train_step
from lm.training.trainer import Trainer
from tests.workers import job_env, pool, torchrun_forced, train_in_pool

TINY = [
    "--model.n_layer=2", "--model.d_model=32", "--model.block_size=32",
    "--data.seq_len=16", "--train.batch_size=8", "--train.micro_batch_size=2", "--train.device=cpu",
    "--train.eval_every=3", "--train.eval_batches=2", "--log.every=1", "--log.tensorboard=false",
    "--checkpoint.every=3", "--checkpoint.keep=5", "--optim.lr=3e-3", "--schedule.warmup_steps=2",
    "--train.steps=6", "--log.sample_tokens=4",
]
"""6 steps of a tiny model on global batches of 8 windows of 16 tokens. The end-of-run sample is 4 tokens long: it
still runs the sampling path under every engine and layout, at a sixteenth of the default's 64 decode steps (each
a pass over the 50k-token head)."""
HEADS = ["--model.n_head=2"]
"""What TINY adds for a family with attention heads (lm's but the LSTM)."""
ATTENTION = ("gpt", "encdec", "encoder")


def engine_and_loss(flags: list[str]):
    """The engine a run of `flags` builds (weights drawn from seed 0) on this process's group, a pool's or none,
    with its family's loss and the config."""
    cfg = load_config(None, flags)
    family = family_of(cfg.model)
    torch.manual_seed(0)
    engine = build_run_engine(cfg, family, init_distributed("cpu"))
    return engine, functools.partial(family.training.loss, optim=cfg.optim), cfg


def heads_for(flags: tuple[str, ...] | list[str]) -> list[str]:
    """HEADS when the last --model.arch in `flags` (gpt when none) has attention heads."""
    arch = ([f.split("=", 1)[1] for f in flags if f.startswith("--model.arch=")] or ["gpt"])[-1]
    return HEADS if arch in ATTENTION else []
ENGINES = {
    "ddp": ["--parallel.engine=ddp"],
    "fsdp": ["--parallel.engine=fsdp"],
    "zero1": ["--parallel.engine=deepspeed", "--parallel.zero_stage=1"],
    "zero2": ["--parallel.engine=deepspeed", "--parallel.zero_stage=2"],
    "zero3": ["--parallel.engine=deepspeed", "--parallel.zero_stage=3"],
}
# One process and two sum the same gradients in a different order (gloo all-reduce), so fp32 losses agree
# to rounding, not bit for bit.
SAME_BATCH_REL = 1e-5
# Resuming on fewer processes reshards the optimizer state (DeepSpeed through its universal checkpoint) and sums
# the gradients in another order: the same steps to rounding.
RESHARD_REL = 1e-5


def train(nproc: int, out: Path, data_dir: Path, *extra: str, torchrun: bool = False) -> dict[int, float]:
    """Run lm.train on `nproc` processes and return its logged train loss per step: on this session's pool of
    `nproc` ranks (`tests.workers`), or with `torchrun` (or LM_TESTS_TORCHRUN=1) in processes of its own, torchrun
    for 2 or more. Rank 0's output goes to `<out>.log` either way."""
    args = [*TINY, *heads_for(extra), f"--data.dir={data_dir}", f"--train.out_dir={out}", *extra]
    if torchrun or torchrun_forced():
        result = subprocess.run(train_command(nproc, args), capture_output=True, text=True, timeout=600,
                                env=job_env())
        assert result.returncode == 0, result.stdout + result.stderr
        stdout = result.stdout
    else:
        stdout = train_in_pool(nproc, args, job_env())
    out.with_suffix(".log").write_text(stdout)  # beside the run, for tests that read its log lines
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def val_losses(out: Path) -> dict[int, float]:
    """The logged val/loss per step of the run in `out`."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}


def held_share(out: Path) -> float:
    """The share of the model's parameters that rank 0 of the run in `out` holds, from its log (runs under a
    parallel layout say it): what shows the layout was applied, since a layout ignored would train the same."""
    found = re.search(r"rank 0 holds ([\d,]+) of ([\d,]+) parameters", out.with_suffix(".log").read_text())
    assert found, f"no parameter share in {out.with_suffix('.log')}"
    held, total = (int(g.replace(",", "")) for g in found.groups())
    return held / total


def resume_copy(src: Path, dst: Path, step: int = 3) -> Path:
    """A new run directory holding only `src`'s checkpoint of `step`."""
    name = f"step_{step:08d}"
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    return dst


@pytest.fixture(scope="module")
def one_process_run(tiny_data_dir, tmp_path_factory) -> Path:
    """TINY trained on one process under ddp: every engine's 2 processes compute the same steps (the engines' own
    single-process runs are the 2-to-1 resumes of `check_resumes`)."""
    out = tmp_path_factory.mktemp("one") / "ddp"
    train(1, out, tiny_data_dir, *ENGINES["ddp"])
    return out


@pytest.fixture(scope="module")
def one_process(one_process_run) -> dict[int, float]:
    """The losses of `one_process_run` by step."""
    rows = [json.loads(line) for line in (one_process_run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def first_grad_norm(out: Path) -> float:
    """Step 1's gradient norm as the run logged it: the whole model's, whatever each rank holds of it."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r["train/grad_norm"] for r in rows if r["step"] == 1 and "train/grad_norm" in r)


@pytest.mark.process
@pytest.mark.parametrize("engine", ENGINES)
def test_two_processes_match_one_and_resume(engine, tiny_data_dir, tmp_path, one_process, one_process_run):
    flags = ENGINES[engine]
    two = train(2, tmp_path / "two", tiny_data_dir, *flags)
    assert sorted(one_process) == sorted(two) == [1, 2, 3, 4, 5, 6]
    for step in one_process:
        assert two[step] == pytest.approx(one_process[step], rel=SAME_BATCH_REL), step
    # the norm clipping acts on: a sharded engine's is over every rank's shard (AdamW hides a wrong one in the loss)
    assert first_grad_norm(tmp_path / "two") == pytest.approx(first_grad_norm(one_process_run), rel=SAME_BATCH_REL)
    assert two[6] < two[1]
    state = json.loads((tmp_path / "two/checkpoints/step_00000006/state.json").read_text())
    assert state["world_size"] == 2 and state["engine"] == flags[0].split("=")[1]
    check_resumes(two, tmp_path, tiny_data_dir, *flags)


def check_resumes(two: dict[int, float], tmp_path: Path, data_dir: Path, *flags: str) -> None:
    """Resume the 2-process run in tmp_path/two from its step-3 checkpoint on 2 processes (steps 4..6 again,
    bit for bit) and on 1 (the loader's global position and the resharded state continue the trajectory)."""
    again = train(2, resume_copy(tmp_path / "two", tmp_path / "again"), data_dir, *flags)
    assert sorted(again) == [4, 5, 6] and all(again[s] == two[s] for s in again)
    alone = train(1, resume_copy(tmp_path / "two", tmp_path / "alone"), data_dir, *flags)
    assert sorted(alone) == [4, 5, 6]
    for step in alone:
        assert alone[step] == pytest.approx(two[step], rel=RESHARD_REL), step


@pytest.mark.process
def test_asynchronous_checkpoints_on_two_ranks_resume_bit_for_bit(tiny_data_dir, tmp_path, one_process):
    # each rank's background thread writes its shard over a gloo group of its own while training goes on
    flags = ["--parallel.engine=fsdp", "--checkpoint.async=true"]
    two = train(2, tmp_path / "two", tiny_data_dir, *flags)
    for step in one_process:
        assert two[step] == pytest.approx(one_process[step], rel=SAME_BATCH_REL), step
    assert "copied to host memory" in (tmp_path / "two.log").read_text()
    again = train(2, resume_copy(tmp_path / "two", tmp_path / "again"), tiny_data_dir, *flags)
    assert sorted(again) == [4, 5, 6] and all(again[s] == two[s] for s in again)


@pytest.mark.process
def test_a_nan_step_is_skipped_by_every_rank_under_fsdp(tiny_data_dir, tmp_path, monkeypatch):
    # rank 0's loss at step 2 is NaN; the reduced gradients carry it to rank 1's shard, so a rank that
    # stepped anyway would hold NaN weights and every later loss would be NaN
    monkeypatch.setenv("LM_FAULT_NAN_STEPS", "2")
    one = train(1, tmp_path / "one", tiny_data_dir, "--parallel.engine=fsdp", "--train.steps=4")
    two = train(2, tmp_path / "two", tiny_data_dir, "--parallel.engine=fsdp", "--train.steps=4")
    rows = [json.loads(line) for line in (tmp_path / "two/metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/skipped_steps" in r]
    assert [r["train/skipped_steps"] for r in train_rows] == [0, 1, 1, 1]
    assert ["train/loss" in r for r in train_rows] == [True, False, True, True]  # step 2 trained nothing
    for step in (3, 4):
        assert two[step] == pytest.approx(one[step], rel=SAME_BATCH_REL), step


@pytest.mark.process
def test_activation_checkpointing_changes_no_loss_under_fsdp(tiny_data_dir, tmp_path):
    plain = train(2, tmp_path / "plain", tiny_data_dir, "--parallel.engine=fsdp", "--train.steps=3")
    recomputed = train(2, tmp_path / "ac", tiny_data_dir, "--parallel.engine=fsdp", "--train.steps=3",
                       "--parallel.activation_checkpointing=1")
    assert recomputed == plain


ENCDEC = ["--model.arch=encdec", "--model.pos=sinusoidal", "--model.n_sentinels=4", "--train.steps=5",
          "--optim.lr=1e-2"]


@pytest.mark.process
def test_encoder_decoder_trains_under_fsdp_and_deepspeed(tiny_data_dir, tmp_path):
    reference = train(1, tmp_path / "ddp", tiny_data_dir, *ENCDEC)
    for name, flags in (("fsdp", ENGINES["fsdp"]), ("zero3", ENGINES["zero3"])):
        losses = train(2, tmp_path / name, tiny_data_dir, *ENCDEC, *flags)
        assert losses[5] < losses[1], name
        for step in reference:
            assert losses[step] == pytest.approx(reference[step], rel=SAME_BATCH_REL), (name, step)
        # the sample encodes, then decodes step by step outside forward: with every weight gathered, the same text
        assert end_sample(tmp_path / name) == end_sample(tmp_path / "ddp"), name


def end_sample(out: Path) -> str:
    """The end-of-run sample of the run in `out`, from rank 0's log."""
    found = re.findall(r"\| sample: (.*)", out.with_suffix(".log").read_text())
    assert found, f"no sample in {out.with_suffix('.log')}"
    return found[-1]


@pytest.mark.process
def test_lstm_trains_alike_under_the_sharding_engines(tiny_data_dir, tmp_path):
    # nn.LSTM caches references to its weights (_flat_weights), and FSDP2 and ZeRO-3 swap the weights of a
    # layer in and out around its forward: the losses show the LSTM computes with the gathered ones. (DDP and
    # ZeRO-1/2 keep whole weights in place; the one-process reference is the ddp engine.)
    flags = ["--model.arch=lstm", "--train.steps=4", "--optim.lr=1e-2"]
    reference = train(1, tmp_path / "one", tiny_data_dir, *flags)
    for name in ("fsdp", "zero3"):
        losses = train(2, tmp_path / name, tiny_data_dir, *flags, *ENGINES[name])
        assert losses[4] < losses[1], name
        for step in reference:
            assert losses[step] == pytest.approx(reference[step], rel=SAME_BATCH_REL), (name, step)


def test_deepspeed_config_comes_from_ours_and_a_user_json_may_not_contradict_it(tmp_path):
    cfg = load_config(None, ["--parallel.engine=deepspeed", "--parallel.zero_stage=2", "--train.batch_size=32",
                             "--train.micro_batch_size=4", "--optim.grad_clip=0.5"])
    ds = deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))
    batch = (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"])
    assert batch == (32, 4, 4)
    assert ds["zero_optimization"] == {"stage": 2} and ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": False}
    assert deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cuda"))["bf16"] == {"enabled": True}

    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}, "wall_clock_breakdown": True}))
    cfg.parallel.deepspeed_config = str(user)
    merged = deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))
    assert merged["zero_optimization"] == {"stage": 2, "overlap_comm": True} and merged["wall_clock_breakdown"]
    user.write_text(json.dumps({"bf16": {"enabled": True}}))  # a key of ours the user's JSON sets: theirs wins
    assert deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))["bf16"] == {"enabled": True}
    cfg.parallel.deepspeed_config = ""
    cfg.parallel.cpu_offload = True  # the optimizer state on the host, stepped by our AdamW
    offloaded = deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))
    assert offloaded["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert offloaded["zero_force_ds_cpu_optimizer"] is False
    cfg.parallel.cpu_offload = False
    cfg.parallel.deepspeed_config = str(user)
    user.write_text(json.dumps({"train_batch_size": 64}))
    with pytest.raises(ConfigError, match=r"sets train_batch_size=64, but this job has 32 \(train.batch_size\)"):
        deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))
    user.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match=r"sets zero_optimization.stage=3, but this job has 2 \(parallel.zero_st"):
        deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))
    user.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(ConfigError, match="sets 'optimizer'; lm passes its own AdamW"):
        deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))
    user.write_text(json.dumps({"scheduler": {"type": "WarmupLR"}}))  # it would set the rate on top of lm's schedule
    with pytest.raises(ConfigError, match="sets 'scheduler'; lm passes its own AdamW and schedule"):
        deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))
    for key, value in (("train_micro_batch_size_per_gpu", 8), ("gradient_accumulation_steps", 2)):
        user.write_text(json.dumps({key: value}))  # DeepSpeed would accumulate other micro-batches than lm feeds
        with pytest.raises(ConfigError, match=rf"sets {key}={value}, but this job has"):
            deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}))
    deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))  # the job's own values pass
    user.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        deepspeed_config(cfg.parallel, cfg.train, cfg.optim, 2, torch.device("cpu"))


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.engine=megatron"], "parallel.engine: unknown engine 'megatron'"),
    (["--parallel.engine=deepspeed", "--parallel.zero_stage=4"],
     "parallel.zero_stage: deepspeed takes ZeRO stage 1, 2 or 3, got 4"),
    (["--parallel.engine=deepspeed"], "parallel.zero_stage: deepspeed takes ZeRO stage 1, 2 or 3, got 0"),
    (["--parallel.engine=fsdp", "--parallel.zero_stage=2"], "parallel.zero_stage: only the deepspeed engine has it"),
    (["--parallel.deepspeed_config=ds.json"], "parallel.deepspeed_config: only the deepspeed engine has it"),
    (["--parallel.cpu_offload=true"], "parallel.cpu_offload: the ddp engine keeps a whole model per rank"),
    (["--parallel.activation_checkpointing=-1"], "parallel.activation_checkpointing: must be >= 0"),
    (["--parallel.engine=deepspeed", "--parallel.zero_stage=2", "--checkpoint.async=true"],
     "checkpoint.async: DeepSpeed writes its own checkpoints, which cannot be written in the background"),
])
def test_engine_options_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_a_checkpoint_of_another_engine_family_is_refused_with_what_to_do(tmp_path):
    step = tmp_path / "step_00000003"
    step.mkdir()
    (step / "state.json").write_text(json.dumps({"step": 3, "world_size": 2, "engine": "deepspeed", "zero_stage": 2}))
    fsdp = load_config(None, ["--parallel.engine=fsdp"])
    with pytest.raises(CheckpointError, match="written by the deepspeed engine, and parallel.engine is fsdp.*"
                                              "python -m lm.consolidate"):
        check_engine(step, fsdp, 2)
    zero2 = load_config(None, ["--parallel.engine=deepspeed", "--parallel.zero_stage=2"])
    zero3 = load_config(None, ["--parallel.engine=deepspeed", "--parallel.zero_stage=3"])
    assert check_engine(step, zero2, 2) is False  # same world size and stage: DeepSpeed loads it as is
    assert check_engine(step, zero2, 1) is True  # another world size: through the universal format
    zero1 = load_config(None, ["--parallel.engine=deepspeed", "--parallel.zero_stage=1"])
    assert check_engine(step, zero1, 2) is True  # another stage: likewise
    with pytest.raises(CheckpointError, match=r"written under ZeRO stage 2, and parallel.zero_stage is 3; DeepSpeed "
                                              r"resumes between stages 1 and 2 but not between either and stage 3"):
        check_engine(step, zero3, 2)
    (step / "state.json").write_text(json.dumps({"step": 3, "world_size": 2}))  # before engines: ddp
    assert check_engine(step, fsdp, 1) is False  # ddp and fsdp share DCP
    with pytest.raises(CheckpointError, match="written by the ddp engine"):
        check_engine(step, zero2, 2)


@pytest.mark.process
def test_deepspeed_cpu_offload_trains_like_no_offload(tiny_data_dir, tmp_path):
    flags = [*ENGINES["zero2"], "--train.steps=2"]
    plain = train(1, tmp_path / "plain", tiny_data_dir, *flags)
    offloaded = train(1, tmp_path / "offload", tiny_data_dir, *flags, "--parallel.cpu_offload=true")
    for step in plain:
        assert offloaded[step] == pytest.approx(plain[step], rel=SAME_BATCH_REL)


def test_fsdp_offload_on_a_cpu_run_is_refused_before_anything_is_written(tiny_data_dir, tmp_path):
    cfg = load_config(None, [*TINY, *HEADS, f"--data.dir={tiny_data_dir}", f"--train.out_dir={tmp_path / 'run'}",
                             "--parallel.engine=fsdp", "--parallel.cpu_offload=true"])
    try:
        with pytest.raises(ConfigError, match="parallel.cpu_offload: FSDP2 offloads a GPU run's shards"):
            Trainer(cfg, init_distributed("cpu"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not (tmp_path / "run").exists()


@pytest.mark.process
def test_deepspeed_says_that_it_does_not_compile(tiny_data_dir, tmp_path):
    # not in this process: DeepSpeed keeps its groups module-wide, so a second engine in a process whose first
    # group was destroyed fails (a pool's group is never destroyed)
    train(1, tmp_path / "run", tiny_data_dir, "--train.steps=1", "--parallel.engine=deepspeed",
          "--parallel.zero_stage=1", "--train.compile=true")
    assert ("train.compile is not applied under parallel.engine=deepspeed; the model runs eager"
            in (tmp_path / "run.log").read_text())


def test_an_engine_draws_the_weights_a_cpu_build_would_and_lets_a_loader_replace_them():
    """The engine is handed a model built on the meta device; allocating and drawing it from the seeded RNG
    gives the weights of a model built whole on the CPU, and `load_weights` then replaces them."""
    cfg = load_config(None, [*TINY, *HEADS, "--train.device=cpu"])
    family = family_of(cfg.model)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    torch.manual_seed(5)
    reference = family.build(cfg.model)
    torch.manual_seed(5)
    with torch.device("meta"):
        model = family.build(cfg.model)
    engine = build_engine(model, family, cfg.parallel, cfg.train, cfg.optim, env)
    assert engine.model is model and model.lm_head.weight is model.wte.weight  # materialised and tied again
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name

    def zero_all(module: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()

    with torch.device("meta"):
        other = family.build(cfg.model)
    zeros = build_engine(other, family, cfg.parallel, cfg.train, cfg.optim, env, load_weights=zero_all)
    assert all(not p.any() for p in zeros.model.parameters())


@pytest.mark.parametrize("dtype, device, expected", [
    ("auto", "cuda", (torch.bfloat16, torch.float32)),
    ("bfloat16", "cpu", (torch.bfloat16, torch.float32)),
    ("auto", "cpu", (None, None)),
    ("float32", "cuda", (None, None)),
])
def test_fsdp_computes_in_bf16_and_reduces_gradients_in_fp32(dtype, device, expected):
    # no CPU run sees the policy's dtypes (a bf16 gradient reduction, or fp16 parameters, would train on)
    policy = mixed_precision(dtype, torch.device(device))
    assert (policy.param_dtype, policy.reduce_dtype) == expected


def _fsdp_units() -> tuple[bool, list[bool]]:
    """A pool's job: whether the fsdp engine's model and each of its blocks is an FSDP unit of its own."""
    engine, _, cfg = engine_and_loss(["--model.n_layer=2", "--model.n_head=2", "--model.d_model=32",
                                      "--model.block_size=16", "--data.seq_len=16", "--train.device=cpu",
                                      "--train.batch_size=2", "--train.micro_batch_size=1", "--parallel.engine=fsdp"])
    blocks = family_of(cfg.model).blocks(engine.model)
    return isinstance(engine.model, FSDPModule), [isinstance(b, FSDPModule) for b in blocks]


@pytest.mark.process
def test_fsdp_shards_every_block_on_its_own():
    # without per-block fully_shard only the root is sharded: the same losses and the same held share,
    # but every forward gathers the whole model at once
    assert [r["value"] for r in pool(2).run(_fsdp_units)] == [(True, [True, True])] * 2


FSDP_AC = ["--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=16",
           "--data.seq_len=16", "--train.device=cpu", "--train.batch_size=4", "--train.micro_batch_size=1",
           "--parallel.engine=fsdp", "--parallel.activation_checkpointing=1"]


def _fsdp_micro_batches_and_gathers() -> dict:
    """A pool's job: two micro-batches through the fsdp engine, recording what each rank holds along the way."""
    engine, loss, cfg = engine_and_loss(FSDP_AC)
    model, blocks = engine.model, family_of(cfg.model).blocks(engine.model)
    rank = dist.get_rank()
    calls = []
    blocks[0].attn.register_forward_hook(lambda module, args, out: calls.append(1))
    x = torch.randint(0, cfg.model.vocab_size, (1, 17), generator=torch.Generator().manual_seed(rank))
    batch = [x[:, :-1], x[:, 1:]]
    seen = {}
    for last in (False, True):
        with engine.micro_batch(last=last):
            losses = loss(model, engine.run, batch)
            if not last:
                # each block's weights are freed (back to this rank's shard) once its forward ends
                seen["sharded_after_forward"] = all(isinstance(p, DTensor) for b in blocks for p in b.parameters())
            engine.backward(losses.optimized / 2)
        if not last:
            # no reduce-scatter before the last micro-batch: no sharded gradient exists yet
            seen["grads_after_first"] = sum(p.grad is not None for p in model.parameters())
            # activation checkpointing: the block's forward ran again in backward
            seen["forwards_per_micro_batch"] = len(calls)
    seen["grads_after_last"] = sum(p.grad is not None for p in model.parameters())
    seen["params"] = sum(1 for _ in model.parameters())
    with engine.full_weights():
        seen["whole_inside"] = all(not isinstance(p, DTensor) for p in model.parameters())
        seen["wte_rows_inside"] = model.wte.weight.shape[0]
    seen["sharded_after"] = all(isinstance(p, DTensor) for p in model.parameters())
    seen["wte_rows"] = model.wte.weight.shape[0]  # a DTensor's shape is the whole tensor's
    return seen


@pytest.mark.process
def test_fsdp_reduces_only_the_last_micro_batch_reshards_after_forward_and_gathers_for_sampling():
    for reply in pool(2).run(_fsdp_micro_batches_and_gathers):
        seen = reply["value"]
        assert seen["sharded_after_forward"] is True
        assert seen["grads_after_first"] == 0
        assert seen["grads_after_last"] == seen["params"] > 0
        assert seen["forwards_per_micro_batch"] == 2
        assert seen["whole_inside"] is True and seen["wte_rows_inside"] == seen["wte_rows"]
        assert seen["sharded_after"] is True


ONE_LAYER = ["--model.n_layer=1", "--model.n_head=2", "--model.d_model=32", "--model.block_size=16",
             "--data.seq_len=16", "--train.device=cpu", "--train.batch_size=2", "--train.micro_batch_size=2"]


def test_a_loaded_checkpoint_leaves_this_runs_optimizer_settings_in_place(tmp_path):
    old, loss, cfg = engine_and_loss([*ONE_LAYER, "--optim.weight_decay=0.1", "--optim.beta2=0.95"])
    x = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    train_step(old, loss, [[x[:, :-1], x[:, 1:]]], 1e-3, 1.0)  # the optimizer has state to save
    old.save(tmp_path / "ckpt")
    new, _, _ = engine_and_loss([*ONE_LAYER, "--optim.weight_decay=0.02", "--optim.beta2=0.99"])
    before = [{k: v for k, v in g.items() if k != "params"} for g in new.optimizer.param_groups]
    new.load(tmp_path / "ckpt")
    after = [{k: v for k, v in g.items() if k != "params"} for g in new.optimizer.param_groups]
    assert after == before
    assert {g["weight_decay"] for g in new.optimizer.param_groups} - {0.0} == {0.02}
    assert {g["betas"][1] for g in new.optimizer.param_groups} == {0.99}
    # the moments did come from the checkpoint
    assert all(torch.equal(new.optimizer.state[p]["exp_avg"], old.optimizer.state[q]["exp_avg"])
               for p, q in zip(new.model.parameters(), old.model.parameters()) if q in old.optimizer.state)


def test_evaluation_mode_turns_dropout_off_and_training_mode_back_on():
    engine, loss, cfg = engine_and_loss([*ONE_LAYER, "--model.dropout=0.5"])
    x = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = [x[:, :-1], x[:, 1:]]

    def scored() -> float:
        with torch.no_grad():
            return engine.evaluate(lambda model, run: loss(model, run, batch).terms["loss"].value.item())

    engine.train(False)
    assert not any(m.training for m in engine.model.modules())
    assert scored() == scored()  # no dropout: the same loss every time
    engine.train(True)
    assert all(m.training for m in engine.model.modules())
    assert scored() != scored()  # dropout at 0.5 draws other masks each time
