"""The layout planner's tables as `python -m lm.train --dry-run` prints them: the configured layout's estimate, and
with --nodes every layout of the cluster and the pick (the numbers: `lm.plan.layouts`)."""

from lm.config import JobConfig
from lm.models.registry import family_of
from lm.plan.layouts import (
    LayoutEstimate,
    RuledOut,
    candidates,
    estimate_layout,
    fits_layout,
    layout_rows,
    most_gpus,
    pick_layout,
)
from lm.plan.memory import GIB

__all__ = ["configured_table", "layout_table", "why_none"]

_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B"}
"""parallel.pp_schedule as a table's title names it."""


def _examples(cases: list[RuledOut]) -> str:
    """The first few layouts of `cases`, and the reason of the first case of each key (parallel.tp, parallel.pp,
    train.batch_size)."""
    layouts = ", ".join(f"tp {c.tp} x pp {c.pp} x dp {c.dp}" for c in cases[:3]) + \
        (f" and {len(cases) - 3} more" if len(cases) > 3 else "")
    firsts: dict[str, str] = {}
    for case in sorted(cases, key=lambda c: (c.tp, c.pp)):  # the key a reason names first: its axis
        firsts.setdefault(case.reason.split(":", 1)[0].split("=")[0], case.reason)
    return f"{layouts}: {'; '.join(firsts.values())}"


def why_none(cfg: JobConfig, nodes: int, gpus_per_node: int, rows: list[LayoutEstimate], device_gib: float) -> str:
    """Which constraint rules every layout of the cluster out: the model's divisibility, the batch split (each with
    its first cases), the memory of those that remain; then what to change."""
    _, out = candidates(cfg, nodes, gpus_per_node)
    parts = [f"the {constraint} rules out {len(cases)} ({_examples(cases)})" for constraint in ("batch split",
             "divisibility") if (cases := [why for why in out if why.constraint == constraint])]
    if rows:
        smallest = min(rows, key=lambda r: r.total)
        ckpt = "every block recomputed" if smallest.activation_checkpointing else "nothing recomputed"
        parts.append(f"the memory rules out the {len({(r.tp, r.pp, r.ep) for r in rows})} that remain (the "
                     f"smallest, {smallest.label} with {ckpt}{', state offloaded' * smallest.cpu_offload}, needs "
                     f"{_gib(smallest.total)} GiB per GPU, more than {device_gib:g} GiB leaves room for)")
        advice = f"lower train.micro_batch_size ({cfg.train.micro_batch_size}), or add GPUs"
    else:
        tp, pp, dp = most_gpus(cfg, gpus_per_node)
        advice = (f"this config trains on at most {tp * pp * dp} GPUs (tp {tp} x pp {pp} x dp {dp}): plan fewer, or "
                  f"raise train.batch_size ({cfg.train.batch_size})")
    return f"pick: no layout of {nodes * gpus_per_node} GPUs can train this config: {'; '.join(parts)}; {advice}"


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}"


def _rows_text(title: str, rows: list[LayoutEstimate], device_gib: float, schedule: str = "1F1B") -> list[str]:
    """`rows` under `title` as the lines of a text table, pipelines running `schedule`, and what its columns
    mean."""
    cp = any(r.cp > 1 for r in rows)  # a column only for tables that have context parallelism
    width = max([30, *(len(r.label) for r in rows)])
    head = (f"{'layout':<{width}} {'ckpt':>4} {'offload':>7} {'micro':>5} {'state':>7} {'gather':>7} {'activ':>7} "
            f"{'GPU GiB':>8} {'tp GB':>7} {'fsdp GB':>7} {'pp GB':>6} {'ep GB':>6}" + f" {'cp GB':>6}" * cp +
            f"  fits {device_gib:g} GiB")
    lines = [f"{title} (fsdp engine, {schedule}): per-GPU memory in GiB and data sent per GPU per step in GB", head,
             "-" * len(head)]
    for r in rows:
        lines.append(f"{r.label:<{width}} {r.activation_checkpointing:>4} {'yes' if r.cpu_offload else 'no':>7} "
                     f"{r.micro_batches:>5} {_gib(r.state):>7} "
                     f"{_gib(r.gathered):>7} {_gib(r.activations):>7} {_gib(r.total):>8} {_gb(r.tp_bytes):>7} "
                     f"{_gb(r.fsdp_bytes):>7} {_gb(r.pp_bytes):>6} {_gb(r.ep_bytes):>6}" +
                     f" {_gb(r.cp_bytes):>6}" * cp + f"  {'yes' if fits_layout(r, device_gib) else 'no'}")
    lines.append("micro: micro-batches per replica and step. state: weights, gradients and AdamW moments (in host "
                 "memory when offloaded); gather: FSDP2's unsharded units; activ: activations and logits; all for "
                 "the rank that needs most")
    return lines


