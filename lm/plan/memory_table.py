"""The memory plan `python -m lm.train --dry-run` prints: every engine setup's estimate (lm.plan.memory)
as a table, whether each fits a device, and the setup to pick."""

from lm.config import JobConfig
from lm.config.rules import batch_split_problem
from lm.models.registry import family_of
from lm.plan.counts import num_params
from lm.plan.memory import CUDA_CONTEXT_BYTES, GIB, MemoryEstimate, estimate_memory

__all__ = ["describe", "fits", "pick", "plan_rows", "plan_table"]


def plan_rows(cfg: JobConfig, world_size: int) -> list[MemoryEstimate]:
    """ddp, fsdp and ZeRO-1/2/3, each without and with activation checkpointing (the config's n, or every
    block), offloading as the config says; then, when the config does not offload, fsdp and ZeRO with it."""
    every = cfg.parallel.activation_checkpointing or 1
    offload = cfg.parallel.cpu_offload
    setups = [("ddp", 0, False), ("fsdp", 0, offload), *(("deepspeed", z, offload) for z in (1, 2, 3))]
    rows = [estimate_memory(cfg, world_size, e, z, o, ckpt) for e, z, o in setups for ckpt in (0, every)]
    if not offload:
        rows += [estimate_memory(cfg, world_size, e, z, True, every) for e, z, _ in setups[1:]]
    return rows


def fits(estimate: MemoryEstimate, device_gib: float) -> bool:
    """Whether the estimate fits a device of `device_gib` GiB, leaving 1 GiB for the CUDA context and 10%
    of the estimate for what it does not count (fragmentation, communication buffers, temporaries)."""
    return estimate.total * 1.1 + CUDA_CONTEXT_BYTES <= device_gib * GIB


def pick(rows: list[MemoryEstimate], device_gib: float) -> MemoryEstimate | None:
    """The fastest setup of `rows` that fits, by a rule of thumb: no recomputation before recomputation,
    replicated (ddp) before sharded (fsdp, whose all-gathers cost bandwidth), anything before offloading
    to the CPU (whose transfers and CPU optimizer step are slowest). ZeRO-3 needs at least what fsdp needs
    (the whole model on every device while it starts) and ZeRO-1/2 more, so fsdp stands for the sharded
    engines. None when nothing fits."""
    order = [("ddp", False, False), ("fsdp", False, False), ("ddp", True, False), ("fsdp", True, False),
             ("fsdp", False, True), ("fsdp", True, True)]
    for engine, recompute, offload in order:
        for row in rows:
            if (row.engine, row.activation_checkpointing > 0, row.cpu_offload) == (engine, recompute, offload) \
                    and fits(row, device_gib):
                return row
    return None


def describe(estimate: MemoryEstimate) -> str:
    """One line naming a setup, e.g. `fsdp, activation checkpointing every block, cpu offload`."""
    every = estimate.activation_checkpointing
    ckpt = ("no activation checkpointing" if not every else
            "activation checkpointing every block" if every == 1 else f"activation checkpointing every {every} blocks")
    return f"{estimate.label}, {ckpt}" + (", cpu offload" if estimate.cpu_offload else "")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def plan_table(cfg: JobConfig, world_size: int, device_gib: float = 80.0) -> str:
    """A text table of `plan_rows`: GiB per device per component, whether each fits `device_gib`, and `pick`."""
    m = cfg.model
    rows = plan_rows(cfg, world_size)
    precision = "bf16 mixed precision" if rows[0].mixed_precision else "float32"
    active = num_params(m, active=True)
    # every expert's weights, gradients and moments are held, though a token goes through only its top k
    held = f" (all held; {active:,} active per token)" if active != rows[0].num_params else ""
    head = (f"{'engine':<18} {'offload':>7} {'ckpt':>4} {'params':>7} {'grads':>7} {'optim':>7} {'gather':>7} "
            f"{'activ':>7} {'logits':>7} {'GPU GiB':>8} {'host GiB':>8}  fits {device_gib:g} GiB")
    lines = [
        f"per-device memory estimate (GiB = 2^30 bytes): {rows[0].num_params:,} parameters{held}, "
        f"world size {world_size}, micro batch {cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens, {precision}",
        head, "-" * len(head),
    ]
    for r in rows:
        lines.append(
            f"{r.label:<18} {'yes' if r.cpu_offload else 'no':>7} {r.activation_checkpointing:>4} "
            f"{_gib(r.parameters):>7} {_gib(r.gradients):>7} {_gib(r.optimizer):>7} {_gib(r.gathered):>7} "
            f"{_gib(r.activations):>7} {_gib(r.logits):>7} {_gib(r.total):>8} {_gib(r.host):>8}  "
            f"{'yes' if fits(r, device_gib) else 'no'}"
        )
    lines.append(f"ckpt: activation checkpointing every n-th block (0: none). activ includes logits. "
                 f"fits: GPU GiB x 1.1 + 1 GiB (CUDA context) <= {device_gib:g} GiB")
    if note := family_of(m).estimates.memory_note:
        lines.append(note)
    best = pick(rows, device_gib)
    train = cfg.train
    if split := batch_split_problem(train.batch_size, train.micro_batch_size, world_size, f"world size {world_size}"):
        # every engine here runs world size replicas: none of them can take the batch, whatever the memory
        lines.append(f"pick: none on {world_size} devices: {split}")
    elif best is None:
        lines.append(f"pick: nothing fits {device_gib:g} GiB at this micro batch; lower train.micro_batch_size "
                     "or add devices")
    else:
        host = f", {_gib(best.host)} GiB host memory per process" if best.cpu_offload else ""
        lines.append(f"pick: {describe(best)} ({_gib(best.total)} GiB per device{host})")
    return "\n".join(lines)
