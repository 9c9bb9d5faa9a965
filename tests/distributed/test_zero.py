"""DeepSpeed's own output on an error path: a JSON DeepSpeed refuses ends on lm's one error line, with nothing of
DeepSpeed's (its accelerator notice, its compiler checks, its op builds) before it."""

import json
import subprocess
import sys

import pytest

from tests.training.test_faults import TINY, run_env

# every test here runs lm.train under DeepSpeed in a process of its own: the full tier only
pytestmark = pytest.mark.process


def test_a_refused_deepspeed_json_prints_only_our_error_line(tiny_data_dir, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": "x"}}))
    done = subprocess.run([sys.executable, "-m", "lm.train", *TINY, f"--data.dir={tiny_data_dir}",
                           f"--train.out_dir={tmp_path / 'run'}", "--parallel.engine=deepspeed",
                           "--parallel.zero_stage=2", f"--parallel.deepspeed_config={ds}"],
                          env=run_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: parallel.deepspeed_config: "), done.stderr
    assert "reduce_bucket_size" in lines[0]


def test_a_non_finite_step_deepspeed_applied_stops_the_run_saying_so(tiny_data_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "lm.train", *TINY, f"--data.dir={tiny_data_dir}",
                           f"--train.out_dir={tmp_path / 'run'}", "--parallel.engine=deepspeed",
                           "--parallel.zero_stage=1", "--train.steps=3"],
                          env={**run_env(), "LM_FAULT_NAN_STEPS": "2"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "skipped" not in done.stdout + done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "error: step 2: a step with a non-finite loss or gradient norm, which deepspeed applied (it cannot skip one, "
        "so train.max_nonfinite_steps does not apply); the last good checkpoint is none")
