
"""`python -m lm.export --to hf`: checkpoints written by the real trainer load in transformers with our logits
and tokenizer, as a native class or as lm's own code; a family with no export and occupied output directories
are refused without writing anything."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import lm.hf.export_files
from lm.checkpoint.loading import load_for_inference
from lm.checkpoint.store import resolve_checkpoint
from lm.cli import run
from lm.export import main
from lm.tokenizer import load_tokenizer

TEXT = "KING DUNCAN.\nWhat bloody man is that?  He can report,\n\tAs seemeth by his plight, 1606: naïve café 🙂"
HF_FILES = {"config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"}
CODE_FILES = {"configuration_lm.py", "hf_glue.py", "layers.py", "attention.py", "block.py", "kv_cache.py",
              "modeling_lm_decoder.py"}


def train_run(data_dir: Path, out: Path, *model_flags: str) -> Path:
    """A run directory written by the real Trainer: a tiny model trained 2 steps, like `trained_run`."""
    from lm.config import load_config
    from lm.distributed.env import init_distributed
    from lm.training.trainer import Trainer

    cfg = load_config(None, [
        "--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32", *model_flags,
        "--data.seq_len=16", f"--data.dir={data_dir}", "--train.steps=2", "--train.batch_size=2",
        "--train.micro_batch_size=2", "--train.device=cpu", "--train.eval_batches=1",
        "--log.tensorboard=false", f"--train.out_dir={out}",
    ])
    Trainer(cfg, init_distributed("cpu")).fit()
    return out


@pytest.fixture(scope="module")
def llama_run(tiny_data_dir, tmp_path_factory) -> Path:
    """Llama-style: rotary positions, RMSNorm, SwiGLU, no biases, one key/value head for two query heads."""
    return train_run(tiny_data_dir, tmp_path_factory.mktemp("llama") / "run", "--model.pos=rope",
                     "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.bias=false", "--model.n_kv_head=1")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def export_process(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, env=env)


def assert_same_model(run_dir: Path, out: Path, hf_class: str) -> None:
    """transformers loads OUT alone (model and tokenizer) and reproduces our logits and token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, cfg, _ = load_for_inference(run_dir, torch.device("cpu"))
    # lm's own code runs only when trusted; a native class needs no code and ignores the flag
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, trust_remote_code=True).eval()
    assert type(hf).__name__ == hf_class and hf.dtype == torch.float32
    vocab = cfg.model.vocab_size
    idx = torch.randint(0, vocab, (2, cfg.model.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ours(idx))[..., :vocab], hf(idx).logits, atol=1e-5, rtol=1e-5)

    encoding = load_tokenizer(cfg.data.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True, trust_remote_code=True)
    ids = encoding.encode_ordinary(TEXT)
    assert tokenizer.encode(TEXT) == ids and tokenizer.decode(ids) == TEXT
    assert tokenizer.eos_token_id == hf.config.eos_token_id == hf.generation_config.eos_token_id == encoding.eot_token


def test_gpt2_run_exports_to_gpt2(trained_run, tmp_path, monkeypatch, caplog):
    # in-process: the tool's own process, `python -m lm.export` and `lm export`, run in the two tests below
    out = tmp_path / "hf" / "gpt2"  # parents are created
    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="lm.export"):
        m.chdir(tmp_path)
        assert run(main, ["--checkpoint", str(trained_run), "--to", "hf", "hf/gpt2"]) == 0
    assert "as GPT2LMHeadModel to hf/gpt2: config.json, " in caplog.text  # the path as given
    assert {p.name for p in out.iterdir()} == HF_FILES
    assert [p.name for p in out.parent.iterdir()] == ["gpt2"]  # no staging directory left behind
    assert_same_model(trained_run, out, "GPT2LMHeadModel")
    # lm's tools read the export's tokenizer.json as the encoding it was written from: the run's data fits it
    from lm.eval import main as eval_main

    assert load_for_inference(out, torch.device("cpu"))[1].data.tokenizer == "gpt2"
    data_dir = yaml.safe_load((trained_run / "config.yaml").read_text())["data"]["dir"]
    assert run(eval_main, ["--checkpoint", str(out), "--data-dir", data_dir, "--max-tokens", "64"]) == 0
    # not into a run directory, whose checkpoints lm's tools would no longer see
    for inside in (trained_run, resolve_checkpoint(trained_run) / "hf"):  # nor among its checkpoints
        with pytest.raises(SystemExit, match="2"):
            run(main, ["--checkpoint", str(trained_run), "--to", "hf", str(inside), "--force"])
    assert not (resolve_checkpoint(trained_run) / "hf").exists()
    assert not (trained_run / "config.json").exists()


