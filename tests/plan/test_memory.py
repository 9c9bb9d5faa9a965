import contextlib
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lm.cli import run
from lm.config import load_config
from lm.distributed.activation import checkpoint_blocks
from lm.models.lstm.family import layer_activation_bytes as lstm_layer_activation_bytes
from lm.models.registry import family_of
from lm.models.sizes import block_params, checkpointed_blocks, layer_activation_bytes, stack_peak_bytes
from lm.plan import counts
from lm.plan.memory import GIB, estimate_memory
from lm.plan.memory_table import describe, fits, pick, plan_rows, plan_table

SMALL = ["--model.n_layer=2", "--model.d_model=64", "--model.block_size=64", "--data.seq_len=40"]
HEADS = ["--model.n_head=4"]  # every family but the LSTM has attention heads
LLAMA = ["--model.pos=rope", "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.bias=false",
         "--model.n_kv_head=2", "--model.tie_embeddings=false"]
ENCDEC = ["--model.arch=encdec", "--model.pos=sinusoidal", "--model.mlp=relu", "--model.n_sentinels=20"]
LSTM = ["--model.arch=lstm"]


def build(cfg):
    return family_of(cfg).build(cfg)


def num_params(cfg) -> int:
    return counts.num_params(cfg)


def _cfg(*overrides: str, engine: str = "ddp", dtype: str = "bfloat16", micro: int = 3):
    extra = [f"--parallel.engine={engine}"] + (["--parallel.zero_stage=1"] if engine == "deepspeed" else [])
    heads = [] if "--model.arch=lstm" in overrides else HEADS
    return load_config(None, [*SMALL, *heads, f"--train.dtype={dtype}", f"--train.micro_batch_size={micro}",
                              f"--train.batch_size={micro}", *extra, *overrides])


@pytest.mark.parametrize("overrides", [
    [],                                                                   # GPT-2
    LLAMA,                                                                # grouped-query, SwiGLU, untied head
    ["--model.norm_position=post", "--model.bias=false", "--model.d_ff=96"],
    ["--model.qk_norm=true", "--model.mlp=relu2"],                       # the modern recipe's options
    ENCDEC,                                                               # shared, tied embeddings
    [*ENCDEC, "--model.pos=learned", "--model.share_embeddings=false", "--model.tie_embeddings=false",
     "--model.norm_position=post", "--model.n_kv_head=1"],
    LSTM,                                                                 # tied, no positions, no norms
    [*LSTM, "--model.tie_embeddings=false", "--model.bias=false"],
], ids=["gpt2", "llama-gqa", "post-norm", "qk-norm-relu2", "encdec", "encdec-untied", "lstm", "lstm-untied-no-bias"])
def test_parameter_count_equals_the_built_model(overrides):
    cfg = _cfg(*overrides).model
    assert num_params(cfg) == sum(p.numel() for p in build(cfg).parameters())


@pytest.mark.parametrize("preset, expected", [
    ("gpt2-124m", 124_475_904), ("gpt-1.3b", 1_315_819_520), ("llama-7b", 7_297_830_912),
    # Meta's 8,030,261,248 and 70,553,706,496 less 2 x (128,256 - 100,288) x d_model of embedding and head rows
    ("llama3-8b", 7_801_147_392), ("llama3-70b", 70_095_478_784),
])
def test_presets_count_their_parameters(preset, expected):
    cfg = load_config(f"configs/{preset}.yaml").model
    with torch.device("meta"):  # shapes only: a 7B model in CPU memory would take 29 GB
        model = build(cfg)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters()) == expected


def test_a_llama_block_has_the_published_size():
    # Llama 2 7B: 4 attention matrices of 4096^2 and 3 SwiGLU matrices of 4096 x 11008, two RMSNorm gains
    cfg = load_config("configs/llama-7b.yaml").model
    assert block_params(cfg) == 4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096


@pytest.mark.parametrize("scope", ["head", "all"])
def test_a_qk_norm_blocks_size_is_the_built_blocks(scope):
    # one RMSNorm for q and one for k: over a head's channels, or over every head's (GQA: fewer k heads)
    cfg = load_config(None, ["--model.n_layer=1", "--model.d_model=64", "--model.n_head=4", "--model.n_kv_head=2",
                             "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.bias=false", "--model.qk_norm=true",
                             f"--model.qk_norm_scope={scope}", "--model.pos=rope"]).model
    block = family_of(cfg).build(cfg).blocks[0]
    assert block_params(cfg) == sum(p.numel() for p in block.parameters())


