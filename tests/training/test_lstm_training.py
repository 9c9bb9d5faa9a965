"""The LSTM baseline through the same tools as the GPT: trainer, resume, sample, eval, consolidate."""

import functools
import math
import shutil

import pytest
import torch

from lm import eval as eval_tool
from lm import sample
from lm.checkpoint.consolidated import consolidate
from lm.checkpoint.loading import load_for_inference
from lm.checkpoint.model_weights import tied_names
from lm.cli import run
from lm.data.config import DataConfig
from lm.distributed.env import init_distributed
from lm.errors import ConfigError
from lm.models.lstm.config import LSTMConfig
from lm.models.lstm.model import LSTMLM
from lm.plan.counts import flops_per_token
from lm.training.trainer import Trainer
from tests.training.test_trainer import check_resume_is_bit_for_bit, train_losses
from tests.training.test_trainer import tiny_config as gpt_config


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
    cfg = LSTMConfig(vocab_size=50257, n_layer=2, d_model=32)
    n = sum(p.numel() for p in LSTMLM(cfg).parameters())  # the tied head counted once
    assert flops_per_token(cfg, 16, DataConfig()) == flops_per_token(cfg, 1024, DataConfig()) == 6 * n
    assert lstm_run[2] == 6 * n  # what the trainer reports MFU with


def test_resume_continues_bit_for_bit(tiny_data_dir, tmp_path):
    check_resume_is_bit_for_bit(functools.partial(tiny_config, tiny_data_dir), tmp_path, LSTMLM)


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
        assert torch.equal(from_file.logits(from_file(idx)), from_checkpoint.logits(from_checkpoint(idx)))
    # the consolidated file samples the same text as the checkpoint it came from
    assert run(sample.main, ["--checkpoint", str(merged), *flags]) == 0
    assert capsys.readouterr().out == text


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_bf16_on_the_cpu_trains_or_is_refused_before_anything_is_written(tiny_data_dir, tmp_path, engine):
    # Whether oneDNN runs a bf16 LSTM depends on the CPU; every engine's answer must be the kernel's own
    # (ddp autocasts, fsdp casts the parameters: the same kernel).
    cfg = tiny_config(tiny_data_dir, tmp_path / "run", "--train.dtype=bfloat16", "--train.steps=1",
                      f"--parallel.engine={engine}")
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