@pytest.mark.process
def test_llama_run_exports_to_llama(llama_run, tmp_path):
    out = tmp_path / "llama"
    result = export_process("lm", "export", "--checkpoint", str(llama_run), "--to", "hf", str(out))
    assert result.returncode == 0, result.stderr
    assert {p.name for p in out.iterdir()} == HF_FILES
    assert_same_model(llama_run, out, "LlamaForCausalLM")


@pytest.mark.process
def test_a_run_no_native_class_computes_exports_as_lm_code(tiny_data_dir, tmp_path):
    """demo-modern's block (QK-norm, ReLU squared) goes out as lm's own modeling code beside the weights."""
    run_dir = train_run(tiny_data_dir, tmp_path / "run", "--model.pos=rope", "--model.norm=rmsnorm",
                        "--model.mlp=relu2", "--model.bias=false", "--model.qk_norm=true", "--model.n_kv_head=1")
    out = tmp_path / "modern"
    result = export_process("lm.export", "--checkpoint", str(run_dir), "--to", "hf", str(out))
    assert result.returncode == 0, result.stderr
    assert "load the directory with trust_remote_code=True" in result.stdout
    assert {p.name for p in out.iterdir()} == HF_FILES | CODE_FILES
    assert_same_model(run_dir, out, "LMDecoderForCausalLM")


def checkpoint_of_arch(trained_run, root, **model):
    """A checkpoint directory whose config says another architecture; it holds no weights."""
    step = root / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    source = resolve_checkpoint(trained_run)
    shutil.copy(source / "state.json", step)
    config = yaml.safe_load((source / "config.yaml").read_text())
    config["model"].update(model)
    (step / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def test_lstm_checkpoint_is_refused_naming_the_architecture_alone(trained_run, tmp_path, capsys):
    run_dir = checkpoint_of_arch(trained_run, tmp_path / "lstm", arch="lstm")
    out = tmp_path / "out"
    assert run(main, ["--checkpoint", str(run_dir), "--to", "hf", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: cannot export to Hugging Face: an LSTM (model.arch=lstm) has no transformers counterpart"]
    assert not out.exists()


def test_non_empty_out_needs_force_and_keeps_other_files(trained_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    (out / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), "--to", "hf", str(out)])
    assert exit_.value.code == 2
    assert "directory is not empty; pass --force" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in out.iterdir()} == {"README.md": "my notes", "config.json": "{}"}

    assert run(main, ["--checkpoint", str(trained_run), "--to", "hf", str(out), "--force"]) == 0
    assert {p.name for p in out.iterdir()} == HF_FILES | {"README.md"}
    assert (out / "README.md").read_text() == "my notes" and (out / "config.json").read_text() != "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failed_export_leaves_nothing(trained_run, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(lm.hf.export_files, "write_hf_tokenizer", broken)
    with pytest.raises(OSError, match="disk full"):
        run(main, ["--checkpoint", str(trained_run), "--to", "hf", str(tmp_path / "out")])
    assert list(tmp_path.iterdir()) == []


def test_out_that_is_a_file_is_a_usage_error(trained_run, tmp_path, capsys):
    out = tmp_path / "model.bin"
    out.write_text("x")
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), "--to", "hf", str(out), "--force"])
    assert exit_.value.code == 2 and f"{out}: is a file; name a directory" in capsys.readouterr().err


def test_an_out_holding_a_runs_checkpoints_is_refused_before_anything_is_written(trained_run, tmp_path, capsys):
    # lm's tools take a directory with checkpoints/ for a run: the export there would be hidden behind it
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), "--to", "hf", str(out), "--force"])
    assert exit_.value.code == 2
    assert (f"{out}: holds a run's checkpoints/, which an export there would hide from lm's tools"
            in capsys.readouterr().err)
    assert [p.name for p in out.iterdir()] == ["checkpoints"]


def test_an_out_inside_a_checkpoint_is_refused_before_anything_is_written(trained_run, tmp_path, capsys):
    # retention deletes a step directory whole, with whatever was written inside it
    step = tmp_path / "checkpoints" / "step_00000009"
    step.mkdir(parents=True)
    out = step / "hf"
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), "--to", "hf", str(out)])
    assert exit_.value.code == 2
    assert f"{out}: is inside the checkpoint {step}" in capsys.readouterr().err
    assert not out.exists()
