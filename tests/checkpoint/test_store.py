import dataclasses
import threading
import time
from functools import partial

import pytest
import torch

from lm.checkpoint import store
from lm.checkpoint.manifest import verify_checkpoint
from lm.checkpoint.resume import check_compatible, load_checkpoint
from lm.checkpoint.store import (
    BackgroundSaves,
    checkpoint_root,
    complete_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.errors import CheckpointError, ConfigError
from lm.models.registry import family_of
from lm.training.setup import build_run_engine
from lm.training.step import train_step

TINY = ["--model.n_layer=1", "--model.n_head=2", "--model.d_model=16", "--model.block_size=16", "--data.seq_len=8"]


def setup(seed=0):
    """A ddp engine (one process) after one optimizer step, so AdamW has state to save."""
    cfg = load_config(None, [*TINY, f"--train.seed={seed}"])
    engine = build_run_engine(cfg, family_of(cfg.model), init_distributed("cpu"))
    one_step(cfg, engine, torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long))
    return cfg, engine


def one_step(cfg, engine, x: torch.Tensor, y: torch.Tensor) -> None:
    """One optimizer step of `engine` on the micro-batch (x, y)."""
    loss = partial(family_of(cfg.model).training.loss, optim=cfg.optim)
    train_step(engine, loss, [[x, y]], cfg.optim.lr, cfg.optim.grad_clip)


def test_save_keeps_the_newest_and_ignores_incomplete(tmp_path):
    cfg, engine = setup()
    env = init_distributed("cpu")
    root = checkpoint_root(tmp_path)
    for step in (1, 2, 3):
        save_checkpoint(root, step, engine, {"step": step, "tokens_seen": 0, "position": step}, cfg, env, keep=2)
    (root / "step_00000009.tmp").mkdir()  # a save that crashed half-way
    (root / "step_00000008").mkdir()  # a directory without state.json is not complete either
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000002", "step_00000003"]
    assert resolve_checkpoint(tmp_path).name == "step_00000003"  # run dir
    assert resolve_checkpoint(root).name == "step_00000003"  # checkpoints dir
    assert resolve_checkpoint(root / "step_00000002").name == "step_00000002"  # one step
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path / "elsewhere")