def configured_table(cfg: JobConfig, world_size: int, device_gib: float) -> str:
    """The layout the parallel section sets (tp, pp, cp, dp_replicate, ep) on `world_size` GPUs, estimated as
    `layout_table` estimates each layout of a cluster, under the configured pipeline schedule; context
    parallelism of a family that gives no estimate of it is named, not guessed at. The world size is the run's
    (`check_world`)."""
    par, model = cfg.parallel, cfg.model
    if par.cp > 1 and family_of(model).estimates.context_kv is None:
        return (f"configured layout: not estimated: {model.title} (model.arch={model.arch}) gives no "
                "context-parallel estimate (Estimates.context_kv)")
    row = estimate_layout(cfg, par.tp, par.pp, world_size // (par.tp * par.pp * par.cp), par.activation_checkpointing,
                          par.cpu_offload, par.ep, par.cp, par.dp_replicate, par.pp_schedule, par.pp_stages_per_rank)
    schedule = _SCHEDULES[par.pp_schedule] + (f", {par.pp_stages_per_rank} stages per rank"
                                              if par.pp_stages_per_rank > 1 else "")
    return "\n".join(_rows_text(f"configured layout on {world_size} GPUs", [row], device_gib, schedule))


def layout_table(cfg: JobConfig, nodes: int, gpus_per_node: int, device_gib: float) -> str:
    """The layouts of `layout_rows` as a text table, and the pick with its reasons."""
    rows = layout_rows(cfg, nodes, gpus_per_node)
    lines = _rows_text(f"layouts on {nodes} node(s) x {gpus_per_node} GPUs = {nodes * gpus_per_node}", rows,
                       device_gib)
    best = pick_layout(rows, device_gib)
    if best is None:
        lines.append(why_none(cfg, nodes, gpus_per_node, rows, device_gib))
        return "\n".join(lines)
    every = best.activation_checkpointing
    keys = [f"--parallel.tp={best.tp}"] * (best.tp > 1) + [f"--parallel.pp={best.pp}"] * (best.pp > 1) + \
        [f"--parallel.activation_checkpointing={every}"] * (every > 0) + \
        ["--parallel.cpu_offload=true"] * best.cpu_offload + [f"--parallel.ep={best.ep}"] * (best.ep > 1)
    recompute = "every block" if best.activation_checkpointing else "off"
    host = f", {_gib(best.state)} GiB host memory per process" if best.cpu_offload else ""
    lines.append(f"pick: {best.label}, activation checkpointing {recompute} ({_gib(best.total)} GiB per GPU{host}): "
                 f"{' '.join(['--parallel.engine=fsdp', *keys])}")
    lines.append("why: of the layouts that fit, it offloads nothing if any can (host transfers are slowest), "
                 "recomputes nothing if any can (recomputing costs a third more compute), then has the fewest "
                 "tensor-parallel ranks (a collective in every sublayer), then the fewest pipeline stages (idle "
                 "time at each step's start and end)" + (", then of the expert-parallel ranks the number that "
                 "sends least (FSDP2's all-gathers of the experts against the all-to-alls of the tokens)"
                 if any(r.ep > 1 for r in rows) else ""))
    return "\n".join(lines)
