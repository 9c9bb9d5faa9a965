import subprocess
import sys

import pytest

from lm import eval as eval_tool
from lm import finetune, plot, predict, prepare, sample
from lm import train as train_tool
from lm.bench import __main__ as bench
from lm.cli import run, run_logged
from lm.sweep import __main__ as sweep


@pytest.mark.parametrize("tool", [prepare, train_tool, finetune, predict, eval_tool, sample, bench, sweep, plot])
def test_every_tool_has_help(tool, capsys):
    with pytest.raises(SystemExit) as exit_:
        run(tool.main, ["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("tool, args, flag", [
    ("finetune", ["--encoder", ""], "--encoder"),
    ("predict", ["--checkpoint", "", "--file", "p.csv"], "--checkpoint"),
    ("predict", ["--checkpoint", "run", "--file", " "], "--file"),
    ("predict", ["--checkpoint", "run", "--file", "p.csv", "--out", ""], "--out"),
    ("eval", ["--checkpoint", "run", "--data-dir", ""], "--data-dir"),
    ("sample", ["--checkpoint", ""], "--checkpoint"),
    ("export", ["--checkpoint", "run", "--to", "hf", ""], "OUT"),
    ("consolidate", ["--checkpoint", "run", ""], "OUT"),
    ("train_tokenizer", ["--vocab-size", "300", "--out", ""], "--out"),
    ("plot", [""], "RUN_DIR"),
    ("sweep", ["--config", "configs/demo.yaml", "--grid", "optim.lr=1e-3", "--out", ""], "--out"),
    ("layouts", ["--layout", "1", "--out", ""], "--out"),
    ("sample", ["--checkpoint", "run", "--prompt-file", ""], "--prompt-file"),
    ("train", ["--config", ""], "--config"),
])
def test_an_empty_path_is_refused_by_its_flag(tool, args, flag, capsys):
    # Path("") is ".": the tools read or wrote the working directory, and their errors named "."
    import importlib

    module = importlib.import_module(f"lm.{tool}" if tool != "sweep" else "lm.sweep.__main__")
    with pytest.raises(SystemExit) as exit_:
        module.main(args)
    assert exit_.value.code == 2
    assert f"argument {flag}: expected a path, got " in capsys.readouterr().err


@pytest.mark.parametrize("tool, args", [
    ("eval", ["--checkpoint", "run", "--tasks", "arc_easy", "--shots", "1", "--seed=-1"]),
    ("sweep", ["--config", "configs/demo.yaml", "--grid", "optim.lr=1e-3,2e-3", "--random", "1", "--seed=-1"]),
    ("sample", ["--checkpoint", "run", "--seed", "99999999999999999999999"]),
])
def test_a_seed_out_of_range_is_refused_by_its_flag(tool, args, capsys):
    # lm.eval and lm.sweep took any integer, as lm.sample did not
    import importlib

    module = importlib.import_module(f"lm.{tool}" if tool != "sweep" else "lm.sweep.__main__")
    with pytest.raises(SystemExit) as exit_:
        module.main(args)
    assert exit_.value.code == 2
    assert "argument --seed: expected an integer in [0, 9223372036854775807], got " in capsys.readouterr().err


def test_train_reports_missing_data_dir_in_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    code = run(train_tool.main, ["--config", "configs/demo.yaml", f"--data.dir={missing}",
                                 f"--train.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: data.dir: no directory") and str(missing) in err and "lm.prepare" in err
    assert not (tmp_path / "run").exists()


def test_manifest_tokenizer_mismatch(tiny_data_dir, tmp_path, capsys):
    code = run(train_tool.main, [f"--data.dir={tiny_data_dir}", "--data.tokenizer=cl100k_base",
                                 "--model.vocab_size=100277", f"--train.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "prepared with tokenizer 'gpt2', but data.tokenizer='cl100k_base'" in err


@pytest.mark.process
def test_console_entry_point_runs_as_a_process():
    result = subprocess.run([sys.executable, "-m", "lm", "train", "--model.n_layr=2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: model.n_layr: not a key of a decoder-only GPT (model.arch=gpt); did you mean 'n_layer'? it takes "
        "['arch', 'aux_loss_coef', 'bias', 'block_size', 'd_ff', 'd_head', 'd_model', 'dropout', 'expert_d_ff', "
        "'experts_per_token', 'logit_softcap', 'loss_chunk', 'mlp', 'moe_every', 'moe_first_dense', 'n_experts', "
        "'n_head', 'n_kv_head', 'n_layer', 'n_shared_experts', 'nope_interval', 'norm', 'norm_eps', 'norm_position', "
        "'pos', 'qk_norm', 'qk_norm_scope', 'qkv_bias', 'rope_factor', 'rope_high_freq_factor', "
        "'rope_low_freq_factor', 'rope_original_context', 'rope_scaling', 'rope_theta', 'router', "
        "'router_bias_rate', 'router_bias_update', 'router_renorm', 'router_z_loss_coef', "
        "'tie_embeddings', 'vocab_multiple', 'vocab_size']"
    ]
    listing = subprocess.run([sys.executable, "-m", "lm", "--help"], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0
    assert all(t in listing.stdout for t in ("prepare", "train", "finetune", "predict", "eval", "sample", "sweep",
                                             "plot", "bench"))
    unknown = subprocess.run([sys.executable, "-m", "lm", "trian"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.splitlines()[-1] == "error: unknown tool 'trian'; expected one of the tools above"


def test_a_failed_run_is_told_by_its_own_launch_not_by_an_earlier_ones_error(tmp_path):
    """A run's log holds each launch: a run killed without an `error:` line is not blamed on the last launch's."""
    log_path = tmp_path / "run" / "train.log"
    refused = run_logged([sys.executable, "-c", "print('error: bad value'); raise SystemExit(2)"], log_path)
    assert refused == f"failed (exit 2: bad value; see {log_path})"
    killed = run_logged([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], log_path)
    assert killed == f"failed (killed by SIGKILL; see {log_path})"
    assert log_path.read_text().splitlines().count("error: bad value") == 1


def test_a_range_takes_both_its_bounds_and_a_finite_float_no_infinity():
    import argparse

    from lm.cli import finite_float, in_range

    steps = in_range(int, 1, 16)
    assert (steps("1"), steps("16")) == (1, 16)
    for bad in ("0", "17"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer in \[1, 16\]"):
            steps(bad)
    for text in ("inf", "-inf", "1e999", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number"):
            finite_float(text)
    assert finite_float("1e-3") == 0.001


def test_prepare_is_given_the_data_keys_and_the_vocabulary_size_of_a_job():
    from lm.cli import prepare_command

    command = prepare_command(["--config", "c.yaml"], ["--data.seq_len=64", "--model.vocab_size=100277",
                                                       "--model.n_layer=2", "--train.steps=5"])
    assert command[-4:] == ["--config", "c.yaml", "--data.seq_len=64", "--model.vocab_size=100277"]
