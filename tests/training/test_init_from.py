"""checkpoint.init_from: a new run starts from consolidated weights, on any engine."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from lm.checkpoint.consolidated import consolidate
from lm.checkpoint.loading import init_from_loader, load_for_inference
from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.errors import CheckpointError, ConfigError
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


def test_init_from_a_checkpoint_of_another_family_names_both_families(encoder_run, tiny_data_dir, tmp_path):
    weights = tmp_path / "encoder.safetensors"
    consolidate(encoder_run, weights)
    cfg = load_config(None, ["--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32",
                             "--data.seq_len=16", f"--data.dir={tiny_data_dir}", f"--checkpoint.init_from={weights}"])
    with pytest.raises(ConfigError) as error:
        init_from_loader(Path(weights), cfg)
    assert str(error.value).startswith(f"checkpoint.init_from: {weights} is ")
    assert "(model.arch=encoder) but the config asks for " in str(error.value)
    assert str(error.value).endswith("(model.arch=gpt)")


def test_init_from_a_transformers_checkpoint_with_a_missing_tensor_is_refused_before_the_model_is_allocated(tmp_path):
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", vocab_size=50257, n_positions=32, n_embd=16,
                                                               n_layer=1, n_head=2))
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    [dropped] = [name for name in tensors if name.endswith("h.0.mlp.c_fc.weight")]
    del tensors[dropped]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = load_config(None, [f"--checkpoint.init_from={tmp_path}", "--data.seq_len=32"])
    with pytest.raises(CheckpointError, match=f"missing {dropped}"):
        init_from_loader(tmp_path, cfg)
