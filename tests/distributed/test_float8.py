"""train.float8 on the CPU: the refusals, which layers convert, and torchao's float8 layers emulated (float8 matmuls
computed in the input's dtype), whose checkpoints are a plain run's. The real kernels: tests/gpu/test_float8.py."""

import dataclasses
import functools
import importlib.util

import pytest
import torch
import torch.nn as nn

import lm.distributed.float8 as float8
from lm.config import TrainConfig, load_config
from lm.distributed.env import DistEnv
from lm.errors import ConfigError
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from lm.models.registry import family_of, get_family
from lm.training.setup import build_run_engine
from lm.training.step import train_step

GPT_FAMILY = get_family("gpt")
CUDA = torch.device("cuda", 0)


def meta_gpt(**overrides: object) -> GPT:
    fields = dict(vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=32, mlp="swiglu", d_ff=64)
    fields.update(overrides)
    with torch.device("meta"):
        return GPT(GPTConfig(**fields))


def test_float8_is_refused_on_a_cpu_on_gpus_before_ada_and_without_torchao(monkeypatch):
    float8.check_float8("off", torch.device("cpu"))  # off: nothing to check
    with pytest.raises(ConfigError, match=r"^train.float8=tensorwise needs a CUDA GPU of compute capability 8.9 or "
                                          r"later \(Ada, Hopper\); this run's device is cpu$"):
        float8.check_float8("tensorwise", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"8.9 or later \(Ada, Hopper\); this run's GPU, NVIDIA A100-SXM4-80GB, "
                                          r"has 8.0$"):
        float8.check_float8("rowwise", CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torchao" else found(name))
    with pytest.raises(ConfigError, match=r"torchao, which is not installed: pip install 'lm\[float8\]'"):
        float8.check_float8("tensorwise", CUDA)


def test_the_family_chooses_the_block_matrices_of_a_gpt():
    model = meta_gpt(n_experts=16, experts_per_token=2, n_shared_experts=1, d_ff=48)
    per_block = ["attn.q", "attn.k", "attn.v", "attn.proj", "mlp.shared.gate", "mlp.shared.fc", "mlp.shared.proj"]
    # the head, the routers (by name: 32 x 16 would fit) and the stacked routed experts (no nn.Linear) stay
    assert float8.float8_layers(model, GPT_FAMILY.float8_linears) == [f"blocks.{i}.{name}" for i in range(2)
                                                                      for name in per_block]
    assert float8.float8_layers(meta_gpt(d_ff=40), GPT_FAMILY.float8_linears) == [
        f"blocks.{i}.attn.{name}" for i in range(2) for name in ("q", "k", "v", "proj")]  # 40 hidden units: no MLP


@pytest.mark.slow  # importing torchao takes 3 to 4 s
@pytest.mark.parametrize("mode, fsdp", [("tensorwise", True), ("rowwise", False)])
def test_conversion_swaps_exactly_the_chosen_layers_and_keeps_the_weights(mode, fsdp):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    reference = GPT(GPTConfig(vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=32, mlp="swiglu", d_ff=64))
    model = meta_gpt()
    before = {name: (t.shape, t.dtype) for name, t in model.state_dict().items()}
    config = float8.float8_config(mode, fsdp, emulate=True)
    converted = float8.convert_float8(model, GPT_FAMILY.float8_linears, config)
    assert converted == [f"blocks.{i}.{name}" for i in range(2)
                         for name in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.gate", "mlp.fc", "mlp.proj")]
    assert {name for name, m in model.named_modules() if isinstance(m, Float8Linear)} == set(converted)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.wte.weight  # tied, untouched
    assert {name: (t.shape, t.dtype) for name, t in model.state_dict().items()} == before
    # drawn after the swap, the weights are a plain model's: the same init, in the same order
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name
    idx = torch.randint(0, 100, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, plain = model.logits(model(idx)), reference.logits(reference(idx))
    torch.testing.assert_close(logits.float(), plain.float(), rtol=0, atol=0.15)  # float8 rounding, no more


@pytest.mark.slow
def test_an_fsdp_float8_run_resumes_without_float8_and_back(monkeypatch, tmp_path):
    # emulated float8 on the CPU, through the engine's own path: FSDP2's float8 all-gather and the scales it
    # precomputes after each optimizer step
    monkeypatch.setattr(float8, "check_float8", lambda mode, device: None)
    monkeypatch.setattr(float8, "float8_config", functools.partial(float8.float8_config, emulate=True))
    cfg = load_config(None, ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.block_size=32",
                             "--data.seq_len=16", "--train.device=cpu", "--train.batch_size=2",
                             "--train.micro_batch_size=2", "--parallel.engine=fsdp", "--train.float8=tensorwise"])
    plain_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, float8="off"))
    family = family_of(cfg.model)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    fp8, plain = build_run_engine(cfg, family, env), build_run_engine(plain_cfg, family, env)
    assert type(fp8.model.blocks[0].attn.q).__name__ == "Float8Linear"
    assert type(fp8.model.blocks[0].attn.q.weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
    x = torch.randint(0, cfg.model.vocab_size, (2, 17))
    batch = [[x[:, :-1], x[:, 1:]]]
    loss = functools.partial(family.training.loss, optim=cfg.optim)

    def step(engine) -> float:
        return train_step(engine, loss, batch, 1e-3, 1.0).terms["loss"].value.item()

    def weights(engine) -> dict[str, torch.Tensor]:
        return {name: t.full_tensor() for name, t in engine.model.state_dict().items()}

    assert step(fp8) == pytest.approx(step(plain), abs=1e-3)  # the same weights at step 0
    fp8.save(tmp_path / "float8")
    plain.load(tmp_path / "float8")
    saved = weights(fp8)
    assert {name: t.dtype for name, t in weights(plain).items()} == {name: t.dtype for name, t in saved.items()}
    assert all(torch.equal(saved[name], t) for name, t in weights(plain).items())
    step(plain)
    plain.save(tmp_path / "plain")
    fp8.load(tmp_path / "plain")
    assert all(torch.equal(weights(plain)[name], t) for name, t in weights(fp8).items())
    assert step(fp8) == pytest.approx(step(plain), abs=1e-2)


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_float8_is_accepted_from_ada_on(monkeypatch, capability):
    # Ada (8.9), the first float8 GPU, is the boundary
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "torchao" else found(name))
    for mode in ("tensorwise", "rowwise"):
        float8.check_float8(mode, CUDA)  # no error


