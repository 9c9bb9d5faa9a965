"""Training throughput: our model of a preset (eager, compiled, under each engine) and its transformers twin
(GPT2LMHeadModel for the GPT-2 presets) with the same weights, batch, optimizer (our AdamW groups) and precision,
timed step by step on random tokens."""

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn as nn

from lm.bench.common import median_seconds, median_seconds_interleaved, peak_memory_gib, reset_peak_memory
from lm.config import JobConfig
from lm.distributed.activation import compile_blocks
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.distributed.optim import build_optimizer
from lm.distributed.precision import autocast_for
from lm.hf.targets import hf_state_dict, pick_target
from lm.models.block import Block
from lm.models.loss import compiled_loss
from lm.models.registry import family_of
from lm.plan.counts import flops_per_token
from lm.plan.flops import peak_flops
from lm.training.setup import build_run_engine
from lm.training.step import train_step


def random_batch(cfg: JobConfig, micro_batch: int, device: torch.device) -> torch.Tensor:
    """(B, T + 1) token ids: inputs are [:, :-1], targets [:, 1:]."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.data.seq_len + 1), generator=generator).to(device)


def hf_twin(model: nn.Module) -> nn.Module:
    """The transformers class of `model`'s family that reproduces it (GPT2LMHeadModel for the GPT-2 presets),
    SDPA attention, holding `model`'s weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    target = pick_target(model.cfg, family_of(model.cfg).hf.targets, model.cfg.title)
    fields = target.config(model.cfg, None, torch.float32)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    hf.load_state_dict({k: v.detach().cpu() for k, v in hf_state_dict(model, target).items()}, strict=False)
    return hf


def _row(cfg: JobConfig, device: torch.device, step_s: float, micro_batch: int, peak_gib: float | None,
         extra: dict) -> dict:
    tok_s = micro_batch * cfg.data.seq_len / step_s
    flops = flops_per_token(cfg.model, cfg.data.seq_len, cfg.data) * tok_s
    peak = peak_flops(device)
    return {"ms/step": step_s * 1e3, "tokens/s": tok_s, "TFLOP/s": flops / 1e12,
            "MFU": flops / peak if peak else None, "peak GiB": peak_gib, **extra}


def training_step(cfg: JobConfig, device: torch.device, micro_batch: int, compiled: bool = False,
                  hf: bool = False) -> tuple[Callable[[], None], float | None]:
    """A closure running one training step (forward, backward, clip, AdamW) of our model, or with `hf` of
    its transformers twin built from the same initial weights; and, with `hf`, the largest logit difference
    between the two models (they must be the same model)."""
    family = family_of(cfg.model)
    torch.manual_seed(0)
    ours = family.build(cfg.model)
    if hf:
        model = hf_twin(ours).to(device)
        with torch.no_grad():  # the same model: the same logits over the tokenizer's ids
            x = random_batch(cfg, 1, device)[:, :16]
            ours = ours.to(device)
            diff = (model(input_ids=x).logits - ours.logits(ours(x))[..., :cfg.model.vocab_size]).abs().max().item()
        if diff > 1e-3:  # a comparison between different models would be meaningless
            raise RuntimeError(f"transformers' copy of the model gives other logits (max difference {diff:.1e})")
        del ours
        heads = [model.lm_head]
    else:
        model, diff = ours.to(device), None
        heads = family.output_layers(model)
        if compiled:  # as the trainer compiles: block by block, and the loss (below)
            compile_blocks(family.blocks(model))
    optimizer = build_optimizer(model, cfg.optim, heads)
    autocast = autocast_for(cfg.train.dtype, device)
    x = random_batch(cfg, micro_batch, device)
    inputs, targets = x[:, :-1], x[:, 1:]

    def step() -> None:
        with autocast:
            if hf:  # what a transformers user writes: the model shifts the labels and computes the loss
                loss = model(input_ids=inputs, labels=inputs).loss
            else:
                with compiled_loss(compiled):  # as the trainer's train.compile: the blocks and the loss
                    loss = family.training.loss(model, model, [inputs, targets]).optimized
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, diff


def bench_model(cfg: JobConfig, device: torch.device, micro_batch: int, warmup: int, reps: int) -> dict:
    """Our model's eager `training_step` timed alone: median of `reps` after `warmup`. Returns a row of numbers."""
    step, _ = training_step(cfg, device, micro_batch)
    reset_peak_memory(device)
    step_s = median_seconds(step, device, warmup, reps)
    return _row(cfg, device, step_s, micro_batch, peak_memory_gib(device), {})


