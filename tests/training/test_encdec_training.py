"""The encoder-decoder through the whole system: trainer, 2-process resume, checkpoints, lm.eval, lm.sample."""

import json
import shutil

import pytest
import torch

from lm import eval as eval_tool
from lm import sample
from lm.checkpoint.model_weights import load_model_weights
from lm.cli import run
from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.errors import ConfigError
from lm.models.encdec.model import EncoderDecoder
from lm.models.registry import family_of
from lm.training.trainer import Trainer
from tests.workers import job_env, train_in_pool

TINY = [
    "--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32",
    "--data.seq_len=16", "--train.batch_size=4", "--train.micro_batch_size=2", "--train.device=cpu",
    "--train.eval_every=3", "--train.eval_batches=2", "--log.every=1", "--log.tensorboard=false",
    "--checkpoint.every=3", "--checkpoint.keep=5", "--optim.lr=3e-3", "--schedule.warmup_steps=2",
    "--log.sample_tokens=4",
]
# windows of 17 tokens: 3 noise tokens in 1 span -> source 15, target 5 (sentinel, 3 tokens, end sentinel)
ENCDEC = ["--model.arch=encdec", "--model.pos=sinusoidal", "--model.n_sentinels=4"]


def losses(out_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def train_two(args: list[str]) -> None:
    """lm.train on this session's 2-rank pool (`tests.workers`)."""
    train_in_pool(2, args, job_env())


@pytest.mark.process
@pytest.mark.parametrize("arch", ["gpt", "encdec"])
def test_two_process_resume_is_bit_exact(arch, tiny_data_dir, tmp_path):
    extra = ENCDEC if arch == "encdec" else []
    common = [*TINY, *extra, f"--data.dir={tiny_data_dir}", "--train.steps=6", "--train.batch_size=8"]
    train_two([*common, f"--train.out_dir={tmp_path / 'full'}"])
    # a second 2-process run that starts from the first run's step-3 checkpoint retraces steps 4..6
    (tmp_path / "resumed/checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full/checkpoints/step_00000003", tmp_path / "resumed/checkpoints/step_00000003")
    train_two([*common, f"--train.out_dir={tmp_path / 'resumed'}"])
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == full[s] for s in resumed)
    cfg = load_config(tmp_path / "full/config.yaml")
    assert cfg.model.arch == arch
    a, b = family_of(cfg.model).build(cfg.model), family_of(cfg.model).build(cfg.model)
    load_model_weights(tmp_path / "full/checkpoints/step_00000006", a)
    load_model_weights(tmp_path / "resumed/checkpoints/step_00000006", b)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


@pytest.fixture(scope="module")
def encdec_run(tiny_data_dir, tmp_path_factory):
    """A tiny encoder-decoder trained for 30 steps on the tiny corpus; its history and run directory."""
    out = tmp_path_factory.mktemp("encdec") / "run"
    cfg = load_config(None, [*TINY, *ENCDEC, f"--data.dir={tiny_data_dir}", f"--train.out_dir={out}",
                             "--train.steps=30", "--train.eval_every=10", "--checkpoint.every=10",
                             "--optim.lr=1e-2", "--train.batch_size=8", "--train.micro_batch_size=4"])
    history = Trainer(cfg, init_distributed("cpu")).fit()
    return history, out


def test_encdec_trains_and_validation_loss_falls(encdec_run):
    history, out = encdec_run
    val = [row["val/loss"] for row in history if "val/loss" in row]
    assert len(val) == 3 and val[-1] < val[0]
    assert isinstance(load_config(out / "config.yaml").model.arch, str)
    train = [row["train/loss"] for row in history if "train/loss" in row]
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5


def test_eval_reads_the_architecture_from_the_checkpoint(encdec_run, capsys):
    history, out = encdec_run
    assert run(eval_tool.main, ["--checkpoint", str(out), "--batch-size", "4"]) == 0
    printed = capsys.readouterr().out
    assert "span corruption of windows of 17 tokens (source 15, target 5)" in printed
    # 355 val windows x 5 target tokens; the trainer's val loss is the same task on its first 4 windows
    assert "target tokens scored: 1,775" in printed
    loss = float(printed.split("loss: ")[1].split()[0])
    assert abs(loss - history[-1]["val/loss"]) < 1.0
    with pytest.raises(SystemExit, match="2"):
        eval_tool.main(["--checkpoint", str(out), "--stride", "4"])
    assert "--stride: applies to next-token checkpoints; an encoder-decoder is scored" in capsys.readouterr().err


