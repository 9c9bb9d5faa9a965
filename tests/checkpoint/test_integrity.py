"""Crash-safe checkpoints: manifests, verification, fallback to the previous checkpoint, retention, and
saves killed (SIGKILL, in a real subprocess) at each point of the save."""

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from lm.checkpoint.loading import load_for_inference
from lm.checkpoint.manifest import MANIFEST, verify_checkpoint, write_manifest
from lm.checkpoint.resume import latest_valid_checkpoint, load_checkpoint
from lm.checkpoint.store import checkpoint_root, complete_checkpoints, save_checkpoint
from lm.distributed.env import init_distributed
from lm.errors import CheckpointError
from tests.checkpoint.test_store import one_step, setup
from tests.workers import pool


def state(step: int) -> dict:
    return {"step": step, "tokens_seen": 8 * step, "position": step}


def train_one_more(cfg, engine) -> None:
    one_step(cfg, engine, torch.ones(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


def save_two(root: Path) -> tuple[Path, Path]:
    cfg, engine = setup()
    env = init_distributed("cpu")
    first = save_checkpoint(root, 1, engine, state(1), cfg, env, keep=2)
    train_one_more(cfg, engine)
    return first, save_checkpoint(root, 2, engine, state(2), cfg, env, keep=2)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def append(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0" * 10)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    for step_dir in save_two(tmp_path):
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
        on_disk = {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()}
        # state.json too: an edited step or loader position is caught like a damaged shard
        assert set(files) == on_disk - {MANIFEST}
        assert {".metadata", "__0_0.distcp", "rng_rank0.pt", "config.yaml", "state.json"} <= set(files)
        for rel, entry in files.items():
            data = (step_dir / rel).read_bytes()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        verify_checkpoint(step_dir)


def test_files_in_a_subdirectory_are_listed_and_checked(tmp_path):
    # a DeepSpeed checkpoint keeps its shards under deepspeed/: they are checked like the files beside state.json
    step_dir = tmp_path / "step_00000001"
    (step_dir / "deepspeed" / "global_step1").mkdir(parents=True)
    (step_dir / "state.json").write_text(json.dumps(state(1)))
    shard = step_dir / "deepspeed" / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"\1" * 64)
    write_manifest(step_dir)
    files = json.loads((step_dir / MANIFEST).read_text())["files"]
    assert set(files) == {"state.json", "deepspeed/global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    verify_checkpoint(step_dir)
    flip_byte(shard)
    with pytest.raises(CheckpointError, match=r"deepspeed/global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt: "
                                              r"sha256 differs"):
        verify_checkpoint(step_dir)


@pytest.mark.parametrize("damage, problem", [
    (truncate, r"[\d,]+ bytes, manifest says [\d,]+ \(truncated\)"),
    (append, r"[\d,]+ bytes, manifest says [\d,]+ \(longer than written\)"),
    (flip_byte, r"sha256 differs from the manifest \(corrupt\)"),
])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, caplog, damage, problem):
    first, second = save_two(tmp_path)
    damage(second / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=f"^{tmp_path}/step_00000002/__0_0.distcp: " + problem):
        verify_checkpoint(second)
    with caplog.at_level(logging.WARNING, logger="lm.checkpoint"):
        assert latest_valid_checkpoint(tmp_path) == first
    assert "step_00000002/__0_0.distcp" in caplog.text
    _, other = setup(seed=1)
    assert load_checkpoint(first, other, init_distributed("cpu"))["step"] == 1


def test_the_only_checkpoint_damaged_is_refused_with_the_file(tmp_path):
    cfg, engine = setup()
    only = save_checkpoint(tmp_path, 3, engine, state(3), cfg, init_distributed("cpu"), keep=1)
    flip_byte(only / "__0_0.distcp")
    with pytest.raises(CheckpointError,
                       match=f"no usable checkpoint in {tmp_path}: {tmp_path}/step_00000003/__0_0.distcp: "
                             "sha256 differs"):
        latest_valid_checkpoint(tmp_path)
    assert latest_valid_checkpoint(tmp_path / "empty") is None


def test_missing_extra_and_unverified_files(tmp_path, caplog):
    first, second = save_two(tmp_path)
    (second / "notes.txt").write_text("not in the manifest: ignored")
    verify_checkpoint(second)
    (second / "rng_rank0.pt").unlink()
    with pytest.raises(CheckpointError, match=f"^{tmp_path}/step_00000002/rng_rank0.pt: missing$"):
        verify_checkpoint(second)
    (first / MANIFEST).unlink()  # deleted, or a checkpoint from before manifests: nothing can be checked
    with pytest.raises(CheckpointError, match=r"step_00000001: no manifest.json, so its files cannot be checked.*"
                                              r"checkpoint.allow_unverified=true"):
        latest_valid_checkpoint(tmp_path)
    with caplog.at_level(logging.WARNING, logger="lm.checkpoint"):  # unless the run says to go on unchecked
        assert latest_valid_checkpoint(tmp_path, allow_unverified=True) == first
    assert "step_00000001: no manifest.json; its files are read unchecked" in caplog.text


def test_a_checkpoint_whose_state_json_was_deleted_is_reported_not_overlooked(tmp_path, caplog):
    first, second = save_two(tmp_path)
    (second / "state.json").unlink()  # published complete, so damaged since: skipped by name, not unseen
    with caplog.at_level(logging.WARNING, logger="lm.checkpoint"):
        assert latest_valid_checkpoint(tmp_path) == first
    assert f"skipping checkpoint {second}: {second}/state.json: missing" in caplog.text
    shutil.rmtree(first)  # the only one left: refused, where a run would otherwise start again from step 0
    with pytest.raises(CheckpointError, match=f"no usable checkpoint in {tmp_path}: .*state.json: missing"):
        latest_valid_checkpoint(tmp_path)


def test_a_shard_that_cannot_be_read_is_one_checkpoint_error(tmp_path):
    _, second = save_two(tmp_path)
    truncate(second / "__0_0.distcp")  # as resume reads it with checkpoint.allow_unverified: no manifest check
    _, other = setup(seed=1)
    with pytest.raises(CheckpointError, match=f"^{second}: cannot read the ddp checkpoint: "):
        load_checkpoint(second, other, init_distributed("cpu"))


def test_an_edited_state_json_is_caught_by_the_manifest(tmp_path):
    _, second = save_two(tmp_path)
    state_file = second / "state.json"
    state_file.write_text(state_file.read_text().replace('"position": 2', '"position": 3'))
    with pytest.raises(CheckpointError, match=r"step_00000002/state.json: sha256 differs from the manifest"):
        verify_checkpoint(second)


def test_a_state_json_edited_without_a_manifest_is_refused_by_key(tmp_path):
    # checkpoint.allow_unverified resumes one with no manifest: what resume reads from state.json is checked
    _, second = save_two(tmp_path)
    state_file = second / "state.json"
    _, other = setup(seed=1)
    for edit, message in ((lambda s: s.pop("position"), "position must be an integer >= 0, got None"),
                          (lambda s: s.update(world_size="2"), "world_size must be an integer >= 1, got '2'")):
        state_dict = json.loads(state_file.read_text())
        edit(state_dict)
        state_file.write_text(json.dumps(state_dict))
        with pytest.raises(CheckpointError, match=f"^{state_file}: {message}$"):  # was a KeyError, a TypeError
            load_checkpoint(second, other, init_distributed("cpu"))
        state_file.write_text(json.dumps({**state_dict, "position": 2, "world_size": 1}))


def test_load_for_inference_names_the_corrupt_file(tmp_path):
    cfg, engine = setup()
    save_checkpoint(checkpoint_root(tmp_path), 1, engine, state(1), cfg, init_distributed("cpu"), keep=1)
    truncate(checkpoint_root(tmp_path) / "step_00000001" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"step_00000001/__0_0.distcp: .*\(truncated\)"):
        load_for_inference(tmp_path, torch.device("cpu"))


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    cfg, engine = setup()
    env = init_distributed("cpu")
    names = lambda: [p.name for p in complete_checkpoints(tmp_path)]  # noqa: E731
    save_checkpoint(tmp_path, 2, engine, state(2), cfg, env, keep=1)
    save_checkpoint(tmp_path, 2, engine, state(2), cfg, env, keep=1)  # the same step again replaces it
    assert names() == ["step_00000002"]
    verify_checkpoint(tmp_path / "step_00000002")
    # a newer step left by a run that later resumed from an earlier checkpoint ranks below both
    save_checkpoint(tmp_path, 9, engine, state(9), cfg, env, keep=3)
    save_checkpoint(tmp_path, 4, engine, state(4), cfg, env, keep=2)
    assert names() == ["step_00000002", "step_00000004"]
    save_checkpoint(tmp_path, 9, engine, state(9), cfg, env, keep=3)
    save_checkpoint(tmp_path, 5, engine, state(5), cfg, env, keep=1)
    assert names() == ["step_00000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]


def test_retention_removes_a_damaged_checkpoint_before_a_good_one(tmp_path):
    """A step directory that lost its state.json is one resume skips: retention counts it last, so the good
    checkpoint a run resumed from is kept and the damaged one does not stay behind forever."""
    cfg, engine = setup()
    env = init_distributed("cpu")
    save_checkpoint(tmp_path, 2, engine, state(2), cfg, env, keep=3)
    damaged = save_checkpoint(tmp_path, 6, engine, state(6), cfg, env, keep=3)
    (damaged / "state.json").unlink()
    save_checkpoint(tmp_path, 4, engine, state(4), cfg, env, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000004"]


def _killed_save(point: str, root: str, log: str) -> None:
    """In a process of its own: save step 1 (keep=1), train one more step and save step 2, killing the process
    with SIGKILL at `point`. "replace" saves step 2 fully first and is killed while a second save of step 2
    replaces it. Before each save it writes the model weights it is saving, for the test to compare."""
    with open(log, "w") as out:
        os.dup2(out.fileno(), 2)  # whatever it prints before it dies, for the test's message
    import lm.checkpoint.store as store

    root_dir = Path(root)
    cfg, engine = setup()
    env = init_distributed("cpu")

    def save(step):
        torch.save(engine.model.state_dict(), root_dir.parent / f"weights_{step}.pt")
        store.save_checkpoint(root_dir, step, engine, state(step), cfg, env, keep=1)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def then_die(fn):
        def wrapped(*args, **kwargs):
            fn(*args, **kwargs)
            die()
        return wrapped

    save(1)
    train_one_more(cfg, engine)
    if point == "replace":
        save(2)
        train_one_more(cfg, engine)
        real_rename = Path.rename

        def rename(self, target):
            if self.name == "step_00000002.tmp":  # the old step_00000002 is already moved aside
                die()
            return real_rename(self, target)
        Path.rename = rename
        store.save_checkpoint(root_dir, 2, engine, state(2), cfg, env, keep=1)
    if point == "engine":
        engine.save = then_die(engine.save)
    elif point == "rng":
        store.save_config = die
    elif point == "manifest":
        store.write_manifest = then_die(store.write_manifest)
    elif point == "rename":
        store.publish_dir = die
    elif point == "prune":
        real_rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if str(path).endswith(".deleting"):
                (Path(path) / "__0_0.distcp").unlink()
                die()
            real_rmtree(path, *args, **kwargs)
        shutil.rmtree = rmtree
    save(2)


def killed_save(point: str, root: Path, log: Path) -> int | None:
    """`_killed_save` in a process forked from multiprocessing's fork server, which imports torch and lm once for
    all the cases (a fresh interpreter per case spent ~4 s of CPU importing them); its exit code."""
    forks = multiprocessing.get_context("forkserver")
    # read when the server starts, on the first case; by the names the server can import (pytest imports this
    # file as `test_integrity`, from a sys.path entry the server does not have: the child imports it, cheaply)
    forks.set_forkserver_preload(["lm.training.setup", "lm.checkpoint.store", setup.__module__])
    proc = forks.Process(target=_killed_save, args=(point, str(root), str(log)))
    proc.start()
    proc.join(timeout=300)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return proc.exitcode


@pytest.mark.process
@pytest.mark.parametrize("point, survivor", [
    ("engine", 1),    # after the engine's DCP files
    ("rng", 1),       # after every rank's RNG file
    ("manifest", 1),  # after manifest.json, before state.json
    ("rename", 1),    # after state.json, before the rename
    ("replace", 2),   # between moving the old step 2 aside and renaming the new one into place
    ("prune", 2),     # half-way through deleting step 1
])
def test_a_save_killed_at_any_point_leaves_a_valid_checkpoint(tmp_path, point, survivor):
    root = tmp_path / "checkpoints"
    code = killed_save(point, root, tmp_path / "killed.log")
    assert code == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
    path = latest_valid_checkpoint(root)
    assert path.name == f"step_{survivor:08d}"
    assert complete_checkpoints(root) == [path]  # nothing half-written or half-deleted looks complete
    cfg, fresh = setup(seed=1)
    env = init_distributed("cpu")
    assert load_checkpoint(path, fresh, env) == {**state(survivor), "world_size": 1, "engine": "ddp"}
    expected = torch.load(tmp_path / f"weights_{survivor}.pt", weights_only=True)
    for name, tensor in fresh.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # the next save clears whatever the killed one left behind
    save_checkpoint(root, 3, fresh, state(3), cfg, env, keep=2)
    assert sorted(p.name for p in root.iterdir()) == sorted({path.name, "step_00000003"})


def _choose(root: str) -> str:
    """In each rank of a 2-rank pool: the checkpoint it resumes from."""
    return latest_valid_checkpoint(Path(root), init_distributed("cpu")).name


@pytest.mark.process
def test_all_ranks_take_the_checkpoint_rank_0_verified(tmp_path):
    _, second = save_two(tmp_path)
    flip_byte(second / ".metadata")
    out = {reply["rank"]: reply["value"] for reply in pool(2).run(_choose, str(tmp_path))}
    assert out == {0: "step_00000001", 1: "step_00000001"}


def test_a_replaced_checkpoint_left_beside_its_successor_is_removed_by_the_next_save(tmp_path):
    """A kill after publish_dir's second rename, before it deleted the replaced copy, leaves step_X.replaced beside
    the new step_X: a whole checkpoint's worth of disk that the next save must clear (as it clears .tmp)."""
    _, second = save_two(tmp_path)
    shutil.copytree(second, tmp_path / "step_00000002.replaced")
    assert latest_valid_checkpoint(tmp_path) == second  # the new one stays, the aside copy is not restored over it
    cfg, engine = setup()
    train_one_more(cfg, engine)
    save_checkpoint(tmp_path, 3, engine, state(3), cfg, init_distributed("cpu"), keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002", "step_00000003"]

