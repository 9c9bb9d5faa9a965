"""The launch scripts, run as a user runs them: two torchrun "nodes" on this machine, Slurm through stub
`srun`/`scontrol` commands that run the job here, DeepSpeed's launcher on this machine and, with stub
`ssh`/`pdsh`, from a hostfile."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.run import parse_args

from lm.torchrun import _count_problem, main

# every test here runs a launch script (torchrun, DeepSpeed, Slurm) in processes of its own: the full tier only
pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32",
    "--data.seq_len=16", "--train.batch_size=4", "--train.micro_batch_size=2", "--train.device=cpu",
    "--train.eval_batches=2", "--log.every=1", "--log.tensorboard=false", "--optim.lr=3e-3",
    "--schedule.warmup_steps=2", "--log.sample_tokens=4",
]
# Variables a launcher reads; the test process's own values (say, from a torchrun above pytest) must not leak in.
LAUNCH_VARS = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
               "MASTER_PORT", "RUN_ID", "MAX_RESTARTS", "HOSTFILE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    """The environment of a launch script: this interpreter's environment active, as launch/test.sh leaves
    it (so launch/activate.sh keeps it), the stubs of tmp_path/bin first on PATH, one thread per process."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    path = f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return {**env, "VIRTUAL_ENV": sys.prefix, "PATH": path, "OMP_NUM_THREADS": "1", **variables}


def stub(tmp_path: Path, name: str, body: str = "") -> Path:
    """A command on the scripts' PATH that appends its arguments, one call per line, to tmp_path/<name>.calls."""
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path / name}.calls\n{body}\n')
    path.chmod(0o755)
    return tmp_path / f"{name}.calls"


def calls(record: Path) -> list[list[str]]:
    return [line.split() for line in record.read_text().splitlines()] if record.exists() else []