def test_eval_on_the_trainers_validation_windows_gives_the_trainers_val_loss(encdec_run, tiny_data_dir, capsys):
    """lm.eval's window k gets the noise of the trainer's val sample k: on the same windows, the same loss."""
    from pathlib import Path

    import numpy as np

    from lm.checkpoint.loading import load_for_inference
    from lm.data.loader import SplitWindows, val_batches
    from lm.data.shards import open_shard, read_manifest

    _, out = encdec_run
    model, cfg, _ = load_for_inference(out, torch.device("cpu"))
    family = family_of(cfg.model)
    objective = family.training.objective(cfg.model, cfg.data, 16, cfg.train.seed)
    windows = SplitWindows(tiny_data_dir, "val", 16)
    with torch.no_grad():
        trainer_losses = [family.training.score(model, model, list(map(torch.from_numpy, batch))).loss.item()
                          for batch in val_batches(windows, 4, 0, 1, 3, objective)]
    shards = read_manifest(tiny_data_dir)["splits"]["val"]["shards"]
    streams = [open_shard(Path(tiny_data_dir) / s["file"]) for s in shards]
    nll, count, correct = eval_tool.score_windows(family, model, [np.asarray(streams[0][:16 * 12 + 1])], objective,
                                                  16, 4, torch.device("cpu"))
    assert count == 12 * 5 and correct is None
    assert nll / count == pytest.approx(sum(trainer_losses) / 3, rel=1e-6)


def test_sample_fills_masks_and_continues_plain_text(encdec_run, capsys):
    _, out = encdec_run
    args = ["--checkpoint", str(out), "--max-new-tokens", "8", "--seed", "3"]
    assert run(sample.main, [*args, "--prompt", "To be, or not to <mask>, that is the <mask>."]) == 0
    filled = capsys.readouterr().out.strip()
    # the space before a mask is the span's (span corruption hides " be" whole)
    assert filled.startswith("To be, or not to") and "<mask>" not in filled and ", that is the" in filled
    assert run(sample.main, [*args, "--prompt", "To be, or not to <mask>, that is the <mask>."]) == 0
    assert capsys.readouterr().out.strip() == filled  # same seed, same text
    assert run(sample.main, [*args, "--prompt", "KING:"]) == 0
    assert capsys.readouterr().out.startswith("KING:")
    with pytest.raises(SystemExit, match="2"):
        sample.main([*args, "--prompt", "a <mask> b <mask> c <mask> d <mask>"])
    assert "4 <mask> markers; the model has 4 sentinels, so at most 3 spans" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        sample.main([*args, "--prompt", "word " * 40])
    assert "longer than the encoder's positions (model.block_size=32)" in capsys.readouterr().err


def test_resuming_one_architecture_with_the_other_is_refused(encdec_run, tiny_data_dir, tmp_path):
    _, out = encdec_run
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    cfg = load_config(None, [*TINY, f"--data.dir={tiny_data_dir}", f"--train.out_dir={out}", "--train.steps=40"])
    with pytest.raises(ConfigError, match=r"checkpoint is an encoder-decoder \(model.arch=encdec\) but the config "
                                          r"asks for a decoder-only GPT \(model.arch=gpt\)"):
        Trainer(cfg, init_distributed("cpu"))
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_too_few_sentinels_for_the_window_is_refused_before_training(tiny_data_dir, tmp_path):
    cfg = load_config(None, [*TINY, *ENCDEC, "--model.n_sentinels=2", "--data.seq_len=30", "--model.block_size=64",
                             f"--data.dir={tiny_data_dir}", f"--train.out_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="model.n_sentinels: 2 sentinels do not fit data.seq_len=30"):
        Trainer(cfg, init_distributed("cpu"))
    assert not (tmp_path / "run").exists()


def test_encdec_model_type(encdec_run):
    from lm.checkpoint.loading import load_for_inference
    model, cfg, _ = load_for_inference(encdec_run[1], torch.device("cpu"))
    assert isinstance(model, EncoderDecoder) and cfg.model.arch == "encdec"
