"""Long-lived gloo process groups for the tests that only need ranks: one pool of 1, 2 or 4 worker processes per
world size and pytest run, each worker importing torch and lm once and joining its pool's group once, then
running jobs (a function and its arguments, in every rank) until the session ends.

A torchrun of `lm.train` per test case spends most of its seconds starting Python and importing torch in every
rank; a job in a pool spends them training. What a process of its own gave for free is put back around each
job: the environment, the root logger's level and handlers, the SIGTERM/SIGINT handlers, the model families
LM_FAMILIES registered, and torch.compile's caches. The groups a job's device meshes ask for are those earlier
jobs made, where there are such (`_GroupReuse`), and all share one gloo device (`_share_gloo_device`).

A job that fails on a rank, or does not answer in time, takes its pool down: a rank that raised may leave the
others waiting in a collective that never completes, so the pool is killed and the next job starts a fresh one.
The failure is raised in the test with every failed rank's traceback and output. A rank's output goes to files in
the pool's folder, so that the output of a rank that died (an abort in C++ code, and the Python stacks
faulthandler writes then) reaches the test too.

The launchers' own behaviour (rendezvous, restarts, signals, a rank killed with SIGKILL) stays on real torchrun.
Set LM_TESTS_TORCHRUN=1 to send every `train()` of the tests to torchrun again, to compare.
"""

import atexit
import ctypes
import datetime
import faulthandler
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 180
"""How long a pool may take to start: every rank imports torch and lm, on a busy 2-core machine."""
JOB_TIMEOUT_S = 600
"""How long a job may run; the torchrun it replaces had the same limit."""
GRACE_S = 30
"""Once one rank has failed, how long the others have to answer before the pool is killed."""
GROUP_TIMEOUT_S = 900
"""The gloo group's own timeout: longer than a job's, so that the pool's timeout is the one that acts."""
LAUNCHER_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS")
"""What torchrun sets for its ranks: a job's environment takes these from its pool, never from the test."""


class WorkerError(AssertionError):
    """A job failed on some rank, or the pool did not answer in time (the pool is gone then)."""


def torchrun_forced() -> bool:
    """Whether LM_TESTS_TORCHRUN=1 asks for the tests' runs on torchrun, as before the pools."""
    return os.environ.get("LM_TESTS_TORCHRUN", "0") == "1"


