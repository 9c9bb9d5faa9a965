"""`python -m lm.train`: pretrain a model, alone or under torchrun (one process per device)."""

import argparse
import os

from lm.cli import exit_without_teardown, in_range, run
from lm.config import JobConfig, parse_cli
from lm.errors import ConfigError

MAX_DEVICES = 2**24
"""The most devices a dry run plans for (16,777,216, far beyond any cluster): the plan's work grows with them."""
MAX_GIB = 1e6
"""The most memory per device a dry run takes, in GiB (a bound that keeps the arithmetic finite)."""


def _flags(parser: argparse.ArgumentParser) -> None:
    devices = in_range(int, 1, MAX_DEVICES)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the parameter count and a per-device memory estimate for every engine, "
                             "then exit without training (no process group, model, data or run directory)")
    parser.add_argument("--nproc", type=devices, default=None,
                        help=f"--dry-run: devices to plan for, 1 to {MAX_DEVICES} (default: WORLD_SIZE, else 1)")
    parser.add_argument("--gpu-gib", type=in_range(float, 1, MAX_GIB), default=None,
                        help=f"--dry-run: device memory in GiB, 1 to {MAX_GIB:g}, that the 'fits' column checks "
                             "against (default 80)")
    parser.add_argument("--nodes", type=devices, default=None,
                        help="--dry-run: also plan the tensor/pipeline/data-parallel layouts of this many nodes")
    parser.add_argument("--gpus-per-node", type=in_range(int, 1, 1024), default=None,
                        help="--dry-run: GPUs per node for the layouts, 1 to 1024 (default 8)")


def _planned_world_size(nproc: int | None) -> int:
    if nproc is not None:
        return nproc
    # Only a default for the plan: no process group exists, so DistEnv has nothing to say yet.
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        return in_range(int, 1, MAX_DEVICES)(text)
    except argparse.ArgumentTypeError:
        raise ConfigError(f"--nproc: not given, and WORLD_SIZE={text!r} is not an integer from 1 to "
                          f"{MAX_DEVICES}") from None


def dry_run(cfg: JobConfig, world_size: int, device_gib: float, nodes: int | None = None,
            gpus_per_node: int | None = None) -> None:
    """Print what the config would train and how much memory each engine needs per device; with `nodes`, also
    the layouts of that many nodes of `gpus_per_node` GPUs and the one to pick."""
    from lm.models.registry import family_of
    from lm.plan.counts import num_params
    from lm.plan.layout_table import configured_table, layout_table
    from lm.plan.memory_table import plan_table

    if cfg.train.device == "cpu":  # planned for the CPU, as the config says: what a CPU run cannot do is refused
        import torch

        from lm.distributed.float8 import check_float8
        from lm.distributed.fsdp import check_offload

        if cfg.parallel.engine == "fsdp":
            check_offload(cfg.parallel, "cpu")
        check_float8(cfg.train.float8, torch.device("cpu"))
    m = cfg.model
    family_of(m).training.objective(m, cfg.data, cfg.data.seq_len, cfg.train.seed)  # refuses what the run's would
    print(f"model: {m.summary}, vocabulary {m.padded_vocab_size:,} (padded)")
    total, active = num_params(m), num_params(m, active=True)
    print(f"parameters: {total:,}" + (f" ({active:,} active per token)" if active != total else ""))
    print(f"configured: parallel.engine={cfg.parallel.engine}"
          + (f" zero_stage={cfg.parallel.zero_stage}" if cfg.parallel.engine == "deepspeed" else "")
          + f" cpu_offload={cfg.parallel.cpu_offload} activation_checkpointing={cfg.parallel.activation_checkpointing}")
    par = cfg.parallel
    split = {key: n for key, n in (("tp", par.tp), ("pp", par.pp), ("cp", par.cp), ("dp_replicate", par.dp_replicate),
                                   ("ep", par.ep)) if n > 1}
    if split:
        from lm.distributed.layout import check_world  # the rules the run applies to its world size (no group)

        try:
            check_world(cfg, world_size)
        except ConfigError as err:
            raise ConfigError(f"--nproc {world_size}: {err}") from None
        print(configured_table(cfg, world_size, device_gib))
        print()
        print("each engine over data parallelism alone:")
    print(plan_table(cfg, world_size, device_gib))
    if nodes is not None:
        print()
        print(layout_table(cfg, nodes, gpus_per_node, device_gib))


def main(argv: list[str]) -> int:
    cfg, args = parse_cli(argv, "Pretrain a language model on prepared token shards. "
                                "Run under torchrun for several processes.",
                          extra=_flags, prog="python -m lm.train")
    if not args.dry_run:
        for flag, value in (("--nproc", args.nproc), ("--gpu-gib", args.gpu_gib), ("--nodes", args.nodes),
                            ("--gpus-per-node", args.gpus_per_node)):
            if value is not None:
                raise ConfigError(f"{flag}: only --dry-run takes it; torchrun sets the world size of a real run")
    else:
        nodes, per_node = args.nodes, args.gpus_per_node
        if per_node is not None and nodes is None:
            nodes = 1
        if nodes is not None:
            per_node = per_node or 8
            if nodes * per_node > MAX_DEVICES:
                raise ConfigError(f"--nodes {nodes} x --gpus-per-node {per_node} is {nodes * per_node} GPUs; a dry "
                                  f"run plans for at most {MAX_DEVICES}")
            if args.nproc is not None and args.nproc != nodes * per_node:
                raise ConfigError(f"--nproc {args.nproc}: --nodes {nodes} x --gpus-per-node {per_node} is "
                                  f"{nodes * per_node} GPUs; give one or the other")
            args.nproc = nodes * per_node
        dry_run(cfg, _planned_world_size(args.nproc), args.gpu_gib or 80.0, nodes, per_node)
        return 0
    # imported here so that --dry-run needs neither torch.distributed nor the trainer
    from lm.training.job import run_job

    run_job(cfg)
    return 0


if __name__ == "__main__":
    exit_without_teardown(run(main))