@pytest.mark.parametrize("world", [1, 3, 8, 64])
def test_sharding_arithmetic(world):
    cfg = _cfg(*LLAMA)
    n = num_params(cfg.model)
    shard = -(-n // world)  # ceil: shards are padded to equal size

    zero3 = estimate_memory(cfg, world, "deepspeed", 3)
    assert zero3.parameters == shard * (2 + 4)  # bf16 weights and the fp32 master, both sharded
    assert zero3.gradients == shard * 2 and zero3.optimizer == shard * 8
    zero2 = estimate_memory(cfg, world, "deepspeed", 2)
    assert zero2.parameters == n * 2 + shard * 4 and zero2.gradients == shard * 2
    zero1 = estimate_memory(cfg, world, "deepspeed", 1)
    assert zero1.gradients == n * 2 and zero1.optimizer == shard * 8
    fsdp = estimate_memory(cfg, world, "fsdp")
    assert (fsdp.parameters, fsdp.gradients, fsdp.optimizer) == (shard * 4, shard * 4, shard * 8)
    assert fsdp.gathered > 0 and zero3.gathered == fsdp.gathered and zero2.gathered == 0
    fp32 = estimate_memory(_cfg(*LLAMA, dtype="float32"), world, "deepspeed", 3)
    assert (fp32.parameters, fp32.gradients, fp32.optimizer) == (shard * 4, shard * 4, shard * 8)


def test_ddp_replicates_whatever_the_world_size():
    cfg = _cfg()
    n = num_params(cfg.model)
    rows = [estimate_memory(cfg, world, "ddp") for world in (2, 8, 512)]
    assert len({(r.parameters, r.gradients, r.optimizer, r.total) for r in rows}) == 1
    assert rows[0].parameters == n * (4 + 2) and rows[0].gradients == n * (4 + 4) and rows[0].optimizer == n * 8
    alone = estimate_memory(cfg, 1, "ddp")  # one process is not wrapped in DDP: no gradient buckets
    assert alone.gradients == n * 4
    fp32 = estimate_memory(_cfg(dtype="float32"), 8, "ddp")
    assert fp32.parameters == n * 4


def test_cpu_offload_moves_state_to_the_host():
    cfg = _cfg()
    world = 4
    shard = -(-num_params(cfg.model) // world)
    fsdp = estimate_memory(cfg, world, "fsdp", cpu_offload=True)
    assert (fsdp.parameters, fsdp.gradients, fsdp.optimizer, fsdp.host) == (0, 0, 0, shard * 16)
    zero = estimate_memory(cfg, world, "deepspeed", 2, cpu_offload=True)
    on_device = estimate_memory(cfg, world, "deepspeed", 2)
    assert zero.optimizer == 0 and zero.host == shard * (4 + 8 + 4)  # master, moments, fp32 gradient partition
    assert zero.parameters == on_device.parameters - shard * 4 and zero.total < on_device.total
    with pytest.raises(ValueError, match="ddp"):
        estimate_memory(cfg, world, "ddp", cpu_offload=True)


def test_activation_checkpointing_keeps_block_inputs_and_recomputes_one_block():
    layers, b, s, h = 6, 3, 40, 64
    cfg = _cfg(f"--model.n_layer={layers}", engine="fsdp")  # bf16 weights: a 2-byte residual stream
    full = layer_activation_bytes(cfg.model, b, s, act_bytes=2, residual_bytes=2)
    none = estimate_memory(cfg, 8, activation_checkpointing=0)
    every = estimate_memory(cfg, 8, activation_checkpointing=1)
    t, heads = b * s, 4
    assert full == 32 * t * h + 4 * b * heads * s  # GPT-2's block in bf16 with fused attention (module docstring)
    outside = none.activations - layers * full  # final norm, head input, logits
    assert none.activations == every.activations_no_checkpointing
    # every block checkpointed: 6 block inputs of 2*t*h bytes plus one block recomputed, instead of 6 blocks
    assert every.activations - outside == layers * 2 * t * h + full
    blocks_none, blocks_every = none.activations - outside, every.activations - outside
    assert blocks_none / blocks_every == pytest.approx(6 * 32 / (6 * 2 + 32), rel=0.01)  # 4.4x fewer bytes
    # every 4th of 6 blocks: blocks 0 and 4 keep their inputs, the other 4 everything; by the time backward
    # recomputes block 4, block 5's are freed, so what backward starts with is the most
    fourth = estimate_memory(cfg, 8, activation_checkpointing=4)
    assert fourth.activations - outside == 2 * 2 * b * s * h + 4 * full
    # block 0 alone: never more than none (it was one recomputed block more)
    first = estimate_memory(cfg, 8, activation_checkpointing=layers)
    assert first.activations - outside == 2 * b * s * h + 5 * full < blocks_none
    # under ddp's autocast the weights, and so the residual stream and its checkpoints, are fp32
    ddp = estimate_memory(_cfg(f"--model.n_layer={layers}"), 8, activation_checkpointing=1)
    ddp_full = layer_activation_bytes(cfg.model, b, s, act_bytes=2, residual_bytes=4)
    ddp_outside = ddp.activations_no_checkpointing - layers * ddp_full
    assert ddp.activations - ddp_outside == layers * 4 * b * s * h + ddp_full


@pytest.mark.parametrize("n_blocks, every, start, expected", [
    (12, 1, 0, 12), (12, 0, 0, 0), (6, 4, 0, 2), (7, 3, 0, 3), (4, 3, 4, 1), (4, 2, 4, 2),
])
def test_checkpointed_blocks_are_every_nth_from_the_first(n_blocks, every, start, expected):
    # lm.distributed.activation checkpoints family.blocks(model)[::every]: encoder blocks first, then decoder
    assert checkpointed_blocks(n_blocks, every, start) == expected
    assert expected == sum(1 for i in range(start, start + n_blocks) if every and i % every == 0)


@pytest.mark.parametrize("arch", [[], ENCDEC], ids=["gpt", "encdec"])
@pytest.mark.parametrize("layers, every", [(6, 1), (6, 4), (7, 3), (5, 2), (3, 0)])
def test_checkpointed_blocks_agree_with_the_checkpointing_wrapper(arch, layers, every):
    cfg = _cfg(*arch, f"--model.n_layer={layers}").model
    with torch.device("meta"):
        model = build(cfg)
    stacks = 2 if cfg.arch == "encdec" else 1
    counted = sum(checkpointed_blocks(layers, every, start=i * layers) for i in range(stacks))
    assert counted == checkpoint_blocks(family_of(cfg).blocks(model), every)


def test_korthikanti_count_for_a_gpt3_layer():
    # Korthikanti et al. 2022, eq. 1: s*b*h*(34 + 5*a*s/h) bytes per layer, 16-bit, with dropout, unfused attention
    cfg = load_config(None, ["--model.n_layer=1", "--model.n_head=16", "--model.d_model=1024",
                             "--model.block_size=2048", "--model.dropout=0.1"]).model
    b, s, h, a = 2, 2048, 1024, 16
    got = layer_activation_bytes(cfg, b, s, act_bytes=2, residual_bytes=2, fused_attention=False)
    assert got == s * b * h * 34 + 5 * a * s * s * b


def test_logits_take_their_log_softmax_and_both_gradients():
    cfg = _cfg(micro=5)
    t, vocab = 5 * 40, cfg.model.padded_vocab_size
    assert estimate_memory(cfg, 1).logits == t * vocab * (4 + 4 + 4)
    assert estimate_memory(_cfg(micro=5, dtype="float32"), 1).logits == t * vocab * (4 + 4 + 4)
    # a soft-cap's tanh keeps its fp32 output too
    assert estimate_memory(_cfg("--model.logit_softcap=15", micro=5), 1).logits == t * vocab * (4 + 4 + 4 + 4)


def test_a_chunked_loss_holds_one_chunk_of_logits():
    t, vocab = 5 * 40, _cfg().model.padded_vocab_size
    assert estimate_memory(_cfg("--model.loss_chunk=64", micro=5), 1).logits == 64 * vocab * (4 + 4 + 4)
    assert estimate_memory(_cfg("--model.loss_chunk=1000", micro=5), 1).logits == t * vocab * (4 + 4 + 4)


def saved_bytes(cfg, bf16_weights: bool, autocast: bool) -> int:
    """Bytes of the distinct activation storages autograd saves in one forward pass on the CPU (any model: the
    batch is its objective's); the model's parameters and autocast's bf16 weight copies (model state, not
    activations) are left out."""
    torch.manual_seed(0)
    family = family_of(cfg.model)
    model = family.build(cfg.model)
    if bf16_weights:
        model = model.to(torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    rows = np.random.default_rng(0).integers(0, 50000, (cfg.train.micro_batch_size, cfg.data.seq_len + 1))
    batch = family.training.objective(cfg.model, cfg.data, cfg.data.seq_len, 0)(rows, np.arange(len(rows)))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        weight_copy = t.dtype == torch.bfloat16 and t.dim() <= 2 and tuple(t.shape) in shapes
        if storage.data_ptr() not in weights and not weight_copy:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        family.training.loss(model, model, list(map(torch.from_numpy, batch)))
    return sum(saved.values())


@pytest.mark.parametrize("arch", [[], ["--model.pos=rope", "--model.mlp=swiglu", "--model.bias=false",
                                       "--model.n_kv_head=2"], ENCDEC], ids=["gpt2", "llama-layernorm", "encdec"])
@pytest.mark.parametrize("setup", ["float32", "ddp-autocast", "fsdp-bf16"])
def test_per_layer_activations_match_what_autograd_saves(arch, setup):
    # RMSNorm is left out: on the CPU it runs unfused and also saves its output, unlike CUDA's fused kernel
    engine, dtype = {"float32": ("ddp", "float32"), "ddp-autocast": ("ddp", "bfloat16"),
                     "fsdp-bf16": ("fsdp", "bfloat16")}[setup]
    cfgs = [_cfg(*arch, f"--model.n_layer={n}", "--train.device=cpu", engine=engine, dtype=dtype) for n in (2, 4)]
    measured = [saved_bytes(c, bf16_weights=setup == "fsdp-bf16", autocast=setup == "ddp-autocast") for c in cfgs]
    predicted = [estimate_memory(c, 1).activations for c in cfgs]
    # two more layers (encdec: two encoder and two decoder layers): the logits and the rest cancel out
    assert (predicted[1] - predicted[0]) == pytest.approx(measured[1] - measured[0], rel=0.03)


@pytest.mark.parametrize("setup", ["float32", "fsdp-bf16"])
def test_lstm_layer_activations_match_what_the_unfused_lstm_saves(setup, monkeypatch):
    # The CPU's oneDNN LSTM keeps a workspace of its own and CPU autocast keeps the cell states in fp32,
    # so the check runs PyTorch's unfused LSTM, in float32 and with bf16 weights (as FSDP and ZeRO give it).
    dtype = "float32" if setup == "float32" else "bfloat16"
    cfgs = [_cfg(*LSTM, f"--model.n_layer={n}", "--train.device=cpu", engine="ddp" if setup == "float32" else "fsdp",
                 dtype=dtype) for n in (2, 4)]
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    measured = [saved_bytes(c, bf16_weights=setup == "fsdp-bf16", autocast=False) for c in cfgs]
    predicted = [estimate_memory(c, 1).activations for c in cfgs]
    assert predicted[1] - predicted[0] == pytest.approx(measured[1] - measured[0], rel=0.03)
    c, t, h = (4 if setup == "float32" else 2), 3 * 40, 64
    assert predicted[1] - predicted[0] == 2 * lstm_layer_activation_bytes(cfgs[0].model, 3, 40, c) == 2 * 8 * c * t * h


def test_lstm_checkpointing_keeps_layer_inputs_and_one_layer():
    layers, t, h = 6, 3 * 40, 64
    cfg = _cfg(*LSTM, f"--model.n_layer={layers}")  # ddp autocast: the embedding output stays fp32
    full = lstm_layer_activation_bytes(cfg.model, 3, 40, act_bytes=2)
    none = estimate_memory(cfg, 1, activation_checkpointing=0)
    every = estimate_memory(cfg, 1, activation_checkpointing=1)
    outside = none.activations - layers * full
    # six layer inputs (the first the fp32 embedding output, the others bf16) and one layer recomputed
    assert every.activations - outside == 4 * t * h + 5 * 2 * t * h + full
    vocab = cfg.model.padded_vocab_size
    assert none.gathered == 0 and estimate_memory(cfg, 2, "fsdp").gathered == (
        (vocab * 64 + 2 * (8 * 64 * 64 + 8 * 64)) * (2 + 2))  # the root (tied embedding) and two layers
    assert "lstm: activ counts what PyTorch's unfused LSTM saves" in plan_table(cfg, 2)


def test_dry_run_describes_an_lstm_without_heads(capsys):
    from lm.train import dry_run

    cfg = _cfg(*LSTM)
    dry_run(cfg, 2, 80.0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model: lstm, 2 layers, d_model 64, vocabulary 50,304 (padded)"
    assert lines[1] == f"parameters: {50304 * 64 + 2 * (8 * 64 * 64 + 8 * 64):,}"


def test_the_dry_run_checks_and_estimates_the_configured_layout(capsys):
    from lm.errors import ConfigError
    from lm.plan.layouts import estimate_layout
    from lm.train import dry_run

    cfg = load_config("configs/llama3-8b.yaml", ["--parallel.engine=fsdp", "--parallel.tp=2", "--parallel.pp=2",
                                                 "--parallel.activation_checkpointing=1"])
    with pytest.raises(ConfigError, match=r"^--nproc 6: parallel.tp=2 x parallel.pp=2 does not divide the world "):
        dry_run(cfg, 6, 80.0)  # the run refuses it: the plan was printed as if it could start
    dry_run(cfg, 16, 80.0)
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("configured layout on 16 GPUs (fsdp engine, 1F1B): per-GPU memory in GiB and data sent per GPU "
                     "per step in GB")
    row = estimate_layout(cfg, 2, 2, 4, 1)
    assert lines[at + 3].split() == ["tp", "2", "x", "pp", "2", "x", "dp", "4", "1", "no", "128",
                                     f"{row.state / GIB:.2f}", f"{row.gathered / GIB:.2f}",
                                     f"{row.activations / GIB:.2f}", f"{row.total / GIB:.2f}",
                                     f"{row.tp_bytes / 1e9:.1f}", f"{row.fsdp_bytes / 1e9:.1f}",
                                     f"{row.pp_bytes / 1e9:.1f}", "0.0", "yes"]
    assert "each engine over data parallelism alone:" in lines[at:]
    # context parallelism and HSDP get their row, and the context-parallel traffic its column
    cp = load_config("configs/demo.yaml", ["--parallel.engine=fsdp", "--parallel.cp=2", "--parallel.dp_replicate=2",
                                                "--train.batch_size=8"])
    dry_run(cp, 8, 80.0)
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("configured layout on 8 GPUs (fsdp engine, 1F1B): per-GPU memory in GiB and data sent per GPU "
                     "per step in GB")
    row = estimate_layout(cp, 1, 1, 4, 0, cp=2, dp_replicate=2)
    assert lines[at + 1].split()[-7:-3] == ["ep", "GB", "cp", "GB"]
    assert lines[at + 3].split()[:14] == ["tp", "1", "x", "pp", "1", "x", "cp", "2", "x", "dp", "4", "(hsdp", "2",
                                          "x"]
    assert lines[at + 3].split()[-2:] == [f"{row.cp_bytes / 1e9:.1f}", "yes"] and row.cp_bytes > 0
    # the configured pipeline schedule is the one estimated, and named
    for schedule, title, extra in [("gpipe", "GPipe", []),
                                   ("interleaved_1f1b", "interleaved 1F1B, 2 stages per rank",
                                    ["--parallel.pp_stages_per_rank=2", "--model.n_layer=4"])]:
        piped = load_config("configs/demo.yaml", ["--parallel.engine=fsdp", "--parallel.pp=2", "--train.batch_size=8",
                                                  f"--parallel.pp_schedule={schedule}", "--model.tie_embeddings=false",
                                                  *extra])
        dry_run(piped, 2, 80.0)
        lines = capsys.readouterr().out.splitlines()
        at = lines.index(f"configured layout on 2 GPUs (fsdp engine, {title}): per-GPU memory in GiB and data sent "
                         "per GPU per step in GB")
        row = estimate_layout(piped, 1, 2, 1, 0, schedule=schedule, stages_per_rank=piped.parallel.pp_stages_per_rank)
        assert lines[at + 3].split()[14] == f"{row.total / GIB:.2f}"  # GPU GiB
        assert row.total != estimate_layout(piped, 1, 2, 1, 0).total  # not 1F1B's


def test_plan_table_lists_every_engine_and_picks_one():
    cfg = load_config("configs/llama-7b.yaml")
    table = plan_table(cfg, 8)
    for label in ("ddp", "fsdp", "deepspeed ZeRO-1", "deepspeed ZeRO-2", "deepspeed ZeRO-3"):
        assert sum(line.startswith(label + " ") for line in table.splitlines()) >= 2
    assert "pick: fsdp, no activation checkpointing" in table
    rows = plan_rows(cfg, 1)
    assert pick(rows, 80).cpu_offload and pick(rows, 8) is None  # a 7B model on one 80 GiB GPU needs the host
    # a config that offloads: its rows offload without recomputation too, which comes first when it fits
    offloaded = pick(plan_rows(load_config("configs/llama-7b.yaml", ["--parallel.engine=fsdp",
                                                                     "--parallel.cpu_offload=true"]), 1), 80)
    assert (offloaded.engine, offloaded.activation_checkpointing, offloaded.cpu_offload) == ("fsdp", 0, True)
    assert "nothing fits" in plan_table(cfg, 1, device_gib=8)
    assert estimate_memory(cfg, 8, "ddp").total > 80 * GIB
    encdec = plan_table(load_config("configs/demo-encdec.yaml"), 2)
    assert "float32" in encdec and "pick: ddp" in encdec


def test_bad_arguments_are_refused():
    cfg = _cfg()
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(cfg, 0)
    with pytest.raises(ValueError, match="zero_stage"):
        estimate_memory(cfg, 2, "deepspeed")
    with pytest.raises(ValueError, match="zero_stage"):
        estimate_memory(cfg, 2, "fsdp", 2)
    with pytest.raises(ValueError, match="unknown engine"):
        estimate_memory(cfg, 2, "megatron")
    with pytest.raises(ValueError, match="activation_checkpointing must be >= 0, got -1"):
        estimate_memory(cfg, 2, activation_checkpointing=-1)


def _train(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lm.train", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.process
def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path):
    out_dir, data_dir = tmp_path / "run", tmp_path / "no-data"
    result = _train("--config", "configs/llama-7b.yaml", "--dry-run", "--nproc", "8",
                    f"--train.out_dir={out_dir}", f"--data.dir={data_dir}")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "parameters: 7,297,830,912" in lines
    assert "world size 8" in result.stdout
    for label in ("ddp", "fsdp", "deepspeed ZeRO-1", "deepspeed ZeRO-2", "deepspeed ZeRO-3"):
        assert any(line.startswith(label + " ") for line in lines), label
    assert not out_dir.exists() and not data_dir.exists()
    assert "torch.distributed" not in result.stderr  # no process group was started


@pytest.mark.process
def test_dry_run_takes_the_world_size_from_the_environment(tmp_path):
    result = _train("--config", "configs/gpt2-124m.yaml", "--dry-run", f"--train.out_dir={tmp_path / 'run'}",
                    env={"WORLD_SIZE": "4"})
    assert result.returncode == 0, result.stderr
    assert "world size 4," in result.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.process
@pytest.mark.parametrize("args, message", [
    (["--dry-run", "--nproc", "0"], "argument --nproc: expected an integer in [1, 16777216], got '0'"),
    (["--dry-run", "--nproc", "two"], "argument --nproc: expected an integer in [1, 16777216], got 'two'"),
    (["--nproc", "2"], "error: --nproc: only --dry-run takes it"),
    (["--gpu-gib", "40"], "error: --gpu-gib: only --dry-run takes it"),
])
def test_bad_nproc_is_a_usage_error(args, message, tmp_path):
    result = _train("--config", "configs/gpt2-124m.yaml", f"--train.out_dir={tmp_path / 'run'}", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "run").exists()


def test_context_parallelism_of_a_family_without_its_estimate_is_named_not_guessed(plugin_dir, capsys):
    from lm.models.registry import get_family, register
    from lm.plan.layout_table import configured_table
    from tests.models.test_registry import mine

    gpt = get_family("gpt")
    register(mine(estimates=dataclasses.replace(gpt.estimates, context_kv=None)))
    cfg = load_config(None, ["--model.arch=mine", "--parallel.engine=fsdp", "--parallel.cp=2"])
    assert configured_table(cfg, 2, 80.0) == ("configured layout: not estimated: my GPT (model.arch=mine) gives no "
                                              "context-parallel estimate (Estimates.context_kv)")


@pytest.mark.parametrize("flags, message", [
    (["--parallel.engine=fsdp", "--parallel.cpu_offload=true"], "parallel.cpu_offload: FSDP2 offloads a GPU run's "
                                                                "shards to host memory; this run is on the CPU"),
    (["--train.float8=tensorwise"], "train.float8=tensorwise needs a CUDA GPU of compute capability 8.9 or later"),
])
def test_a_dry_run_on_the_cpu_refuses_what_the_run_on_the_cpu_refuses(flags, message, capsys):
    from lm.train import main as train_main

    assert run(train_main, ["--config", "configs/demo.yaml", "--train.device=cpu", *flags, "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")


@pytest.mark.parametrize("arch", ["gpt", "encoder", "encdec", "lstm"])
def test_checkpointing_more_blocks_never_raises_the_activation_estimate(arch):
    cfg = _cfg("--model.n_layer=4", f"--model.arch={arch}", *(["--model.n_head=4"] if arch != "lstm" else []))
    estimates = [estimate_memory(cfg, 8, activation_checkpointing=every).activations for every in (0, 4, 2, 1)]
    assert estimates == sorted(estimates, reverse=True) and estimates[-1] < estimates[0], estimates


def test_deepspeed_counts_the_whole_model_every_rank_holds_while_it_starts():
    # DeepSpeed casts and partitions a model lm built whole (lm.distributed.materialize), at every stage: 4 bytes a
    # parameter on every device first, and on every process's host before that; fsdp draws each rank's shard alone
    cfg = load_config("configs/llama-7b.yaml")
    whole = 4 * counts.num_params(cfg.model)
    for stage, offload in ((3, False), (3, True), (2, False), (2, True)):
        row = estimate_memory(cfg, 64, "deepspeed", stage, offload, activation_checkpointing=1)
        steady = row.parameters + row.gradients + row.optimizer + row.gathered + row.activations
        assert steady < whole and row.startup == row.total == row.host == whole, (stage, offload)
    zero3 = estimate_memory(load_config("configs/llama-7b.yaml", ["--data.seq_len=512"]), 64, "deepspeed", 3)
    assert zero3.total_no_checkpointing == whole  # short windows: without recomputation too
    fsdp = estimate_memory(cfg, 64, "fsdp", activation_checkpointing=1)
    assert fsdp.startup == fsdp.host == 0 and fsdp.total < whole
    ddp = estimate_memory(cfg, 64, "ddp")
    assert ddp.host == ddp.startup == whole < ddp.total  # ddp keeps the fp32 model: never the peak


def test_deepspeed_offload_keeps_the_bf16_weights_and_puts_master_moments_and_fp32_gradients_on_the_host():
    # two ranks: the offloaded state, 16 bytes a parameter over 2 (8 n), is more than the whole fp32 model every
    # process builds first (4 n), so the host column shows it and not that floor
    cfg = _cfg()
    n = counts.num_params(cfg.model)
    shard = -(-n // 2)
    for stage in (1, 2, 3):
        row = estimate_memory(cfg, 2, "deepspeed", stage, cpu_offload=True)
        assert row.host == shard * (4 + 8 + 4) > 4 * n  # fp32 master, two moments, CPU Adam's fp32 gradients
        assert row.optimizer == 0
        # ZeRO-Offload moves the optimizer, not the bf16 weights: they stay on the device (sharded under ZeRO-3)
        assert row.parameters == (shard if stage == 3 else n) * 2
        assert row.gradients == (shard if stage >= 2 else n) * 2


def test_another_engine_than_the_configs_takes_no_stage_or_offload_from_it():
    cfg = _cfg("--parallel.zero_stage=2", "--parallel.cpu_offload=true", engine="deepspeed")
    n = counts.num_params(cfg.model)
    shard = -(-n // 4)
    fsdp = estimate_memory(cfg, 4, "fsdp")
    assert (fsdp.zero_stage, fsdp.cpu_offload) == (0, False)
    assert (fsdp.parameters, fsdp.gradients, fsdp.optimizer) == (4 * shard, 4 * shard, 8 * shard)
    ddp = estimate_memory(cfg, 4, "ddp")  # not refused as "ddp cannot offload": the offload was deepspeed's
    assert (ddp.zero_stage, ddp.cpu_offload) == (0, False)
    same = estimate_memory(cfg, 4)  # the config's own engine takes its stage and offload
    assert (same.zero_stage, same.cpu_offload) == (2, True)


def test_fits_leaves_a_tenth_of_the_estimate_and_the_cuda_context():
    row = estimate_memory(_cfg(), 2)
    exact = (row.total * 1.1 + GIB) / GIB  # the smallest device the row fits
    assert fits(row, exact) and not fits(row, exact * (1 - 1e-9))
    assert not fits(row, 1.0)  # the CUDA context alone takes a 1 GiB device


def test_pick_prefers_sharding_to_recomputation():
    # a device on which ddp fits only with every block recomputed, fsdp without recomputation: fsdp is faster
    cfg = _cfg("--model.n_layer=4")
    rows = plan_rows(cfg, 8)
    row = {(r.engine, r.zero_stage, r.activation_checkpointing, r.cpu_offload): r for r in rows}
    ddp0, ddp1, fsdp0 = row["ddp", 0, 0, False], row["ddp", 0, 1, False], row["fsdp", 0, 0, False]
    gib = (max(ddp1.total, fsdp0.total) * 1.1 + GIB) / GIB
    assert not fits(ddp0, gib) and fits(ddp1, gib) and fits(fsdp0, gib)
    assert pick(rows, gib) == fsdp0


def test_the_rows_recompute_as_often_as_the_config_says():
    cfg = _cfg("--model.n_layer=4", "--parallel.activation_checkpointing=2")
    assert {r.activation_checkpointing for r in plan_rows(cfg, 2)} == {0, 2}
    assert {r.activation_checkpointing for r in plan_rows(_cfg(), 2)} == {0, 1}


@pytest.mark.parametrize("every, words", [(0, "no activation checkpointing"),
                                          (1, "activation checkpointing every block"),
                                          (2, "activation checkpointing every 2 blocks")])
def test_describe_names_the_checkpointing_interval(every, words):
    row = estimate_memory(_cfg("--model.n_layer=4"), 2, "fsdp", activation_checkpointing=every)
    assert describe(row) == f"fsdp, {words}"


def test_the_table_prints_each_rows_own_numbers_and_whether_it_fits():
    # Llama 2 7B on 8 devices: the rows differ by GiB, with and without recomputation, and some fit 80 GiB, some not
    cfg = load_config("configs/llama-7b.yaml")
    rows = plan_rows(cfg, 8)
    lines = plan_table(cfg, 8).splitlines()
    assert len(lines) == 3 + len(rows) + 2
    assert {fits(r, 80) for r in rows} == {True, False}
    for r, line in zip(rows, lines[3:]):
        cols = line.split()
        assert cols[-3:] == [f"{r.total / GIB:.2f}", f"{r.host / GIB:.2f}", "yes" if fits(r, 80) else "no"]
        assert cols[-9:-3] == [f"{x / GIB:.2f}" for x in (r.parameters, r.gradients, r.optimizer, r.gathered,
                                                           r.activations, r.logits)]
    # a 1 GiB device holds nothing but the CUDA context: every row says no
    small = _cfg("--train.batch_size=24")
    lines = plan_table(small, 2, device_gib=1.0).splitlines()
    assert all(line.endswith("  no") for line in lines[3:3 + len(plan_rows(small, 2))])
    assert lines[-1].startswith("pick: nothing fits 1 GiB")


def test_an_offloading_pick_states_its_host_memory():
    cfg = load_config("configs/llama-7b.yaml")
    best = pick(plan_rows(cfg, 1), 80)
    assert best.cpu_offload
    assert plan_table(cfg, 1).splitlines()[-1] == (f"pick: {describe(best)} ({best.total / GIB:.2f} GiB per device, "
                                                   f"{best.host / GIB:.2f} GiB host memory per process)")


def _model(*overrides: str):
    return _cfg("--model.n_layer=1", *overrides).model


@pytest.mark.parametrize("overrides", [
    ["--model.bias=false"],                                          # LayerNorm without its bias
    ["--model.d_head=32"],                                           # heads wider than d_model / n_head
    ["--model.n_kv_head=1", "--model.mlp=swiglu", "--model.norm=rmsnorm", "--model.bias=false"],
], ids=["layernorm-no-bias", "wide-heads", "gqa-swiglu"])
def test_block_params_are_the_built_blocks(overrides):
    # block_params counts the encoder-decoder's FLOPs (lm.models.encdec.family.flops_per_token) and is public: checked
    # against the blocks the families build, a GPT block and an encoder-decoder's decoder block (with cross-attention)
    gpt = _model(*overrides)
    assert block_params(gpt) == sum(p.numel() for p in family_of(gpt).build(gpt).blocks[0].parameters())
    if "--model.d_head=32" in overrides:
        return  # an encoder-decoder has no model.d_head
    encdec = _model("--model.arch=encdec", "--model.pos=sinusoidal", "--model.n_sentinels=4", *overrides)
    decoder = family_of(encdec).build(encdec).decoder[0]
    assert block_params(encdec, cross=True) == sum(p.numel() for p in decoder.parameters())


@pytest.mark.parametrize("c, r", [(2, 2), (2, 4), (4, 4)], ids=["bf16-weights", "autocast", "float32"])
def test_cross_attention_saves_its_norm_input_one_projection_input_q_output_and_logsumexp(c, r):
    # a decoder block of tgt tokens reading src encoder positions: besides the self-attention block, the norm's input
    # (r), the q projection's input (c: one linear reads it, so one autocast copy), q (c), the fused kernel's output
    # (c) and its logsumexp, 4 bytes per head per query position (not per key position)
    cfg = _model("--model.arch=encdec", "--model.pos=sinusoidal", "--model.n_sentinels=4")
    b, tgt, src, h, heads = 3, 10, 30, 64, 4
    t = b * tgt
    plain = layer_activation_bytes(cfg, b, tgt, c, r)
    crossed = layer_activation_bytes(cfg, b, tgt, c, r, memory_len=src)
    assert crossed - plain == r * t * h + 3 * c * t * h + 4 * b * heads * tgt


def _peak_by_hand(n_layer: int, every: int, full: int, boundary: int, start: int) -> int:
    """Backward starts with every block's saved tensors; recomputing checkpointed block j holds the blocks before j
    as saved, j's input, and j's full activations (the blocks after j are freed by then)."""
    checkpointed = [every > 0 and (start + i) % every == 0 for i in range(n_layer)]
    kept = [boundary if ck else full for ck in checkpointed]
    peaks = [sum(kept)] + [sum(kept[:j]) + boundary + full for j in range(n_layer) if checkpointed[j]]
    return max(peaks)


@pytest.mark.parametrize("start", [0, 1, 3, 4, 6])
def test_stack_peak_bytes_of_a_stack_that_does_not_start_at_block_0(start):
    # an encoder-decoder's decoder stack starts at block n_layer in model order
    full, boundary = 1000, 7
    for n_layer in range(1, 8):
        for every in range(0, 6):
            assert stack_peak_bytes(n_layer, every, full, boundary, start) == _peak_by_hand(
                n_layer, every, full, boundary, start), (n_layer, every)


def test_relu2_saves_its_output_and_the_squares_input():
    # relu keeps one tensor of t x d_ff (its output, which the next linear reads), relu2 two (the relu output and the
    # square's), gelu two (its input and output), swiglu four
    cfg = {mlp: _model(f"--model.mlp={mlp}", "--model.d_ff=96") for mlp in ("relu", "relu2", "gelu")}
    b, s, c, f = 2, 16, 2, 96
    by_mlp = {mlp: layer_activation_bytes(m, b, s, c, 2) for mlp, m in cfg.items()}
    assert by_mlp["relu2"] - by_mlp["relu"] == c * b * s * f
    assert by_mlp["relu2"] == by_mlp["gelu"]


def test_only_a_stack_that_ends_in_a_norm_keeps_the_final_norms_input():
    # A pre-norm GPT ends in a final norm, which saves its input (the float32 residual stream, t x h) for backward;
    # a post-norm stack has no final norm (its last block already ends in one). Two and four blocks give what
    # lies outside the blocks (2 * A(2) - A(4)): it differs between the two by that one input, in the estimate
    # and in what autograd actually saves.
    t, h = 3 * 40, 64

    def outside_blocks(measure, position):
        a2, a4 = (measure(_cfg(f"--model.norm_position={position}", f"--model.n_layer={n}", "--train.device=cpu",
                               dtype="float32")) for n in (2, 4))
        return 2 * a2 - a4

    predicted = {p: outside_blocks(lambda c: estimate_memory(c, 1).activations, p) for p in ("pre", "post")}
    measured = {p: outside_blocks(lambda c: saved_bytes(c, bf16_weights=False, autocast=False), p)
                for p in ("pre", "post")}
    assert measured["pre"] - measured["post"] == pytest.approx(4 * t * h, rel=0.1)
    assert predicted["pre"] - predicted["post"] == 4 * t * h
