"""The LSTM baseline through the same tools as the GPT: trainer, resume, sample, eval, consolidate."""

import math
import shutil

import pytest
import torch

from lm import eval as eval_tool, sample
from lm.checkpoint import load_for_inference, load_model_weights
from lm.cli import run
from lm.config import ConfigError
from lm.consolidate import consolidate, tied_names
from lm.distributed import init_distributed
from lm.models.config import ModelConfig
from lm.models.lstm import LSTMLM
from lm.train.metrics import flops_per_token
from lm.train.trainer import Trainer

from tests.train.test_trainer import train_losses, tiny_config as gpt_config


def tiny_config(data_dir, out_dir, *extra):
    """The trainer tests' tiny run, as an LSTM."""
    return gpt_config(data_dir, out_dir, "--model.arch=lstm", *extra)


@pytest.fixture(scope="module")
def lstm_run(tiny_data_dir, tmp_path_factory):
    """An LSTM trained 30 steps on tiny_data_dir; returns (run directory, history, trainer's FLOPs per token)."""
    out = tmp_path_factory.mktemp("lstm") / "run"
    cfg = tiny_config(tiny_data_dir, out, "--train.steps=30", "--train.batch_size=8", "--optim.lr=1e-2",
                      "--train.eval_every=15", "--checkpoint.every=15")
    trainer = Trainer(cfg, init_distributed("cpu"))
    return out, trainer.fit(), trainer.flops_per_token


def test_the_trainer_trains_an_lstm(lstm_run):
    _, history, _ = lstm_run
    losses = list(train_losses(history).values())
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5  # ~10.8 (uniform over 50k ids) falls to ~8
    val = [row["val/loss"] for row in history if "val/loss" in row]
    assert len(val) == 2 and val[1] < val[0]


def test_flops_per_token_of_an_lstm_is_six_per_parameter(lstm_run):
    cfg = ModelConfig(arch="lstm", vocab_size=50257, n_layer=2, d_model=32)
    n = LSTMLM(cfg).num_params()
    assert flops_per_token(cfg, n, 16) == flops_per_token(cfg, n, 1024) == 6 * n  # no attention term
    gpt = ModelConfig(vocab_size=50257, n_layer=2, n_head=2, d_model=32)
    assert flops_per_token(gpt, n, 16) == 6 * n + 12 * 2 * 32 * 16
    assert lstm_run[2] == 6 * n  # what the trainer reports MFU with


def test_resume_continues_bit_for_bit(tiny_data_dir, tmp_path):
    env = init_distributed("cpu")
    full = Trainer(tiny_config(tiny_data_dir, tmp_path / "full", "--train.steps=6"), env).fit()
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    resumed_dir.mkdir(parents=True)
    shutil.copytree(tmp_path / "full/checkpoints/step_00000003", resumed_dir / "step_00000003")
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "resumed", "--train.steps=6"), env)
    assert trainer.step == 3
    resumed = trainer.fit()
    assert sorted(train_losses(resumed)) == [4, 5, 6]
    for step, loss in train_losses(resumed).items():
        assert loss == train_losses(full)[step]
    cfg = tiny_config(tiny_data_dir, tmp_path / "x").model
    a, b = LSTMLM(cfg), LSTMLM(cfg)
    load_model_weights(tmp_path / "full/checkpoints/step_00000006", a)
    load_model_weights(tmp_path / "resumed/checkpoints/step_00000006", b)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_resuming_an_lstm_checkpoint_as_a_gpt_is_refused(lstm_run, tiny_data_dir, tmp_path):
    out, _, _ = lstm_run
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "checkpoints/step_00000030", tmp_path / "run/checkpoints/step_00000030")
    gpt = gpt_config(tiny_data_dir, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"checkpoint is an LSTM \(model.arch=lstm\) but the config asks for a "
                                          r"decoder-only GPT \(model.arch=gpt\)"):
        Trainer(gpt, init_distributed("cpu"))


def test_sample_eval_and_consolidate_read_an_lstm_checkpoint(lstm_run, tmp_path, capsys):
    out, _, _ = lstm_run
    flags = ["--max-new-tokens", "5", "--prompt", "KING:", "--seed", "1"]
    assert run(sample.main, ["--checkpoint", str(out), *flags]) == 0
    text = capsys.readouterr().out
    assert text.startswith("KING:") and len(text) > len("KING:\n")
    assert run(eval_tool.main, ["--checkpoint", str(out), "--max-tokens", "100"]) == 0
    printed = capsys.readouterr().out
    assert "window 16, stride 8" in printed and "tokens scored: 99" in printed

    merged = tmp_path / "lstm.safetensors"
    consolidate(out, merged)
    from_checkpoint, cfg, _ = load_for_inference(out, torch.device("cpu"))
    from_file, _, _ = load_for_inference(merged, torch.device("cpu"))
    assert isinstance(from_file, LSTMLM) and tied_names(from_file) == {"lm_head.weight": "wte.weight"}
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(from_file(idx)[0], from_checkpoint(idx)[0])
    # the consolidated file samples the same text as the checkpoint it came from
    assert run(sample.main, ["--checkpoint", str(merged), *flags]) == 0
    assert capsys.readouterr().out == text


def test_bf16_autocast_on_the_cpu_trains_or_is_refused_before_anything_is_written(tiny_data_dir, tmp_path):
    # Whether oneDNN runs a bf16 LSTM depends on the CPU; the engine's answer must be the kernel's own.
    cfg = tiny_config(tiny_data_dir, tmp_path / "run", "--train.dtype=bfloat16", "--train.steps=1")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            LSTMLM(cfg.model)(torch.zeros(1, 4, dtype=torch.long))
        kernel_runs = True
    except RuntimeError:
        kernel_runs = False
    if kernel_runs:
        losses = train_losses(Trainer(cfg, init_distributed("cpu")).fit())
        assert list(losses) == [1] and math.isfinite(losses[1])
    else:
        with pytest.raises(ConfigError, match=r"train.dtype: bfloat16 autocasts model.arch=lstm to bf16, which "
                                              r"this CPU's LSTM kernel \(oneDNN\) cannot run"):
            Trainer(cfg, init_distributed("cpu"))
        assert not (tmp_path / "run").exists()