def test_a_model_without_a_linear_layer_to_convert_is_refused(monkeypatch):
    # without the refusal an LSTM "trained in float8" converts nothing, without a word
    monkeypatch.setattr(float8, "check_float8", lambda mode, device: None)
    cfg = load_config(None, ["--model.arch=lstm", "--model.n_layer=1", "--model.d_model=32", "--model.block_size=16",
                             "--data.seq_len=16"])
    cfg.train.float8 = "tensorwise"
    family = family_of(cfg.model)
    model = family.build_meta(cfg.model)
    assert float8.float8_layers(model, family.float8_linears) == []
    with pytest.raises(ConfigError, match=r"train.float8=tensorwise: .* has no linear layer to train in float8"):
        float8.apply_float8(model, family, cfg.train, True, CUDA, True)


@pytest.mark.slow  # importing torchao takes 3 to 4 s
@pytest.mark.parametrize("fsdp", [True, False])
def test_the_recipes_scale_as_named_under_every_engine(fsdp):
    # rowwise under fsdp must not become tensorwise (the conversion test tries rowwise without fsdp only)
    from torchao.float8.config import ScalingGranularity

    rowwise = float8.float8_config("rowwise", fsdp, emulate=True)
    for cast in (rowwise.cast_config_input, rowwise.cast_config_weight, rowwise.cast_config_grad_output):
        assert cast.scaling_granularity is ScalingGranularity.AXISWISE
    assert rowwise.enable_fsdp_float8_all_gather is False and rowwise.emulate is True
    tensorwise = float8.float8_config("tensorwise", fsdp, emulate=True)
    assert tensorwise.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE
    assert tensorwise.enable_fsdp_float8_all_gather is fsdp


def test_only_tensorwise_weights_are_all_gathered_in_float8_and_only_under_fsdp():
    # torchao has no float8 all-gather for rowwise scales: their scales must not be precomputed after each step
    assert float8.all_gathers_float8(TrainConfig(float8="tensorwise"), fsdp=True) is True
    assert float8.all_gathers_float8(TrainConfig(float8="tensorwise"), fsdp=False) is False
    assert float8.all_gathers_float8(TrainConfig(float8="rowwise"), fsdp=True) is False
    assert float8.all_gathers_float8(TrainConfig(float8="off"), fsdp=True) is False


def test_applying_float8_refuses_a_cpu_itself():
    # tools that build an engine themselves skip the launch check: apply_float8 must refuse too, before converting
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=100, block_size=32, n_layer=1, n_head=2, d_model=32))
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU of compute capability 8.9 or later .* device is cpu$"):
        float8.apply_float8(model, get_family("gpt"), TrainConfig(float8="tensorwise"), True, torch.device("cpu"), True)
    assert type(model.blocks[0].attn.q) is torch.nn.Linear  # nothing converted
