"""`lm-torchrun ARGS` (or `python -m lm.torchrun ARGS`): torchrun with the same ARGS, ending a failed run on the
project's own line.

A worker that refuses its input prints one `error:` line and exits 2. torchrun would then print an error log
line per worker, a ChildFailedError traceback and a failure table below it, so the user's last screenful is
the launcher's and not the reason. Here torchrun's log is held back until the run ends: a run whose first
failure exited 2 (an input error the worker has already named) ends with the workers' lines and exit status
2, and the held log is dropped; any other ending (success, a crash, a signal, an exit 1) prints the held log
and, for a failure, one `error:` line naming the rank and its exit code. The launch scripts start torchrun
through this command (launch/torchrun.sh).
"""

import logging
import os
import sys
from logging.handlers import MemoryHandler

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
from torch.distributed.run import parse_args
from torch.distributed.run import run as torchrun

from lm.cli import signal_name

INPUT_ERROR = 2
"""The exit status of a tool that refused its input with one `error:` line (`lm.cli.run`)."""


def _hold_launcher_log() -> tuple[MemoryHandler, list[logging.Handler]]:
    """Route torch.distributed's log records into a buffer instead of its stderr handlers."""
    logger = logging.getLogger("torch.distributed")
    shown = list(logger.handlers)
    held = MemoryHandler(capacity=10**6, flushLevel=logging.CRITICAL + 1)
    for handler in shown:
        logger.removeHandler(handler)
    logger.addHandler(held)
    return held, shown


def _show(held: MemoryHandler, shown: list[logging.Handler]) -> None:
    for record in held.buffer:
        for handler in shown:
            if record.levelno >= handler.level:
                handler.handle(record)
    held.buffer.clear()


def _no_restart_after_an_input_error() -> None:
    """torchrun restarts the whole group after any failure, up to --max-restarts (MAX_RESTARTS in the launch
    scripts); a worker that refused its input would refuse it again each time, a start-up and one more `error:`
    line per restart. The agent is told it has no restarts left once a worker exits 2."""
    monitor = LocalElasticAgent._monitor_workers

    def watch(agent: LocalElasticAgent, worker_group):
        result = monitor(agent, worker_group)
        if any(failure.exitcode == INPUT_ERROR for failure in result.failures.values()):
            agent._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = watch


def _describe(exitcode: int) -> str:
    return f"was killed by {signal_name(-exitcode)}" if exitcode < 0 else f"exited with status {exitcode}"


def _count_problem(args) -> str | None:
    """What is wrong with torchrun's process and node counts, which it would refuse with a traceback, or None."""
    nproc = str(args.nproc_per_node)
    if not (nproc in ("auto", "cpu", "gpu", "xpu") or nproc.isdecimal() and int(nproc) > 0):
        return (f"--nproc_per_node: expected a positive number of processes per node (or auto, cpu, gpu), got "
                f"{nproc!r} (NPROC_PER_NODE in the launch scripts)")
    nodes = str(args.nnodes).split(":")
    if len(nodes) > 2 or not all(n.isdecimal() and int(n) > 0 for n in nodes) or int(nodes[0]) > int(nodes[-1]):
        return f"--nnodes: expected a positive number of nodes, or MIN:MAX with 0 < MIN <= MAX, got {args.nnodes!r}"
    return None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if problem := _count_problem(args):
        print(f"error: {problem}", file=sys.stderr)
        return INPUT_ERROR
    if "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node not in ("1", 1):
        # what torchrun would set, without the banner it prints to say so on every run
        os.environ["OMP_NUM_THREADS"] = "1"
    held, shown = _hold_launcher_log()
    _no_restart_after_an_input_error()
    try:
        torchrun(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode == INPUT_ERROR:
            return INPUT_ERROR
        _show(held, shown)
        print(f"error: {err.name}: rank {rank} (pid {failure.pid}) {_describe(failure.exitcode)}; its own output "
              "is above", file=sys.stderr)
        return 1
    except SignalException as err:  # Ctrl-C or another signal torchrun handles: the workers were told to stop
        _show(held, shown)
        print(f"error: stopped by {err.sigval.name}", file=sys.stderr)
        return 1
    except RendezvousError as err:  # a node that never came (not started, another address, port or run id)
        _show(held, shown)
        where = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
        if isinstance(err, RendezvousConnectionError):
            print(f"error: cannot reach the rendezvous at {where}: check that MASTER_ADDR names a node this one "
                  "reaches and that MASTER_PORT is open there", file=sys.stderr)
            return 1
        why = f" ({err})" if str(err) else ""
        print(f"error: the rendezvous at {where} ended with {type(err).__name__}{why}: --nnodes="
              f"{args.nnodes} nodes did not all join; start the script on every node with the same NNODES, "
              "MASTER_ADDR, MASTER_PORT and RUN_ID", file=sys.stderr)
        return 1
    _show(held, shown)
    return 0


def cli() -> None:
    """The `lm-torchrun` command."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