class Pool:
    """`world_size` worker processes joined in one gloo group (none for one process), started at once."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        self.output_dir = Path(tempfile.mkdtemp(prefix=f"lm-pool-{world_size}-"))
        self.conns: list[Connection] = []
        self.procs = []
        self.jobs: list[str] = []
        """The tests (or functions) whose jobs the pool ran: a rank that dies may owe it to what an earlier one left"""
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            # not daemonic: a daemonic process may start no children, and a job may (a compiler, DeepSpeed's build)
            proc = ctx.Process(target=_serve, args=(rank, world_size, port, child, self.output_dir),
                               name=f"lm-worker-{world_size}.{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        replies = self._collect(time.monotonic() + START_TIMEOUT_S, GRACE_S)
        if any(r["error"] for r in replies):
            self.kill()
            raise WorkerError(f"a pool of {world_size} did not start:\n" + _report(replies))

    def run(self, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None,
            timeout_s: float = JOB_TIMEOUT_S, grace_s: float = GRACE_S) -> list[dict]:
        """Call `fn(*args)` in every rank with `env` as the environment (the launcher's keys the pool's own); one
        reply per rank: its "value", "stdout" and "stderr". Raises WorkerError, the pool killed, when a rank
        raises, dies or does not answer within `timeout_s` (`grace_s` once another rank has failed)."""
        job_env = {k: v for k, v in (os.environ if env is None else env).items() if k not in LAUNCHER_KEYS}
        for conn in self.conns:
            conn.send((fn, args, job_env))
        job = os.environ.get("PYTEST_CURRENT_TEST", getattr(fn, "__name__", str(fn))).split(" (")[0]
        if self.jobs[-1:] != [job]:
            self.jobs.append(job)
        replies = self._collect(time.monotonic() + timeout_s, grace_s)
        if any(r["error"] for r in replies):
            self.kill()
            raise WorkerError(f"{getattr(fn, '__name__', fn)} failed on a pool of {self.world_size}:\n"
                              + _report(replies, self.jobs))
        return replies

    def _collect(self, deadline: float, grace_s: float) -> list[dict]:
        """One reply per rank; a rank that died or did not answer by the deadline gets one that says so, with
        the output its job wrote so far."""
        replies: list[dict] = [{}] * self.world_size
        waiting = dict(zip(self.conns, range(self.world_size)))
        while waiting:
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    replies[rank] = conn.recv()
                except (EOFError, OSError):
                    self.procs[rank].join(timeout=5)
                    replies[rank] = {"rank": rank, "error": f"rank {rank} died (exit code "
                                     f"{self.procs[rank].exitcode}) without a reply",
                                     **_read_output(self.output_dir, rank)}
                if replies[rank]["error"]:
                    deadline = min(deadline, time.monotonic() + grace_s)
        for rank in waiting.values():
            replies[rank] = {"rank": rank, "error": f"rank {rank} did not answer in time",
                             **_read_output(self.output_dir, rank)}  # what it wrote before it hung
        return replies

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        """Ask the workers to end; kill any that do not within a few seconds."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=5)
        self.kill()

    def kill(self) -> None:
        """End every worker at once (one may be stuck in a collective that never completes)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.output_dir, ignore_errors=True)
        if _pools.get(self.world_size) is self:
            del _pools[self.world_size]


_pools: dict[int, Pool] = {}


def pool(world_size: int) -> Pool:
    """This session's pool of `world_size` ranks, started on first use or after a failed job killed it."""
    current = _pools.get(world_size)
    if current is None or not current.alive:
        if current is not None:
            current.kill()
        current = _pools[world_size] = Pool(world_size)
    return current


def close_pools() -> None:
    """End every pool (the session fixture's teardown, and at exit)."""
    for p in list(_pools.values()):
        p.close()


atexit.register(close_pools)


def train_in_pool(nproc: int, args: list[str], env: dict[str, str]) -> str:
    """`python -m lm.train ARGS` on a pool of `nproc` ranks with the environment `env`; rank 0's stdout, what
    torchrun printed of the run. Raises WorkerError with the failed ranks' output when a rank exits non-zero."""
    return pool(nproc).run(run_train, args, env=env)[0]["stdout"]


def run_train(args: list[str]) -> int:
    """What `python -m lm.train ARGS` runs in a rank; a non-zero exit (2 for bad input, its error line on
    stderr) is raised, so that the job fails."""
    from lm.cli import run
    from lm.train import main

    code = run(main, args)
    if code != 0:
        raise RuntimeError(f"lm.train exited {code}")
    return code


def _report(replies: list[dict], jobs: Sequence[str] = ()) -> str:
    """The failed ranks' errors and output: those that raised first, then those that died or did not answer,
    and then, if one did, the tests whose jobs the pool ran."""
    failed = [(rank, r) for rank, r in enumerate(replies) if r["error"]]
    failed.sort(key=lambda item: not item[1]["error"].startswith("Traceback"))
    report = "\n".join(f"--- rank {rank}: {r['error']}\n--- stdout:\n{r['stdout']}\n--- stderr:\n{r['stderr']}"
                       for rank, r in failed)
    if jobs and not failed[-1][1]["error"].startswith("Traceback"):
        report += "\n--- the tests whose jobs this pool ran, this one last:\n" + "\n".join(jobs)
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world_size: int, port: int, conn: Connection, output_dir: Path) -> None:
    """A worker's life: join the group, then run jobs until told to stop (None) or the pool is killed."""
    faulthandler.enable(all_threads=True)  # on a fatal signal, every thread's Python stack to fd 2: the job's file
    # before torch is imported: one thread per rank, as the torchrun of the tests had
    os.environ["OMP_NUM_THREADS"] = "1"
    if world_size > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0")
    try:
        import torch.distributed as dist

        import lm.train  # noqa: F401  the tool and what it imports, once
        import lm.training.job  # noqa: F401
        from lm.cli import setup_logging

        setup_logging()
        _settle_heap()
        if world_size > 1:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
            groups = _GroupReuse()
            _share_gloo_device()
        conn.send({"rank": rank, "error": None, "stdout": "", "stderr": ""})
    except BaseException:
        conn.send({"rank": rank, "error": traceback.format_exc(), "stdout": "", "stderr": ""})
        os._exit(1)
    launcher_env = {k: v for k, v in os.environ.items() if k in LAUNCHER_KEYS}
    while True:
        try:
            job = conn.recv()
        except (EOFError, KeyboardInterrupt):
            break
        if job is None:
            break
        fn, args, env = job
        if world_size > 1:
            groups.new_job()
        conn.send(_run_job(rank, fn, args, {**env, **launcher_env}, output_dir))
    # as lm's tools end: gloo's threads may still hold the last tensors, and an interpreter teardown can abort
    sys.stdout.flush()
    os._exit(0)


