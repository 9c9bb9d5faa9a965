import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lm import eval as eval_tool
from lm import finetune, plot, predict, prepare, sample
from lm import train as train_tool
from lm.bench import __main__ as bench
from lm.cli import Stopped, run, run_logged, train_command
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


REPO = Path(__file__).resolve().parents[1]


def test_a_file_that_is_not_there_ends_on_one_error_line_with_status_2(tmp_path, capsys):
    missing = tmp_path / "none.yaml"

    def main(argv):
        missing.read_text()

    assert run(main, []) == 2
    assert capsys.readouterr().err == f"error: [Errno 2] No such file or directory: '{missing}'\n"


def test_a_stopped_tool_exits_128_plus_the_signal_as_a_shell_does(capsys):
    def stopped(argv):
        raise Stopped(signal.SIGTERM, "SIGTERM passed on to the run, which exited 0")

    def interrupted(argv):
        raise KeyboardInterrupt

    assert run(stopped, []) == 128 + signal.SIGTERM
    assert run(interrupted, []) == 128 + signal.SIGINT
    assert capsys.readouterr().err.splitlines() == ["stopped: SIGTERM passed on to the run, which exited 0",
                                                    "stopped: SIGINT (Ctrl-C)"]


def test_a_failed_run_is_told_by_its_last_error_line(tmp_path):
    log_path = tmp_path / "train.log"
    told = run_logged([sys.executable, "-c", "print('error: a warning first'); print('error: the reason'); "
                                             "raise SystemExit(1)"], log_path)
    assert told == f"failed (exit 1: the reason; see {log_path})"


def test_a_sigterm_to_the_tool_is_passed_on_to_its_run_which_saves_and_the_tool_stops(tmp_path):
    # the run is in a session of its own: a signal reaches it only through run_logged, which passes it on
    ready, log_path = tmp_path / "ready", tmp_path / "train.log"
    child = ("import pathlib, signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda s, f: (print('saving on signal', s, flush=True), sys.exit(0)))\n"
             f"pathlib.Path({str(ready)!r}).touch()\n"
             "time.sleep(10)\n")
    default = signal.getsignal(signal.SIGTERM)

    def send_once_the_run_waits():
        deadline = time.monotonic() + 20
        # run_logged's handler is in place, and the run has its own
        while (signal.getsignal(signal.SIGTERM) is default or not ready.exists()) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_once_the_run_waits, daemon=True).start()
    with pytest.raises(Stopped) as stopped:
        run_logged([sys.executable, "-c", child], log_path)
    assert stopped.value.signum == signal.SIGTERM
    assert str(stopped.value) == f"SIGTERM passed on to the run, which exited 0 (log: {log_path})"
    assert f"saving on signal {int(signal.SIGTERM)}" in log_path.read_text().splitlines()
    assert signal.getsignal(signal.SIGTERM) is default


@pytest.mark.skipif(sys.platform != "linux", reason="prctl's parent-death signal is Linux's")
def test_a_run_whose_tool_is_killed_gets_a_sigterm_instead_of_training_on(tmp_path):
    ready, termed = tmp_path / "ready", tmp_path / "termed"
    child = ("import os, pathlib, signal, sys, time\n"
             f"signal.signal(signal.SIGTERM, lambda s, f: (pathlib.Path({str(termed)!r}).touch(), sys.exit(0)))\n"
             f"pathlib.Path({str(ready)!r}).write_text(str(os.getpid()))\n"
             "time.sleep(15)\n")
    tool = (f"import sys\nfrom pathlib import Path\nfrom lm.cli import run_logged\n"
            f"run_logged([sys.executable, '-c', {child!r}], Path({str(tmp_path / 'train.log')!r}))\n")
    parent = subprocess.Popen([sys.executable, "-c", tool], cwd=REPO)
    pid = None
    try:
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        pid = int(ready.read_text())
        parent.kill()  # kill -9, or the out-of-memory killer: no handler of the tool runs
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not termed.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert termed.exists()
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_one_process_job_runs_lm_train_itself_and_more_run_under_torchrun():
    assert train_command(1, ["--config", "c.yaml"]) == [sys.executable, "-m", "lm.train", "--config", "c.yaml"]
    assert train_command(2, ["--config", "c.yaml"]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lm.train",
        "--config", "c.yaml"]