def bench_training(cfg: JobConfig, device: torch.device, micro_batch: int, warmup: int, reps: int,
                   compiled: bool = True) -> dict[str, dict]:
    """Rows of numbers by name: "transformers" (with the twins' "max |logit diff|"), "ours eager" and, with
    `compiled`, "ours compiled".

    Their steps are timed in turns (`median_seconds_interleaved`), so that a slow spell of a shared machine
    touches each alike and their ratio compares like with like; timed one after the other, the ratio followed the
    machine's drift. Each row's peak memory comes from a pass of its own first, with its model alone in memory,
    over its `warmup` steps and one more: in the timed pass all of them are alive at once."""
    kinds: dict[str, dict] = {"transformers": {"hf": True}, "ours eager": {}}
    if compiled:
        kinds["ours compiled"] = {"compiled": True}
    peaks, diff = {}, None
    for name, kind in kinds.items():
        step, found = training_step(cfg, device, micro_batch, **kind)
        if found is not None:  # the transformers twin's
            diff = found
        reset_peak_memory(device)
        for _ in range(warmup + 1):
            step()
        peaks[name] = peak_memory_gib(device)
        del step  # its model and optimizer state, before the next row's peak
    steps = {name: training_step(cfg, device, micro_batch, **kind)[0] for name, kind in kinds.items()}
    # the compiled step compiles in its first call: warmed up at least once, whatever `warmup` says
    seconds = median_seconds_interleaved(steps, device, max(warmup, int(compiled)), {name: reps for name in steps})
    return {name: _row(cfg, device, seconds[name], micro_batch, peaks[name],
                       {"max |logit diff|": diff} if name == "transformers" else {}) for name in kinds}


def profile_step(cfg: JobConfig, device: torch.device, micro_batch: int, warmup: int, reps: int,
                 hf: bool = False, rows: int = 12) -> str:
    """torch.profiler's table of the ops that take the most time over `reps` training steps."""
    from torch.profiler import ProfilerActivity, profile

    step, _ = training_step(cfg, device, micro_batch, hf=hf)
    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            step()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def sdpa_kernel(cfg: JobConfig, device: torch.device, micro_batch: int) -> str:
    """The kernel that scaled_dot_product_attention picked for one training forward of a block (the
    preset's batch, length, heads and precision), as torch.profiler names it: `flash_attention`,
    `efficient_attention`, `cudnn_attention`, `flash_attention_for_cpu`, or `math` for the unfused fallback."""
    from torch.profiler import ProfilerActivity, profile

    block = Block(cfg.model, causal=True).to(device)
    x = torch.randn(micro_batch, cfg.data.seq_len, cfg.model.d_model, device=device)  # (B, T, C)
    with profile(activities=[ProfilerActivity.CPU]) as prof, autocast_for(cfg.train.dtype, device):
        block(x)
    prefix = "aten::_scaled_dot_product_"
    names = [event.key[len(prefix):] for event in prof.key_averages() if event.key.startswith(prefix)]
    if not names:
        raise RuntimeError("the profiler saw no scaled_dot_product_attention kernel in a block's forward")
    return "math" if any(name.startswith("attention_math") for name in names) else names[0]


def engine_step(cfg: JobConfig, device: torch.device, micro_batch: int) -> tuple[Callable[[], None], Engine]:
    """A closure running one optimizer step as the trainer takes it (`lm.training.step.train_step`) on one
    micro-batch of `micro_batch` sequences, under cfg.parallel's engine on a one-process group; and the engine."""
    # a step of one micro-batch: with the preset's batch (gpt2-124m's 512 of 32) DeepSpeed would accumulate
    # over several calls and step its optimizer in none or some of them, while ddp and fsdp step in each
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=micro_batch,
                                                             micro_batch_size=micro_batch))
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=device)
    family = family_of(cfg.model)
    engine = build_run_engine(cfg, family, env)
    loss = functools.partial(family.training.loss, optim=cfg.optim)
    x = random_batch(cfg, micro_batch, device)
    batch = [x[:, :-1], x[:, 1:]]

    def step() -> None:
        train_step(engine, loss, [batch], cfg.optim.lr, cfg.optim.grad_clip)

    return step, engine


def bench_engine(cfg: JobConfig, device: torch.device, micro_batch: int, warmup: int, reps: int) -> dict:
    """`engine_step` timed: the engine's own costs (wrappers, sharding, DeepSpeed's step) at world size 1."""
    step, _ = engine_step(cfg, device, micro_batch)
    reset_peak_memory(device)
    step_s = median_seconds(step, device, warmup, reps)
    return _row(cfg, device, step_s, micro_batch, peak_memory_gib(device), {})