def _run_job(rank: int, fn: Callable[..., Any], args: tuple, env: dict[str, str], output_dir: Path) -> dict:
    """Run one job with its environment and output files, and put back what it changed of the process."""
    import torch
    import torch.distributed as dist

    from lm.models import registry

    grouped = dist.is_initialized()
    # DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear with an autograd function of its own for the rest of
    # the process; under torch 2.11 a compiled tp=2 job after it failed to trace that function over DTensors
    saved_linear = torch.nn.functional.linear
    saved_env = dict(os.environ)
    root = logging.getLogger()
    saved_logging = (root.level, list(root.handlers))
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    saved_families = (dict(registry._registered), registry._plugins_loaded)
    saved_modules = set(sys.modules)
    os.environ.clear()
    os.environ.update(env)
    root.setLevel(logging.INFO)  # init_distributed lowers it on ranks other than 0, per job
    reply: dict[str, Any] = {"rank": rank, "value": None, "error": None}
    out_path, err_path = _output_paths(output_dir, rank)
    with open(out_path, "w+b") as out, open(err_path, "w+b") as err:
        held = _redirect(out, err)
        try:
            reply["value"] = fn(*args)
            if grouped and not dist.is_initialized():
                raise RuntimeError("the job destroyed the pool's process group, which later jobs need")
        except BaseException:
            reply["error"] = traceback.format_exc()
        finally:
            _restore(held)
            torch.nn.functional.linear = saved_linear
            os.environ.clear()
            os.environ.update(saved_env)
            root.setLevel(saved_logging[0])
            root.handlers[:] = saved_logging[1]
            for signum, handler in saved_signals.items():
                signal.signal(signum, handler)
            # a family module LM_FAMILIES named registers itself when imported: forget both, so the next job
            # imports it again if it names it too
            registry._registered.clear()
            registry._registered.update(saved_families[0])
            registry._plugins_loaded = saved_families[1]
            for name in set(sys.modules) - saved_modules:
                if name in {m.strip() for m in env.get("LM_FAMILIES", "").split(",")}:
                    del sys.modules[name]
            if "torch._dynamo" in sys.modules:
                sys.modules["torch._dynamo"].reset()
            _settle_heap()
    return {**reply, **_read_output(output_dir, rank)}


def _output_paths(output_dir: Path, rank: int) -> tuple[Path, Path]:
    """Where a rank's job writes its stdout and stderr; each job starts them empty."""
    return output_dir / f"rank{rank}.out", output_dir / f"rank{rank}.err"


def _read_output(output_dir: Path, rank: int) -> dict[str, str]:
    """The "stdout" and "stderr" of the rank's last job, as far as they were written."""
    paths = _output_paths(output_dir, rank)
    return {key: path.read_bytes().decode(errors="replace") if path.exists() else ""
            for key, path in zip(("stdout", "stderr"), paths)}


