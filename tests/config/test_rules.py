import pytest
import torch

from lm.config import config_diff, device_type, load_config, resolve_device, use_bf16
from lm.config.rules import batch_split_problem
from lm.errors import ConfigError


def test_auto_is_cuda_only_where_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_type("auto") == "cpu" and device_type("cuda") == "cuda" and device_type("cpu") == "cpu"
    assert resolve_device("auto", "train.device") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_type("auto") == "cuda"
    assert resolve_device("auto", "--device", index=1) == torch.device("cuda", 1)


def test_asking_for_a_missing_gpu_is_one_config_error_naming_the_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for key in ("train.device", "--device"):
        with pytest.raises(ConfigError, match=f"^{key}: cuda asked for, but torch sees no CUDA device; use cpu"):
            resolve_device("cuda", key)
    with pytest.raises(ConfigError, match=r"--device: expected auto, cpu or cuda, got 'tpu'"):
        resolve_device("tpu", "--device")


@pytest.mark.parametrize("dtype, device, expected", [
    ("auto", "cuda", True), ("auto", "cpu", False), ("bfloat16", "cpu", True), ("bfloat16", "cuda", True),
    ("float32", "cuda", False), ("float32", "cpu", False),
])
def test_the_bf16_rule(dtype, device, expected):
    assert use_bf16(dtype, device) is expected


def test_config_diff_names_each_changed_key():
    old = load_config(None, []).to_dict()
    new = load_config(None, ["--model.d_model=384", "--model.dropout=0.1", "--optim.lr=1e-3"]).to_dict()
    assert config_diff(old, new) == {"model.d_model": (768, 384), "model.dropout": (0.0, 0.1), "optim.lr": (6e-4, 1e-3)}
    assert config_diff(old, old) == {}
    assert config_diff(old, new, sections=("model",), ignore=("model.dropout",)) == {"model.d_model": (768, 384)}
    assert config_diff(old, new, ignore=("model",)) == {"optim.lr": (6e-4, 1e-3)}
    del old["optim"]["lr"]  # a key an older config lacks compares as None
    assert config_diff(old, new, sections=("optim",)) == {"optim.lr": (None, 1e-3)}


@pytest.mark.parametrize("batch, micro, replicas, problem", [
    (8, 2, 4, None), (8, 2, 1, None), (4, 2, 2, None),
    (4, 2, 4, "train.batch_size: 4 is not a multiple of train.micro_batch_size (2) x 4 data-parallel replica(s) "
              "(world size 4); expected a multiple of 8, or a number of replicas that divides its 2 micro-batches"),
    (6, 2, 2, "train.batch_size: 6 is not a multiple of train.micro_batch_size (2) x 2 data-parallel replica(s) "
              "(world size 4); expected a multiple of 4, or a number of replicas that divides its 3 micro-batches"),
])
def test_the_batch_split_rule(batch, micro, replicas, problem):
    assert batch_split_problem(batch, micro, replicas, "world size 4") == problem
