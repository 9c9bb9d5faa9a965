"""checkpoint.init_from: a new run starts from consolidated weights, on any engine."""

import pytest
import torch
import torch.distributed as dist

from lm.checkpoint.consolidated import consolidate
from lm.checkpoint.loading import load_for_inference
from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.errors import ConfigError
from lm.training.trainer import Trainer

TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32",
        "--data.seq_len=16", "--train.batch_size=4", "--train.micro_batch_size=2", "--train.device=cpu",
        "--log.tensorboard=false", "--train.steps=2", "--log.sample_tokens=4"]


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_new_run_starts_from_the_consolidated_weights(engine, trained_run, tiny_data_dir, tmp_path):
    weights = tmp_path / "trained.safetensors"
    consolidate(trained_run, weights)
    source, _, _ = load_for_inference(weights, torch.device("cpu"))
    cfg = load_config(None, [*TINY, f"--data.dir={tiny_data_dir}", f"--train.out_dir={tmp_path / 'run'}",
                             f"--parallel.engine={engine}", f"--checkpoint.init_from={weights}"])
    try:
        trainer = Trainer(cfg, init_distributed("cpu"))
        state = trainer.engine.model.state_dict()
        for name, expected in source.state_dict().items():
            value = state[name].full_tensor() if hasattr(state[name], "full_tensor") else state[name]
            assert torch.equal(value, expected), name
        assert trainer.step == 0  # a new run: optimizer and data position start fresh
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_init_from_a_different_model_is_refused(trained_run, tiny_data_dir, tmp_path):
    weights = tmp_path / "trained.safetensors"
    consolidate(trained_run, weights)
    cfg = load_config(None, [*TINY, "--model.d_model=64", f"--data.dir={tiny_data_dir}",
                             f"--train.out_dir={tmp_path / 'run'}", f"--checkpoint.init_from={weights}"])
    with pytest.raises(ConfigError,
                       match=r"checkpoint.init_from: .* holds a different model \(model.d_model: 32 -> 64\)"):
        Trainer(cfg, init_distributed("cpu"))
    assert not (tmp_path / "run").exists()