def _settle_heap() -> None:
    """Between jobs: collect the last job's garbage, then freeze what survives (the modules it imported, torch's
    caches) so that later collections skip it, and hand the freed heap back to the system.
    - Freezing: a full collection walks every tracked object, and a worker holding torch, DeepSpeed and inductor
      has about a million; without it, tests/distributed took a third more CPU.
    - Trimming: a job's tensors are freed, but glibc keeps the pages, and a worker that outlives many jobs held
      1.8 GB where it needs a few hundred MB (two pytest-xdist workers' pools at once)."""
    gc.collect()
    gc.freeze()
    ctypes.CDLL(None).malloc_trim(0)


class _GroupReuse:
    """Hand a job the groups earlier jobs created, instead of new ones. A job's device mesh creates several
    groups, and each one lives on with its connections to the other ranks and its two worker threads: torch's
    mesh and DTensor caches and DeepSpeed's groups hold on to them across jobs, so destroying them is no way out.
    Before groups were reused and shared one gloo device (`_share_gloo_device`), a 4-rank worker ended the
    session with 73 event-loop threads, which cost the pools more CPU waking up than training.

    The k-th request of a job for a group of given ranks and options gets the k-th group made for that request
    in any job: distinct within a job, as new_group promises, and the same on every rank, since every rank
    makes the same requests in the same order. A group a job destroyed cannot be made again (its members would
    wait in new_group for ranks outside it, which reuse theirs): asking for it fails the job, and with it the
    pool."""

    def __init__(self) -> None:
        from torch.distributed import distributed_c10d

        self.c10d = distributed_c10d
        self.make = distributed_c10d._new_group_with_tag
        self.made: dict[tuple, list] = {}
        self.taken: dict[tuple, int] = {}
        distributed_c10d._new_group_with_tag = self

    def new_job(self) -> None:
        self.taken.clear()

    def __call__(self, ranks=None, timeout=None, backend=None, backend_options=None, pg_tag=None, **kwargs):
        if backend_options is not None or pg_tag is not None:  # options objects have no value to compare
            return self.make(ranks, timeout, backend, backend_options, pg_tag, **kwargs)
        key = (None if ranks is None else tuple(ranks), timeout, backend, tuple(sorted(kwargs.items(), key=str)))
        k = self.taken[key] = self.taken.get(key, -1) + 1
        groups = self.made.setdefault(key, [])
        if k == len(groups):
            groups.append(self.make(ranks, timeout, backend, backend_options, pg_tag, **kwargs))
        elif groups[k] is not self.c10d.GroupMember.NON_GROUP_MEMBER and groups[k] not in self.c10d._world.pg_map:
            raise RuntimeError(f"an earlier job destroyed the group of ranks {ranks}, which the pool reuses")
        return groups[k]


def _share_gloo_device() -> None:
    """Give every group the worker makes from here on one gloo device, whose event loop serves all their
    connections. By default each group gets a device of its own, with a thread that wakes every 10 ms (gloo's
    epoll timeout) for as long as the group lives: a 4-rank worker kept 13 of them."""
    from torch.distributed import distributed_c10d

    gloo = distributed_c10d.ProcessGroupGloo
    device = gloo.create_default_device()

    class SharedDeviceGloo(gloo):
        def __init__(self, store, rank, size, timeout):  # how torch's new_group makes a gloo group
            options = gloo._Options()
            options._devices = [device]
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    distributed_c10d.ProcessGroupGloo = SharedDeviceGloo


def _redirect(out, err) -> list[tuple[int, int]]:
    """Send file descriptors 1 and 2 (prints, logging, C code) to `out` and `err`; what `_restore` needs."""
    held = []
    for stream, fd, target in ((sys.stdout, 1, out), (sys.stderr, 2, err)):
        stream.flush()
        held.append((fd, os.dup(fd)))
        os.dup2(target.fileno(), fd)
    return held


def _restore(held: list[tuple[int, int]]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, original in held:
        os.dup2(original, fd)
        os.close(original)


def job_env(**extra: str) -> dict[str, str]:
    """The environment the tests' runs get: the test's own (LM_FAMILIES, LM_FAULT_*), one thread per rank, and
    DeepSpeed's op builds kept in the checkout so reruns are warm."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(".cache/torch_extensions").resolve()))
    return env
