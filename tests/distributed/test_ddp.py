import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from lm.config import load_config
from lm.distributed.ddp import grad_sync, wrap_ddp
from lm.distributed.env import DistEnv, init_distributed
from lm.models.registry import family_of
from lm.training.setup import build_run_engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env = init_distributed("cpu")
    torch.manual_seed(0)
    model = wrap_ddp(nn.Linear(3, 1, bias=False), env)
    x = torch.full((1, 3), float(rank + 1))  # rank 0 sees 1s, rank 1 sees 2s
    with grad_sync(model, sync=False):  # an accumulation micro-step: no all-reduce
        model(x).sum().backward()
    local = model.module.weight.grad.clone()
    with grad_sync(model, sync=True):  # the last micro-step: all-reduce the accumulated sum
        model(x).sum().backward()
    out[rank] = (local, model.module.weight.grad.clone(), env.broadcast_object(f"from {rank}"))
    env.close()
    assert not dist.is_initialized()


@pytest.mark.process
def test_accumulation_skips_all_reduce_until_the_last_micro_step():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
        results = dict(out)
    # micro-step 1 kept each rank's own gradient; after micro-step 2 both hold the mean of the sums
    assert torch.equal(results[0][0], torch.full((1, 3), 1.0))
    assert torch.equal(results[1][0], torch.full((1, 3), 2.0))
    for rank in (0, 1):
        assert torch.equal(results[rank][1], torch.full((1, 3), 3.0))  # ((1 + 1) + (2 + 2)) / 2
        assert results[rank][2] == "from 0"


def test_single_process_is_left_unwrapped():
    env = init_distributed("cpu")
    model = nn.Linear(2, 2)
    assert env.world_size == 1 and wrap_ddp(model, env) is model


@pytest.mark.parametrize("dtype, bf16", [("bfloat16", True), ("float32", False), ("auto", False)])
def test_the_ddp_engine_autocasts_to_bf16_exactly_where_train_dtype_says(dtype, bf16):
    # without the engine's autocast a bf16 run on the CPU trains on in fp32, and every other test passes
    cfg = load_config(None, ["--model.n_layer=1", "--model.n_head=2", "--model.d_model=32", "--model.block_size=16",
                             "--data.seq_len=16", "--train.device=cpu", "--train.batch_size=2",
                             "--train.micro_batch_size=2", f"--train.dtype={dtype}"])
    family = family_of(cfg.model)
    engine = build_run_engine(cfg, family, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    with engine.micro_batch(last=True):
        assert torch.is_autocast_enabled("cpu") is bf16
        if bf16:
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        out = engine.model.blocks[0].attn.q(engine.model.wte(x))  # a linear layer as the forward runs it
    assert out.dtype == (torch.bfloat16 if bf16 else torch.float32)
    # evaluation runs under the same precision
    assert engine.evaluate(lambda model, run: torch.is_autocast_enabled("cpu")) is bf16