def run_script(args: list[str], env: dict[str, str], log: Path, cwd: Path = REPO) -> subprocess.Popen:
    # a session of its own, so a failed test can stop the launcher and every process it started
    with open(log, "w") as out:
        return subprocess.Popen(["bash", *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_all(procs: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def train_steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "train/loss" in r]


def test_two_nodes_rendezvous_and_train(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    env = script_env(tmp_path, NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port()), RUN_ID=f"test-{os.getpid()}")
    args = ["launch/multi_node.sh", *TINY, f"--data.dir={tiny_data_dir}", f"--train.out_dir={out}",
            "--train.steps=3", "--train.eval_every=3", "--checkpoint.every=3"]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    codes = wait_all([run_script(args, env, log) for log in logs])
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n\n".join(text)
    # c10d rendezvous gave the two torchruns one group of 2 ranks; one of them holds rank 0 and logs
    assert sum("joined process group: rank 0/2, backend gloo" in t for t in text) == 1
    state = json.loads((out / "checkpoints/step_00000003/state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 3
    assert {p.name for p in (out / "checkpoints/step_00000003").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    assert train_steps(out) == [1, 2, 3]


@pytest.mark.parametrize("variables, message", [
    ({"NNODES": "2", "NPROC_PER_NODE": "2", "WORLD_SIZE": "8"},
     "error: WORLD_SIZE=8, but NNODES=2 x NPROC_PER_NODE=2 is 4 processes"),
    ({"NNODES": "0"}, "error: NNODES must be a positive integer, got '0'"),
    ({"NNODES": "two"}, "error: NNODES must be a positive integer, got 'two'"),
    ({}, "error: NNODES must be a positive integer, got ''"),
    ({"NNODES": "2", "NPROC_PER_NODE": "-1"}, "error: NPROC_PER_NODE must be a positive integer, got '-1'"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "error: NODE_RANK must be in 0..1, got '2'"),
    ({"NNODES": "2", "MASTER_ADDR": ""}, "error: MASTER_ADDR: set it to the host name or address of one node"),
    ({"NNODES": "2", "MASTER_PORT": "abc"}, "error: MASTER_PORT must be a port number, 1 to 65535, got 'abc'"),
    ({"NNODES": "2", "MASTER_PORT": "99999"}, "error: MASTER_PORT must be a port number, 1 to 65535, got '99999'"),
    ({"NNODES": "2", "MAX_RESTARTS": "-1"}, "error: MAX_RESTARTS must be 0 or a positive integer, got '-1'"),
    ({"NNODES": "2", "MASTER_ADDR": "no-such-host.invalid"},
     "error: MASTER_ADDR: 'no-such-host.invalid' does not resolve to an address on this node"),
], ids=["world-size", "zero-nodes", "word-nodes", "no-nodes", "bad-nproc", "node-rank", "no-master", "word-port",
        "big-port", "restarts", "unresolved"])
def test_multi_node_rejects_bad_input_before_torchrun(tmp_path, variables, message):
    torchrun = stub(tmp_path, "lm-torchrun")
    env = script_env(tmp_path, **{"MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": "1", **variables})
    result = subprocess.run(["bash", "launch/multi_node.sh", "--train.steps=1"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [message] and result.stdout == ""
    assert calls(torchrun) == []


@pytest.mark.parametrize("counts, message", [
    (["--nproc_per_node=abc"], "--nproc_per_node: expected a positive number of processes per node (or auto, cpu, "
     "gpu), got 'abc' (NPROC_PER_NODE in the launch scripts)"),
    (["--nproc_per_node=0"], "--nproc_per_node: expected a positive number of processes per node"),
    (["--nnodes=2:1"], "--nnodes: expected a positive number of nodes, or MIN:MAX with 0 < MIN <= MAX, got '2:1'"),
    (["--nnodes=0"], "--nnodes: expected a positive number of nodes"),
])
def test_lm_torchrun_refuses_bad_counts_in_one_line(counts, message, capsys):
    """torchrun itself would end on a ValueError or AssertionError traceback (single_node.sh's NPROC_PER_NODE)."""

    assert main([*counts, "-m", "lm.train"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {message}")


@pytest.mark.parametrize("exit_code, launches", [(2, 1), (1, 2)])
def test_a_worker_that_refused_its_input_is_not_restarted(exit_code, launches, tmp_path, capfd):
    """An input error (exit 2) would come back on every restart; a crash (exit 1) is what restarts are for."""

    count, worker = tmp_path / "launches", tmp_path / "worker.py"
    worker.write_text(f"import sys\nwith open({str(count)!r}, 'a') as f:\n    f.write('x')\n"
                      f"print('error: bad input', file=sys.stderr)\nsys.exit({exit_code})\n")
    # torchrun's agent takes over the process's signals for its workers and leaves them so: this test's process
    # goes on to run other tests, whose SIGTERM must be their own
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        code = main(["--standalone", "--nproc_per_node=1", "--max-restarts=1", "--monitor-interval=0.05", str(worker)])
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert code == exit_code and len(count.read_text()) == launches
    assert capfd.readouterr().err.count("error: bad input") == launches


def test_lm_torchrun_takes_a_range_of_nodes_that_may_be_a_single_count():
    for nodes in ("2", "2:2", "1:2"):
        assert _count_problem(parse_args([f"--nnodes={nodes}", "--nproc_per_node=2", "x.py"])) is None, nodes


def test_a_node_that_never_joins_ends_on_one_line(capsys):
    """torchrun's RendezvousTimeoutError was a bare 41-line traceback: no word of the nodes or the endpoint."""

    port = free_port()
    assert main(["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                 "--rdzv_conf=join_timeout=1", "-m", "lm.train"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1] == (
        f"error: the rendezvous at 127.0.0.1:{port} ended with RendezvousTimeoutError: --nnodes=2 nodes did not all "
        "join; start the script on every node with the same NNODES, MASTER_ADDR, MASTER_PORT and RUN_ID")


def test_a_rendezvous_this_node_cannot_reach_is_named_as_such(capsys):

    assert main(["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=10.255.255.1:29717",
                 "--rdzv_conf=join_timeout=2,read_timeout=2,timeout=2", "-m", "lm.train"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (  # it said the nodes did not all join
        "error: cannot reach the rendezvous at 10.255.255.1:29717: check that MASTER_ADDR names a node this one "
        "reaches and that MASTER_PORT is open there")


def test_multi_node_command_lines(tmp_path):
    torchrun = stub(tmp_path, "lm-torchrun")
    base = {"NNODES": "4", "NPROC_PER_NODE": "8", "MASTER_ADDR": "localhost", "WORLD_SIZE": "32"}
    for variables in ({"RUN_ID": "r1", "MAX_RESTARTS": "3"}, {"NODE_RANK": "3", "MASTER_PORT": "1234"}):
        subprocess.run(["bash", "launch/multi_node.sh", "--config", "c.yaml"], cwd=REPO, check=True,
                       env=script_env(tmp_path, **base, **variables), timeout=60)
    elastic, static = calls(torchrun)
    assert elastic == ["--nnodes=4", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:29500",
                       "--rdzv_id=r1", "--max-restarts=3", "-m", "lm.train", "--config", "c.yaml"]
    assert static == ["--nnodes=4", "--nproc_per_node=8", "--rdzv_backend=static", "--node_rank=3",
                      "--master_addr=localhost", "--master_port=1234", "--rdzv_id=lm", "--max-restarts=0",
                      "-m", "lm.train", "--config", "c.yaml"]


def test_a_launched_run_that_refuses_its_input_ends_on_the_workers_error_line(tmp_path):
    result = subprocess.run(["bash", "launch/single_node.sh", *TINY, f"--data.dir={tmp_path / 'none'}",
                             f"--train.out_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                            env=script_env(tmp_path, NPROC_PER_NODE="2"), timeout=120)
    assert result.returncode == 2
    # one line from each rank, and nothing of torchrun's: no banner, no failure table, no traceback
    assert result.stderr.splitlines() == [f"error: data.dir: no directory '{tmp_path / 'none'}'; run "
                                          "`python -m lm.prepare` first"] * 2, result.stderr
    assert "torch/distributed" not in result.stdout


def test_a_crashed_worker_ends_on_a_line_naming_its_rank_after_torchruns_log(tiny_data_dir, tmp_path):
    result = subprocess.run(["bash", "launch/single_node.sh", *TINY, f"--data.dir={tiny_data_dir}",
                             f"--train.out_dir={tmp_path / 'run'}", "--train.steps=4"], cwd=REPO, capture_output=True,
                            text=True, env=script_env(tmp_path, NPROC_PER_NODE="2", LM_FAULT_KILL="1:2"), timeout=120)
    assert result.returncode == 1
    last = result.stderr.splitlines()[-1]
    assert re.fullmatch(r"error: lm\.train: rank 1 \(pid \d+\) was killed by SIGKILL; its own output is above",
                        last), result.stderr
    # torchrun's log of the failure is shown (rank 0's own traceback too: its peer vanished), not torchrun's traceback
    assert "exitcode: -9" in result.stderr and "ChildFailedError" not in result.stderr


def preemptible_run(tiny_data_dir, tmp_path) -> tuple[subprocess.Popen, Path, Path]:
    """single_node.sh on 2 processes, 400 steps unless stopped: (process, run directory, log file)."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = run_script(["launch/single_node.sh", *TINY, f"--data.dir={tiny_data_dir}", f"--train.out_dir={out}",
                       "--train.steps=400", "--train.eval_every=1000", "--checkpoint.every=1000"],
                      script_env(tmp_path, NPROC_PER_NODE="2"), log)
    return proc, out, log


def trained_steps(proc: subprocess.Popen, out: Path, log: Path, steps: int) -> None:
    """Wait until the run has logged `steps` steps."""
    deadline = time.monotonic() + 180
    while not ((out / "metrics.jsonl").exists() and len(train_steps(out)) >= steps):
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.05)


def stopped_at(proc: subprocess.Popen, out: Path, log: Path, by: str = "SIGTERM", code: int = 0) -> int:
    """The step the run saved when it stopped for signal `by`, after the script exited `code` (torchrun and the
    workers before it)."""
    assert wait_all([proc], timeout=180) == [code], log.read_text()
    assert not subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).stdout  # none left running
    text = log.read_text()
    assert "Traceback" not in text and "SignalException" not in text
    saved = json.loads((sorted((out / "checkpoints").iterdir())[-1] / "state.json").read_text())["step"]
    # said once, by rank 0, not once per process
    assert text.count(f"stopped at step {saved} by {by}") == 1 and text.count(f"{by} received") == 1, text
    return saved


@pytest.mark.parametrize("target", ["script", "every process"])
def test_sigterm_to_a_launched_run_saves_and_every_process_exits_0(target, tiny_data_dir, tmp_path):
    """Preemption: SIGTERM to the launch script alone (it forwards it to the workers), or as Slurm's --signal
    does it, to every process of the job (script, torchrun and workers). The workers train to the next log
    step, save and exit 0; torchrun, which does not handle SIGTERM under launch/torchrun.sh, exits 0 after
    them, and so does the script."""
    proc, out, log = preemptible_run(tiny_data_dir, tmp_path)
    trained_steps(proc, out, log, 3)
    # single_node.sh became launch/torchrun.sh (exec), whose one child is torchrun
    torchrun = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    workers = subprocess.run(["pgrep", "-P", torchrun[0]], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    if target == "script":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
        for pid in workers:
            os.kill(int(pid), signal.SIGTERM)
    assert 3 <= stopped_at(proc, out, log) < 400


def test_ctrl_c_waits_for_the_workers_to_save(tiny_data_dir, tmp_path):
    """Ctrl-C, a SIGINT to the terminal's whole process group: the script returned at once with 130 while
    torchrun and the workers trained on to their next log step and saved behind the prompt."""
    proc, out, log = preemptible_run(tiny_data_dir, tmp_path)
    trained_steps(proc, out, log, 3)
    os.killpg(proc.pid, signal.SIGINT)
    assert 3 <= stopped_at(proc, out, log, by="SIGINT", code=1) < 400


def test_sigterm_before_the_workers_start_is_not_lost(tiny_data_dir, tmp_path):
    """A SIGTERM the script takes while torchrun has not started the workers, or they still import (and ignore
    it, until lm installs its handler), is sent again until they take it: they save at a log step soon after."""
    proc, out, log = preemptible_run(tiny_data_dir, tmp_path)
    deadline = time.monotonic() + 60
    # torchrun started: not any child, since the script's $(...) before torchrun.sh's trap are children too
    while not subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "lm-torchrun"], capture_output=True).stdout:
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGTERM)
    assert stopped_at(proc, out, log) < 50  # lost, it trained all 400 steps


def test_single_node_uses_every_gpu_or_two_cpu_processes(tmp_path):
    import torch

    torchrun = stub(tmp_path, "lm-torchrun")
    subprocess.run(["bash", "launch/single_node.sh", "--config", "c.yaml"], cwd=REPO, check=True,
                   env=script_env(tmp_path), timeout=60)
    assert calls(torchrun) == [["--standalone", f"--nproc_per_node={torch.cuda.device_count() or 2}",
                                "-m", "lm.train", "--config", "c.yaml"]]


# srun as Slurm runs a step of --ntasks-per-node=1: the command once per node, all at once, each with its
# node id; every "node" here is this machine.
FAKE_SRUN = """
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def slurm_job(tmp_path: Path, nodelist: list[str], **variables: str) -> tuple[Path, dict[str, str]]:
    """sbatch's view of a job: the script copied to a spool directory, SLURM_* set, stub srun/scontrol."""
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(REPO / "launch/slurm.sbatch", spool / "slurm_script")
    stub(tmp_path, "srun", FAKE_SRUN)
    stub(tmp_path, "scontrol", f"printf '%s\\n' {' '.join(nodelist)}")
    env = script_env(tmp_path, **{"SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "4242",
                                  "SLURM_NNODES": str(len(nodelist)), "SLURM_JOB_NODELIST": ",".join(nodelist),
                                  **variables})
    return spool / "slurm_script", env


def test_slurm_script_runs_one_torchrun_per_node(tiny_data_dir, tmp_path):
    script, env = slurm_job(tmp_path, ["localhost"], MASTER_PORT=str(free_port()))
    out = tmp_path / "run"
    log = tmp_path / "job.log"
    code, = wait_all([run_script([str(script), *TINY, f"--data.dir={tiny_data_dir}", f"--train.out_dir={out}",
                                  "--train.steps=2", "--train.eval_every=2", "--checkpoint.every=2"],
                                 env, log, cwd=tmp_path)])
    assert code == 0, log.read_text()
    assert calls(tmp_path / "scontrol.calls") == [["show", "hostnames", "localhost"]]
    (srun,) = calls(tmp_path / "srun.calls")
    assert srun[:3] == ["--kill-on-bad-exit=1", "bash", "launch/torchrun.sh"]
    assert {"--nnodes=1", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=localhost:{env['MASTER_PORT']}", "--rdzv_id=4242"} <= set(srun)
    assert json.loads((out / "checkpoints/step_00000002/state.json").read_text())["world_size"] == 1
    assert train_steps(out) == [1, 2]


def test_slurm_script_two_gpu_nodes(tmp_path):
    script, env = slurm_job(tmp_path, ["gpu07", "gpu08"], SLURM_GPUS_PER_NODE="h100:8")
    torchrun = stub(tmp_path, "lm-torchrun")
    subprocess.run(["bash", str(script), "--config", "configs/gpt2-124m.yaml"], cwd=tmp_path, env=env,
                   check=True, timeout=60)
    expected = ["--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=gpu07:29500",
                "--rdzv_id=4242", "--max-restarts=0", "-m", "lm.train", "--config", "configs/gpt2-124m.yaml"]
    assert calls(torchrun) == [expected, expected]  # one torchrun per node
    header = [line.split()[1] for line in (REPO / "launch/slurm.sbatch").read_text().splitlines()
              if line.startswith("#SBATCH")]
    assert "--ntasks-per-node=1" in header
    assert any(h.startswith("--nodes=") for h in header) and any(h.startswith("--gpus-per-node=") for h in header)


def test_slurm_script_outside_the_checkout(tmp_path):
    script, env = slurm_job(tmp_path, ["gpu07"], SLURM_SUBMIT_DIR=str(tmp_path))
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    expected = f"error: submit from the repository root (no launch/activate.sh in {tmp_path})"
    assert result.stderr.splitlines() == [expected]
    assert calls(tmp_path / "srun.calls") == []


def test_demo_prepares_evaluates_and_samples_what_its_arguments_name(tmp_path):
    """The data keys go to lm.prepare too, and lm.eval and lm.sample read the run --train.out_dir names: they
    read runs/demo-modern whatever the run, and so scored another model than the one just trained."""
    python, torchrun = stub(tmp_path, "python"), stub(tmp_path, "lm-torchrun")
    subprocess.run(["bash", "launch/demo.sh", "--train.out_dir=runs/mine", "--data.dir=data/mine", "--train.steps=6",
                    "--data.tokenizer=cl100k_base", "--model.vocab_size=100277"],
                   cwd=REPO, env=script_env(tmp_path), check=True, timeout=60)
    prepare, scored, sampled = calls(python)
    assert prepare == ["-m", "lm.prepare", "--config", "configs/demo-modern.yaml", "--data.dir=data/mine",
                       "--data.tokenizer=cl100k_base", "--model.vocab_size=100277"]
    assert scored[:4] == ["-m", "lm.eval", "--checkpoint", "runs/mine"]
    assert sampled[:4] == ["-m", "lm.sample", "--checkpoint", "runs/mine"]
    (train,) = calls(torchrun)
    assert train[-5:] == ["--train.out_dir=runs/mine", "--data.dir=data/mine", "--train.steps=6",
                          "--data.tokenizer=cl100k_base", "--model.vocab_size=100277"]


def test_setup_refuses_a_torch_older_than_lm_needs_before_pip_runs(tmp_path):
    """pip would replace it with PyPI's default build, CUDA wheels and all, where setup.sh said it kept it."""
    (tmp_path / "old" / "torch").mkdir(parents=True)
    (tmp_path / "old" / "torch" / "__init__.py").write_text('__version__ = "2.5.0+cu121"\n')
    pip = tmp_path / "pip.calls"  # a python whose torch is the old one, and whose pip only records its calls
    stub(tmp_path, "python", f'[ "$1 $2" = "-m pip" ] && {{ echo "$*" >> {pip}; exit 0; }}\n'
                             f'PYTHONPATH={tmp_path / "old"} exec {sys.executable} "$@"')
    result = subprocess.run(["bash", "launch/setup.sh", "--dev"], cwd=REPO, env=script_env(tmp_path),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("setup: error: torch 2.5.0+cu121 is installed, and lm needs 2.11 or newer;")
    assert not pip.exists()


def test_deepspeed_hostfile_launch(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node0 slots=8\nnode1 slots=8\n")
    ssh = stub(tmp_path, "ssh", "echo 10.0.0.7")  # `ssh node0 hostname -I` gives the master address
    pdsh = stub(tmp_path, "pdsh")
    result = subprocess.run(["bash", str(REPO / "launch/deepspeed.sh"), "--config", "c.yaml",
                             "--parallel.engine=deepspeed"], cwd=tmp_path,
                            env=script_env(tmp_path, HOSTFILE="hosts"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [c[-1] for c in calls(ssh)] == ["hostname", "-I"]  # the reachability check, then the address
    (command,) = calls(pdsh)
    assert command[command.index("-w") + 1] == "node0,node1"
    launch = command[command.index("deepspeed.launcher.launch"):]
    assert {"--master_addr=10.0.0.7", "--master_port=29500", "--module", "--no_local_rank"} <= set(launch)
    assert launch[-4:] == ["lm.train", "--config", "c.yaml", "--parallel.engine=deepspeed"]
    assert f"cd {REPO};" in pdsh.read_text()  # every node starts in this checkout


@pytest.mark.parametrize("variables, message", [
    ({"HOSTFILE": "hosts"}, "error: HOSTFILE: no file 'hosts'"),
    ({"NPROC_PER_NODE": "0"}, "error: NPROC_PER_NODE must be a positive integer, got '0'"),  # DeepSpeed's "all"
    ({"MASTER_PORT": "29500x"}, "error: MASTER_PORT must be a port number, 1 to 65535, got '29500x'"),
])
def test_deepspeed_refuses_bad_variables_before_its_launcher(variables, message, tmp_path):
    deepspeed = stub(tmp_path, "deepspeed")
    result = subprocess.run(["bash", str(REPO / "launch/deepspeed.sh")], cwd=tmp_path, capture_output=True, text=True,
                            env=script_env(tmp_path, **variables), timeout=60)
    assert result.returncode == 2 and result.stderr.splitlines() == [message]
    assert calls(deepspeed) == []


def test_slurm_script_refuses_a_bad_port_before_srun(tmp_path):
    script, env = slurm_job(tmp_path, ["gpu07"], MASTER_PORT="port")
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: MASTER_PORT must be a port number, 1 to 65535, got 'port'"]
    assert calls(tmp_path / "srun.calls") == []


def test_deepspeed_local_zero2_run(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    # DeepSpeed builds a C++ op on its first initialize; the checkout's cache keeps it for later runs
    env = script_env(tmp_path, MASTER_PORT=str(free_port()), NPROC_PER_NODE="2",
                     TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache/torch_extensions")))
    log = tmp_path / "ds.log"
    code, = wait_all([run_script(["launch/deepspeed.sh", *TINY, f"--data.dir={tiny_data_dir}", f"--train.out_dir={out}",
                                  "--train.steps=2", "--train.eval_every=2", "--checkpoint.every=2",
                                  "--parallel.engine=deepspeed", "--parallel.zero_stage=2"], env, log)], timeout=600)
    text = log.read_text()
    assert code == 0, text
    assert "--local_rank" not in text  # lm.train's arguments are ours alone; the rank comes by environment
    state = json.loads((out / "checkpoints/step_00000002/state.json").read_text())
    assert (state["world_size"], state.get("engine"), state.get("zero_stage")) == (2, "deepspeed", 2), text
    assert train_steps(out) == [1, 2], text


def test_gpu_bench_script_refuses_a_misspelt_first_part(tmp_path):
    # taken as OUT, a misspelt part ran every part, hours of a lent GPU; a copy of the script, so that OUT
    # (relative to the script's checkout) would land in tmp_path
    (tmp_path / "launch").mkdir()
    shutil.copy(REPO / "launch/bench_gpu.sh", tmp_path / "launch")
    python = stub(tmp_path, "python")
    run = subprocess.run(["bash", str(tmp_path / "launch/bench_gpu.sh"), "trainn"], cwd=tmp_path,
                         env=script_env(tmp_path, PYTHON=str(tmp_path / "bin/python")), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == ["bench_gpu.sh: 'trainn' is no part (tests training engines sampling docmask "
                                       "losschunk profile train muon float8 ckpt) and not OUT (a path with a /, or a "
                                       "directory that exists)"]
    assert calls(python) == [] and not (tmp_path / "trainn").exists()


def test_gpu_bench_script_saves_each_part_and_reports_a_failed_one(tmp_path):
    out = tmp_path / "out"
    script = ["bash", str(REPO / "launch/bench_gpu.sh"), str(out)]
    # the tests part's pytest needs no plugin of another package (tests/conftest.py names its own): not importing
    # them (hypothesis's alone is ~2 s of CPU) changes nothing the script does
    env = script_env(tmp_path, PYTHON=sys.executable, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    # a name that is no part is refused before any part runs (a typo after an hour of parts was found last)
    run = subprocess.run([*script, "tests", "tets"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.startswith("bench_gpu.sh: unknown part 'tets' (tests training")
    assert not out.exists()
    # a failed part first (no GPU here): the parts after it still run and are saved, and the script exits 1 at the end
    run = subprocess.run([*script, "training", "tests"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "failed: training (see" in run.stderr, run.stdout + run.stderr
    assert "error: --device: cuda asked for, but torch sees no CUDA device" in (out / "training.txt").read_text()
    saved = (out / "tests.txt").read_text()
    # no GPU: every test of tests/gpu skipped, none failed
    assert saved.startswith("== tests: ") and re.search(r"\n\d+ skipped in ", saved) and "failed" not in saved


def test_lm_torchrun_refuses_a_node_range_of_more_than_two_counts():
    # torchrun would end on a traceback for --nnodes=1:2:3 (NNODES in the launch scripts)
    assert _count_problem(parse_args(["--nnodes=1:2:3", "--nproc_per_node=2", "x.py"])) == (
        "--nnodes: expected a positive number of nodes, or MIN:MAX with 0 < MIN <= MAX, got '1:2:3'")


def test_lm_torchrun_takes_torchruns_named_process_counts():
    # --nproc_per_node=gpu (every GPU of the node), cpu or auto are torchrun's own values, not bad counts
    for nproc in ("auto", "cpu", "gpu", "xpu"):
        assert _count_problem(parse_args(["--nnodes=1", f"--nproc_per_node={nproc}", "x.py"])) is None, nproc


def omp_threads_of_workers(tmp_path: Path, nproc: int) -> list[str]:
    """OMP_NUM_THREADS as each worker of an lm-torchrun of `nproc` processes on this machine sees it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    worker = tmp_path / "worker.py"
    worker.write_text(f"import os, pathlib\npathlib.Path({str(tmp_path)!r}, 'omp_' + os.environ['LOCAL_RANK'])"
                      ".write_text(os.environ.get('OMP_NUM_THREADS', 'unset'))\n")
    # torchrun's agent takes over the process's signals and leaves them so: put them back for the next tests
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        assert main(["--standalone", f"--nproc_per_node={nproc}", "--monitor-interval=0.05", str(worker)]) == 0
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return [(tmp_path / f"omp_{rank}").read_text() for rank in range(nproc)]


def test_lm_torchrun_keeps_the_users_omp_threads_and_leaves_one_process_its_default(tmp_path, monkeypatch):
    # one thread per worker is only torchrun's default for several workers sharing the machine's cores: a value
    # the user set is theirs, and a single process keeps torch's own (every core)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert omp_threads_of_workers(tmp_path / "set", 2) == ["3", "3"]
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert omp_threads_of_workers(tmp_path / "one", 1) == ["unset"]
    assert omp_threads_of_workers(tmp_path / "two", 2) == ["1", "1"]


def test_multi_node_takes_the_highest_port(tmp_path):
    torchrun = stub(tmp_path, "lm-torchrun")
    env = script_env(tmp_path, NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="65535")
    subprocess.run(["bash", "launch/multi_node.sh", "--train.steps=1"], cwd=REPO, env=env, check=True, timeout=60)
    assert "--rdzv_endpoint=127.0.0.1:65535" in calls(torchrun)[0]
