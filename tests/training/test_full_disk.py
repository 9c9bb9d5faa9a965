"""A run directory on a real filesystem that is too small: a tmpfs of a few MiB, mounted for the test."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lm.config import load_config
from lm.plan.disk import checkpoint_bytes
from tests.training.test_faults import TINY, refused_run

MIB = 2**20


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of request.param MiB. Mounting needs root (CI's machine and the development machine run the
    suite as root); where it is not allowed the test cannot build its filesystem and is skipped."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def train(data_dir, out: Path, *extra: str) -> dict:
    """`lm.train` in the tests' 1-rank pool: its exit code ("value"), "stdout" and "stderr"."""
    return refused_run(1, data_dir, out, *extra)[0]


def test_the_probe_counts_what_a_checkpoint_writes():
    # the tied head is written under both its names: the estimate must hold it twice
    assert checkpoint_bytes(load_config(None, TINY)) > 25 * MIB


@pytest.mark.process
@pytest.mark.parametrize("small_disk", [20], indirect=True)
def test_a_disk_too_small_for_one_checkpoint_is_refused_before_training(small_disk, tiny_data_dir):
    result = train(tiny_data_dir, small_disk / "run", "--train.steps=2")
    assert result["value"] == 2
    assert result["stderr"].strip().splitlines() == [
        f"error: train.out_dir: {small_disk / 'run'} has 20 MiB free, less than one checkpoint needs (about "
        f"{checkpoint_bytes(load_config(None, TINY)) / MIB:,.0f} MiB)"]
    assert list(small_disk.iterdir()) == []


@pytest.mark.process
@pytest.mark.parametrize("small_disk", [40], indirect=True)
def test_a_disk_that_fills_up_fails_the_save_cleanly_and_frees_what_it_wrote(small_disk, tiny_data_dir):
    out = small_disk / "run"
    # step 2's checkpoint fits; step 4's does not while step 2's is kept
    result = train(tiny_data_dir, out, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=2")
    assert result["value"] == 2, result["stdout"] + result["stderr"]
    (line,) = result["stderr"].strip().splitlines()
    assert re.fullmatch(rf"error: {out / 'checkpoints'}: saving step 4 failed \(.* [\d,]+ MiB free there\); the "
                        rf"previous checkpoint {out / 'checkpoints/step_00000002'} is intact", line), line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]  # no .tmp left
    free = shutil.disk_usage(small_disk).free
    assert free > 10 * MIB  # the failed save's half is gone: the disk is not left full
    # the same command now stops before training: what is free is less than one more checkpoint
    again = train(tiny_data_dir, out, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=2")
    assert again["value"] == 2
    assert f"error: train.out_dir: {out} has {free / MIB:,.0f} MiB free, less than one checkpoint needs" in \
        again["stderr"]
    assert shutil.disk_usage(small_disk).free == free