def test_load_restores_model_optimizer_and_rng(tmp_path):
    cfg, engine = setup(seed=0)
    env = init_distributed("cpu")
    torch.manual_seed(123)
    path = save_checkpoint(tmp_path, 5, engine, {"step": 5, "tokens_seen": 40, "position": 7}, cfg, env, keep=1)
    expected_draw = torch.rand(3)
    _, other = setup(seed=1)
    state = load_checkpoint(path, other, env)
    assert state == {"step": 5, "tokens_seen": 40, "position": 7, "world_size": 1, "engine": "ddp"}
    assert torch.equal(torch.rand(3), expected_draw)
    for a, b in zip(engine.model.state_dict().values(), other.model.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(engine.optimizer.state_dict()["state"][0]["exp_avg"],
                       other.optimizer.state_dict()["state"][0]["exp_avg"])


def test_model_shape_change_is_refused_with_the_keys(tmp_path):
    cfg, engine = setup()
    path = save_checkpoint(tmp_path, 1, engine, {"step": 1, "tokens_seen": 0, "position": 0}, cfg,
                           init_distributed("cpu"), keep=1)
    check_compatible(path, load_config(None, TINY + ["--model.dropout=0.1", "--optim.lr=1e-3"]))
    with pytest.raises(ConfigError, match=r"model.n_layer: 1 -> 2.*another train.out_dir"):
        check_compatible(path, load_config(None, TINY + ["--model.n_layer=2"]))


@pytest.mark.parametrize("failure", [
    OSError(28, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
    "dcp",
])
def test_any_failed_save_removes_its_own_tmp_and_names_the_intact_previous_checkpoint(tmp_path, failure):
    import torch.distributed.checkpoint as dcp

    cfg, engine = setup()
    env = init_distributed("cpu")
    root = checkpoint_root(tmp_path)
    save_checkpoint(root, 1, engine, {"step": 1, "tokens_seen": 0, "position": 1}, cfg, env, keep=2)
    if failure == "dcp":  # DCP's own exception, a BaseException holding each rank's error
        failure = dcp.CheckpointException("save failed", {0: (OSError(28, "No space left on device"), None)})
    save = engine.save

    def save_half_then_fail(directory):
        save(directory)  # the shard is written, as far as the disk allowed
        raise failure

    engine.save = save_half_then_fail
    with pytest.raises(CheckpointError, match=rf"saving step 2 failed \(.*; [\d,]+ MiB free there\); the previous "
                                              rf"checkpoint {root}/step_00000001 is intact"):
        save_checkpoint(root, 2, engine, {"step": 2, "tokens_seen": 0, "position": 2}, cfg, env, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # nothing half-written stays
    assert resolve_checkpoint(root).name == "step_00000001"


def hold_writes(engine, directory: str | None = None) -> threading.Event:
    """Make the engine's background writes (of `directory` only, if given) wait until the returned event is set."""
    held, write = threading.Event(), engine.write_staged

    def held_write(staged, to):
        if directory is None or to.name == directory:
            held.wait(timeout=60)
        write(staged, to)

    engine.write_staged = held_write
    return held


def test_a_background_save_writes_its_step_state_and_publishes_it_once_written(tmp_path):
    cfg, engine = setup()
    env = init_distributed("cpu")
    root = checkpoint_root(tmp_path)
    saves = BackgroundSaves(root, env)
    saves.save(1, engine, {"step": 1, "tokens_seen": 0, "position": 1}, cfg, keep=2)
    saves.wait()
    held = hold_writes(engine)
    torch.manual_seed(5)
    saves.save(2, engine, {"step": 2, "tokens_seen": 8, "position": 2}, cfg, keep=2)
    expected_draw = torch.rand(3)
    saved = {k: v.clone() for k, v in engine.model.state_dict().items()}
    saved_avg = engine.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    # training goes on while the write waits: the copy in host memory is what is written
    one_step(cfg, engine, torch.ones(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    assert not torch.equal(engine.optimizer.state_dict()["state"][0]["exp_avg"], saved_avg)
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000001"]
    assert (root / "step_00000002.tmp").is_dir()
    held.set()
    saves.wait()
    saves.close()
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000001", "step_00000002"]
    assert not (root / "step_00000002.tmp").exists()
    _, other = setup(seed=1)
    state = load_checkpoint(root / "step_00000002", other, env)  # checks the manifest's hashes
    assert state == {"step": 2, "tokens_seen": 8, "position": 2, "world_size": 1, "engine": "ddp"}
    assert torch.equal(torch.rand(3), expected_draw)
    for name, value in other.model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    assert torch.equal(other.optimizer.state_dict()["state"][0]["exp_avg"], saved_avg)


def test_a_failed_background_write_is_raised_at_the_next_wait_naming_the_intact_previous_checkpoint(tmp_path):
    cfg, engine = setup()
    env = init_distributed("cpu")
    root = checkpoint_root(tmp_path)
    saves = BackgroundSaves(root, env)
    saves.save(1, engine, {"step": 1, "tokens_seen": 0, "position": 1}, cfg, keep=2)
    write = engine.write_staged

    def write_half_then_fail(staged, directory):
        write(staged, directory)
        raise OSError(28, "No space left on device")

    engine.write_staged = write_half_then_fail
    saves.save(2, engine, {"step": 2, "tokens_seen": 0, "position": 2}, cfg, keep=2)  # waits for step 1's write
    with pytest.raises(CheckpointError, match=rf"saving step 2 failed \(No space left on device; [\d,]+ MiB free "
                                              rf"there\); the previous checkpoint {root}/step_00000001 is intact"):
        saves.wait()
    saves.close()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]


def test_a_failed_background_write_removes_its_tmp_at_once(tmp_path):
    """Training goes on until the next save: a full disk must not stay full under it (TensorBoard died of it)."""
    cfg, engine = setup()
    root = checkpoint_root(tmp_path)
    saves = BackgroundSaves(root, init_distributed("cpu"))
    write = engine.write_staged

    def write_half_then_fail(staged, directory):
        write(staged, directory)
        raise OSError(28, "No space left on device")

    engine.write_staged = write_half_then_fail
    saves.save(1, engine, {"step": 1, "tokens_seen": 0, "position": 1}, cfg, keep=2)
    deadline = time.monotonic() + 30
    while (root / "step_00000001.tmp").exists():  # before any wait
        assert time.monotonic() < deadline, "the failed write's .tmp is still there"
        time.sleep(0.05)
    with pytest.raises(CheckpointError, match=r"saving step 1 failed \(No space left on device; [\d,]+ MiB free "
                                              r"there\); no earlier checkpoint was lost"):
        saves.wait()
    saves.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_old_checkpoint_that_cannot_be_deleted_is_a_warning_not_a_failed_save(mode, tmp_path, monkeypatch,
                                                                                 caplog):
    cfg, engine = setup()
    env = init_distributed("cpu")
    root = checkpoint_root(tmp_path)
    rmtree = store.shutil.rmtree

    def stuck(path, ignore_errors=False):  # an old checkpoint holding a file this user may not delete
        if str(path).endswith(".deleting") and not ignore_errors:
            raise PermissionError(1, "Operation not permitted", "config.yaml")
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(store.shutil, "rmtree", stuck)
    saves = BackgroundSaves(root, env)
    for step in (1, 2, 3):
        state = {"step": step, "tokens_seen": 0, "position": step}
        if mode == "sync":
            save_checkpoint(root, step, engine, state, cfg, env, keep=1)
        else:
            saves.save(step, engine, state, cfg, keep=1)
            saves.wait()
    saves.close()
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000003"]
    for step in (1, 2):  # named as it is left, renamed aside
        assert (f"{root}/step_0000000{step}.deleting: could not delete this old checkpoint (Operation not permitted); "
                "the next save tries again") in caplog.text


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_that_cannot_make_its_directory_names_the_intact_checkpoint(mode, tmp_path, monkeypatch):
    cfg, engine = setup()
    env = init_distributed("cpu")
    root = checkpoint_root(tmp_path)
    save_checkpoint(root, 1, engine, {"step": 1, "tokens_seen": 0, "position": 1}, cfg, env, keep=2)

    def read_only(root):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(store, "_clean_leftovers", read_only)
    state = {"step": 2, "tokens_seen": 0, "position": 2}
    with pytest.raises(CheckpointError, match=rf"saving step 2 failed \(Read-only file system; [\d,]+ MiB free "
                                              rf"there\); the previous checkpoint {root}/step_00000001 is intact"):
        if mode == "sync":
            save_checkpoint(root, 2, engine, state, cfg, env, keep=2)
        else:
            BackgroundSaves(root, env).save(2, engine, state, cfg, keep=2)


def test_the_next_background_save_waits_for_the_write_in_progress_and_both_are_published_whole(tmp_path):
    """checkpoint.async writes one checkpoint at a time: the save of step 2 waits for step 1's write (whose .tmp the
    new save's cleanup of killed saves' leftovers would otherwise delete under it) and both end published, with
    every file, each restoring the RNG state it was saved with."""
    cfg, engine = setup()
    env = init_distributed("cpu")
    root = checkpoint_root(tmp_path)
    saves = BackgroundSaves(root, env)
    held = hold_writes(engine, "step_00000001.tmp")
    torch.manual_seed(1)
    saves.save(1, engine, {"step": 1, "tokens_seen": 0, "position": 1}, cfg, keep=2)
    draw_after_1 = torch.rand(3)
    release = threading.Timer(1.0, held.set)  # step 1's write finishes a second from now
    release.start()
    torch.manual_seed(2)
    saves.save(2, engine, {"step": 2, "tokens_seen": 8, "position": 2}, cfg, keep=2)
    draw_after_2 = torch.rand(3)
    # save(2) returned only once step 1 was written and published
    assert held.is_set()
    assert [p.name for p in complete_checkpoints(root)][:1] == ["step_00000001"]
    saves.wait()
    saves.close()
    release.join()
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    for step, draw in ((1, draw_after_1), (2, draw_after_2)):
        _, other = setup(seed=1)
        path = root / f"step_{step:08d}"
        assert (path / "rng_rank0.pt").is_file()
        verify_checkpoint(path)  # every file there, as its manifest lists it
        assert load_checkpoint(path, other, env)["step"] == step
        assert torch.equal(torch.rand(3), draw)


def test_another_world_size_starts_the_rng_fresh(tmp_path, caplog):
    # rank r of the new world is not rank r of the old: no rank takes over an RNG state saved by another layout
    cfg, engine = setup()
    env = init_distributed("cpu")
    root = checkpoint_root(tmp_path)
    torch.manual_seed(1)
    path = save_checkpoint(root, 1, engine, {"step": 1, "tokens_seen": 0, "position": 1}, cfg, env, keep=1)
    saved_draw = torch.rand(3)
    torch.manual_seed(2)
    fresh_draw = torch.rand(3)
    torch.manual_seed(2)
    assert load_checkpoint(path, engine, dataclasses.replace(env, world_size=2))["step"] == 1
    assert torch.equal(torch.rand(3), fresh_draw) and not torch.equal(fresh_draw, saved_draw)
    assert "world size changed (1 -> 2): RNG states start fresh" in caplog.text
    assert load_checkpoint(path, engine, env)["step"] == 1  # the same world size: the state saved
    assert torch.equal(torch.rand(3), saved_draw)
