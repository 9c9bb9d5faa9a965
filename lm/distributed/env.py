"""Rank, world size, device and process group: the one place that reads torchrun's environment, and the
process settings a device wants (`tune_cpu`)."""

import ctypes
import ctypes.util
import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lm.config.rules import resolve_device

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    tp: int = 1
    """Tensor-parallel ranks: consecutive ranks form one tensor-parallel group (`lm.distributed.layout`)."""
    pp: int = 1
    """Pipeline-parallel ranks: the outermost dimension of the layout, world size / pp ranks per stage."""
    cp: int = 1
    """Context-parallel ranks: cp consecutive ranks (after tp) share each window's tokens."""
    dp_replicate: int = 1
    """HSDP groups among the data-parallel ranks: each shards the model, the groups replicate it."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel replicas: the ranks of one tensor-parallel or context-parallel
        group, and the stages of one pipeline, read the same batches."""
        return (self.rank // (self.tp * self.cp)) % self.dp_size

    @property
    def dp_size(self) -> int:
        """How many different batches the world reads at once: world size / (tp x cp x pp)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group: which slices of each window it holds."""
        return (self.rank // self.tp) % self.cp

    @property
    def pp_rank(self) -> int:
        """Which pipeline rank this is (0 holds the first stage)."""
        return self.rank // (self.tp * self.cp * self.dp_size)

    @property
    def is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a tensor over ranks (in place); a no-op on one process."""
        if self.is_distributed:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            value /= self.world_size
        return value

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank: a collective, so every rank reaches the same decision."""
        value = torch.tensor(float(flag), device=self.device)
        if self.is_distributed:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def broadcast_object(self, obj: object) -> object:
        """Rank 0's value of `obj` on every rank, so all ranks take the same decision."""
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's value of `obj`, in rank order (`[obj]` on one process)."""
        if not self.is_distributed:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def close(self) -> None:
        if self.is_distributed:
            dist.destroy_process_group()


def tune_cpu() -> None:
    """Flush denormals and keep freed memory in the heap; no effect on results.

    Denormal weights and gradients make CPU matmuls 10-20x slower after a few AdamW steps. And glibc
    serves every allocation over 32 MiB (logits over a 50k vocabulary are hundreds of MiB) with a fresh
    mmap that it unmaps on free, so every step page-faults and zeroes those tensors again: measured
    here as a third of a small GPT's step time. Serving them from the heap, and never trimming it,
    lets the next step reuse the same pages.
    """
    torch.set_flush_denormal(True)
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):  # not glibc (musl, macOS): keep the allocator's defaults
        return
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**30 - 1)):
        log.warning("could not tune the C allocator; CPU steps may be slower")


def init_device(requested: str, key: str, index: int = 0) -> torch.device:
    """The device a process runs on (`lm.config.rules.resolve_device`), made current and tuned: the one
    device setup of the trainer's ranks and of every one-process tool. `key` names the setting in errors."""
    device = resolve_device(requested, key, index)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        tune_cpu()
    return device


def launched_world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def group_backend(device: torch.device, cpu_offload: bool = False) -> str:
    """The process group's backend: gloo on a CPU, NCCL on CUDA, and beside it gloo for the collectives on host
    tensors that CPU offload makes (FSDP2's offloaded gradients are host DTensors: their norm is all-reduced where
    they are, and a group of NCCL alone has no backend for the CPU)."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def init_distributed(device: str = "auto", timeout_s: int = 1800, tp: int = 1, pp: int = 1, cp: int = 1,
                     dp_replicate: int = 1, cpu_offload: bool = False) -> DistEnv:
    """Join the process group torchrun describes (`group_backend`), or run alone; `tp`, `pp` and `cp` are the
    layout's tensor-, pipeline- and context-parallel sizes and `dp_replicate` its HSDP groups
    (`lm.distributed.layout.check_world` checked that they divide the world).

    Started without torchrun (no WORLD_SIZE in the environment), this is a one-process run and no
    process group is created, so `python -m lm.train` works on a laptop without any launcher.
    """
    world_size = launched_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = init_device(device, "train.device", local_rank)
    if rank != 0:  # one log for the whole run: other ranks report only warnings and errors
        logging.getLogger().setLevel(logging.WARNING)
    if world_size > 1 and not dist.is_initialized():
        backend = group_backend(dev, cpu_offload)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = {}
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if restart != "0":
            # After torchrun restarts a failed group, the rendezvous store still holds the dead
            # processes' addresses under the same keys, and the new group would try to connect to them
            # (pytorch/pytorch#167288). Keys of their own per attempt avoid that.
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                   is_master=False, timeout=timeout)
            store = {"store": dist.PrefixStore(f"lm/attempt{restart}", client), "rank": rank, "world_size": world_size}
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
            **store,
        )
        log.info("joined process group: rank %d/%d, backend %s", rank, world_size, backend)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=dev, tp=tp, pp=pp, cp=cp,
                   dp_replicate=dp_replicate)


def background_group(env: DistEnv) -> dist.ProcessGroup | None:
    """A new gloo group of every rank, for the collectives of a background thread (an asynchronous checkpoint's
    write): on the default group they would interleave with the training thread's, and DCP's collectives need a
    CPU backend under NCCL too. None without a process group. A collective: every rank creates it at the same
    point of the run."""
    return dist.new_group(backend="gloo") if env.is_distributed else None


def ensure_process_group(env: DistEnv, cpu_offload: bool = False) -> None:
    """Give a one-process run a process group of its own (in memory, no ports): FSDP2 and DeepSpeed shard
    over a group even when it has one rank. Under torchrun the group already exists."""
    if not dist.is_initialized():
        backend = group_backend(env.device, cpu_offload)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=env.device if env.device.type == "cuda" else None)
