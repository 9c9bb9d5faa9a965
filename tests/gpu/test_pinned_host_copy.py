"""The asynchronous checkpoint on CUDA: the host copy's pinned buffers, filled by non-blocking copies that `copy`
waits for, and a checkpoint written from them in the background while training goes on (skipped without a CUDA
GPU; the CPU side: tests/distributed/test_host_copy.py, tests/checkpoint/test_store.py)."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lm.bench.training import random_batch
from lm.checkpoint.store import BackgroundSaves, complete_checkpoints
from lm.config import load_config
from lm.distributed.env import DistEnv, init_device
from lm.distributed.host_copy import HostCopy
from lm.models.registry import family_of
from lm.training.setup import build_run_engine
from lm.training.step import train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = ["--model.n_layer=2", "--model.n_head=4", "--model.d_model=128", "--model.block_size=128",
        "--data.seq_len=128", "--train.device=cuda", "--train.dtype=bfloat16", "--train.batch_size=4",
        "--train.micro_batch_size=4"]


def test_a_pinned_copy_holds_the_values_of_its_call_and_the_next_call_refills_it():
    weight = torch.randn(4096, 4096, device="cuda")  # 64 MB: a copy long enough to be caught unfinished
    host = HostCopy(pin_memory=True)
    assert host.allocate({"w": weight, "tied": weight}) == 4096 * 4096 * 4
    first = host.copy({"w": weight, "tied": weight})["w"]
    assert first.is_pinned() and first.device.type == "cpu"
    assert torch.equal(first, weight.cpu())
    expected = weight.cpu()
    weight.mul_(2.0)  # training goes on, on the GPU
    assert torch.equal(first, expected)
    second = host.copy({"w": weight, "tied": weight})["w"]
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, weight.cpu())


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])  # fsdp: DTensors of a CUDA mesh over host buffers
def test_a_background_checkpoint_holds_the_state_of_its_step_while_training_goes_on(engine, tmp_path):
    cfg = load_config(None, [*TINY, f"--parallel.engine={engine}"])
    device = init_device("cuda", "train.device")  # "cuda:0", as the trainer sets it: NCCL needs an index
    try:
        saved_state, trained_on, loaded = background_save(cfg, device, tmp_path / "checkpoints")
    finally:
        if dist.is_initialized():  # the engines' one-process NCCL group
            dist.destroy_process_group()
    assert saved_state.keys() == loaded.keys() and len(saved_state) > 10  # model and AdamW's moments and steps
    assert all(torch.equal(loaded[key], value) for key, value in saved_state.items())
    changed = [key for key, value in saved_state.items() if not torch.equal(trained_on[key], value)]
    assert any(key.startswith("model.") for key in changed)  # the steps after the save moved the weights


def background_save(cfg, device: torch.device, root) -> tuple[dict, dict, dict]:
    """Steps 1-2, a background save of step 2, steps 3-4 while it is written, then the checkpoint loaded by a new
    engine: the state at step 2, the state at step 4 and the state loaded, each flattened to host tensors."""
    family = family_of(cfg.model)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=device)
    built = build_run_engine(cfg, family, env)
    x = random_batch(cfg, 4, device)
    loss = functools.partial(family.training.loss, optim=cfg.optim)

    def step() -> None:
        train_step(built, loss, [[x[:, :-1], x[:, 1:]]], cfg.optim.lr, cfg.optim.grad_clip)

    saves = BackgroundSaves(root, env)
    step()
    saves.allocate(built)
    step()
    saved_state = flat(built._state())
    final = saves.save(2, built, {"step": 2}, cfg, keep=1)
    step()
    step()
    saves.wait()
    assert complete_checkpoints(root) == [final]
    fresh = build_run_engine(cfg, family, env)
    fresh.load(final)
    return saved_state, flat(built._state()), flat(fresh._state())


def flat(value: object, path: tuple = ()) -> dict[str, torch.Tensor]:
    """Every tensor of a state dict by its dotted path, as a host copy of this rank's part (a DTensor's shard)."""
    if isinstance(value, dict | list | tuple):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return {name: tensor for key, item in items for name, tensor in flat(item, (*path, key)).items()}
    if isinstance(value, torch.Tensor):
        local = value.to_local() if isinstance(value, DTensor) else value
        return {".".join(map(str, path)): local.detach().cpu().clone()}
    return {}
