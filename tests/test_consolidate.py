import dataclasses
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lm.checkpoint.consolidated import (
    consolidate,
    load_consolidated,
    load_consolidated_weights,
    read_consolidated_config,
)
from lm.checkpoint.loading import load_for_inference
from lm.checkpoint.model_weights import load_checkpoint_weights, load_model_weights, tied_names
from lm.checkpoint.store import read_config, resolve_checkpoint
from lm.config import JobConfig, load_config, save_config
from lm.consolidate import main
from lm.errors import CheckpointError, ConfigError
from lm.models.registry import family_of
from tests.workers import job_env, pool

TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32", "--data.seq_len=16"]


def _logits(model: torch.nn.Module, cfg: JobConfig) -> torch.Tensor:
    idx = torch.arange(8).reshape(1, 8) % cfg.model.vocab_size
    with torch.no_grad():
        if cfg.model.arch == "encdec":
            return model.logits(model(idx, idx))
        h = model(idx)
        if cfg.model.arch == "encoder":
            return model.task_outputs(h) if cfg.model.task_head else model.mlm_logits(h)
        return model.logits(h)


def _write_run(step_dir: Path, cfg: JobConfig, state: dict) -> None:
    """state.json and config.yaml as lm.checkpoint writes them beside an engine's files."""
    (step_dir / "state.json").write_text(json.dumps(state))
    save_config(cfg, step_dir / "config.yaml")


def _dcp_run(tmp_path: Path, overrides: list[str]) -> tuple[Path, torch.nn.Module]:
    """A one-process DCP checkpoint at step 3 of a fresh model, written without the engine key (older layout)."""
    import torch.distributed.checkpoint as dcp

    cfg = load_config(None, TINY + overrides)
    torch.manual_seed(0)
    model = family_of(cfg.model).build(cfg.model)
    step_dir = tmp_path / "run" / "checkpoints" / "step_00000003"
    step_dir.mkdir(parents=True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=step_dir)
    _write_run(step_dir, cfg, {"step": 3, "tokens_seen": 96, "position": 6, "world_size": 1})
    return step_dir, model


def test_dcp_checkpoint_consolidates_to_the_same_weights_and_logits(trained_run, tmp_path):
    out = tmp_path / "model.safetensors"
    step_dir = consolidate(trained_run, out)
    assert step_dir == resolve_checkpoint(trained_run)

    reference, cfg, _ = load_for_inference(trained_run, torch.device("cpu"))
    expected = family_of(cfg.model).build(cfg.model)
    load_model_weights(step_dir, expected)
    stored = load_file(out)
    # the head is tied to wte: stored once, under the embedding's name
    assert tied_names(expected) == {"lm_head.weight": "wte.weight"}
    assert set(stored) == set(expected.state_dict()) - {"lm_head.weight"}
    for name, tensor in expected.state_dict().items():
        if name != "lm_head.weight":
            assert stored[name].dtype == torch.float32 and torch.equal(stored[name], tensor), name

    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["step"] == "4" and meta["engine"] == "ddp"
    assert meta["source"] == str(step_dir.resolve()) and json.loads(meta["tied"]) == {"lm_head.weight": "wte.weight"}
    assert read_consolidated_config(out) == cfg

    model, loaded_cfg = load_consolidated(out, torch.device("cpu"))
    assert loaded_cfg == cfg and not model.training
    assert model.lm_head.weight is model.wte.weight
    assert torch.equal(_logits(model, cfg), _logits(reference, cfg))


@pytest.mark.parametrize("overrides", [
    ["--model.tie_embeddings=false"],
    ["--model.arch=encdec", "--model.pos=sinusoidal", "--model.mlp=relu"],
    ["--model.arch=encdec", "--model.share_embeddings=false", "--model.tie_embeddings=false"],
    ["--model.pos=rope", "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.bias=false", "--model.n_kv_head=1"],
    ["--model.arch=encoder"],
    ["--model.arch=encoder", "--model.head=classify", "--model.num_classes=3", "--task.file=rows.csv"],
], ids=["gpt-untied", "encdec-tied", "encdec-untied", "llama", "encoder-mlm", "encoder-classify"])
def test_every_model_round_trips_with_its_ties(tmp_path, overrides):
    step_dir, model = _dcp_run(tmp_path, overrides)
    cfg = load_config(None, TINY + overrides)
    out = tmp_path / "model.safetensors"
    consolidate(step_dir, out)
    stored = load_file(out)
    assert set(stored) == set(model.state_dict()) - set(tied_names(model))
    loaded, _ = load_consolidated(out, torch.device("cpu"))
    assert tied_names(loaded) == tied_names(model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(_logits(loaded, cfg), _logits(model.eval(), cfg))


def test_cli_refuses_an_existing_output_unless_forced(trained_run, tmp_path, capsys):
    out = tmp_path / "sub" / "model.safetensors"
    assert main(["--checkpoint", str(trained_run), str(out)]) == 0
    first = load_file(out)
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(trained_run), str(out)])
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["--checkpoint", str(trained_run), str(out), "--force"]) == 0
    assert load_file(out).keys() == first.keys()
    assert all(torch.equal(tensor, first[name]) for name, tensor in load_file(out).items())
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.safetensors"]  # no temporary file left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # readable like any file, not safetensors' 0600
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(trained_run), str(tmp_path / "model.pt")])
    assert "must be a .safetensors file" in capsys.readouterr().err


def test_bad_inputs_fail_with_one_error_naming_the_path(trained_run, tmp_path):
    out = tmp_path / "model.safetensors"
    inside = resolve_checkpoint(trained_run) / "model.safetensors"  # pruned with its step directory
    with pytest.raises(CheckpointError, match=f"{inside}: is inside the checkpoint {inside.parent}"):
        consolidate(trained_run, inside)
    with pytest.raises(CheckpointError, match=str(tmp_path / "nothing")):
        consolidate(tmp_path / "nothing", out)

    broken = tmp_path / "broken"
    shutil.copytree(resolve_checkpoint(trained_run), broken)
    shard = next(broken.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{shard}: 100 bytes, manifest says .* \\(truncated\\)"):
        consolidate(broken, out)
    (broken / "manifest.json").unlink()  # as written before checkpoints had one: read, and fail there
    with pytest.raises(CheckpointError, match=f"{broken}: cannot read the ddp checkpoint"):
        consolidate(broken, out)
    assert not out.exists() and list(tmp_path.glob(".*.tmp")) == []

    (broken / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{broken / 'state.json'}: unreadable"):
        consolidate(broken, out)

    state = json.loads((resolve_checkpoint(trained_run) / "state.json").read_text())
    (broken / "state.json").write_text(json.dumps({**state, "engine": "deepspeed", "zero_stage": 2}))
    with pytest.raises(CheckpointError, match=f"{broken}: state.json says engine deepspeed but there is no deepspeed/"):
        consolidate(broken, out)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=f"{garbage}: not a readable safetensors file"):
        load_consolidated(garbage, torch.device("cpu"))
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, foreign, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{foreign}: a safetensors file without an lm_config"):
        load_consolidated(foreign, torch.device("cpu"))
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'missing.safetensors'}: no such file"):
        load_consolidated(tmp_path / "missing.safetensors", torch.device("cpu"))

    # a file that lacks one of the model's tensors (pruned by hand, or of an older model) is refused: loaded, the
    # tensor would stay at its random initial values
    whole = tmp_path / "whole.safetensors"
    consolidate(trained_run, whole)
    with safe_open(str(whole), "pt") as f:
        metadata = f.metadata()
    weights = load_file(str(whole))
    missing = next(name for name in weights if name.startswith("blocks.0.") and name.endswith(".weight"))
    pruned = tmp_path / "pruned.safetensors"
    save_file({k: v for k, v in weights.items() if k != missing}, pruned, metadata=metadata)
    with pytest.raises(CheckpointError, match=f"{pruned}: its weights do not fit the model: .*{missing}"):
        load_consolidated(pruned, torch.device("cpu"))


# DeepSpeed: real ZeRO 1, 2 and 3 checkpoints (fp32, and bf16 with fp32 master weights) from a 2-process
# gloo group, consolidated on one process.

RUNS = [f"zero{stage}{dtype}" for dtype in ("", "-bf16") for stage in (1, 2, 3)]


def _deepspeed_job(root: str) -> None:
    """A job of the tests' 2-rank pool (tests/workers.py): every run of RUNS, one step and a save."""
    import deepspeed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(dist_backend="gloo")  # the pool's gloo group is up: DeepSpeed takes it
    for name in RUNS:
        stage, bf16 = int(name[4]), name.endswith("bf16")
        cfg = load_config(None, TINY + ["--parallel.engine=deepspeed", f"--parallel.zero_stage={stage}",
                                        f"--train.dtype={'bfloat16' if bf16 else 'float32'}"])
        torch.manual_seed(stage)
        model = family_of(cfg.model).build(cfg.model)
        # our own torch AdamW: a DeepSpeed optimizer type would build FusedAdam (~70 s)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
            config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                    "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "steps_per_print": 10**9},
        )
        idx = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
        loss = family_of(cfg.model).training.loss(model, engine, [idx, idx]).optimized
        engine.backward(loss)
        engine.step()
        step_dir = Path(root) / name / "checkpoints" / "step_00000001"
        engine.save_checkpoint(str(step_dir), tag="deepspeed")
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # whole tensors under ZeRO-3
            if rank == 0:
                expected = {key: p.detach().clone() for key, p in engine.module.named_parameters()}
        if rank == 0:
            torch.save(expected, step_dir.parent.parent / "expected.pt")
            _write_run(step_dir, cfg, {"step": 1, "tokens_seen": 64, "position": 2, "world_size": world,
                                       "engine": "deepspeed", "zero_stage": stage})
        deepspeed.comm.barrier()


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory) -> Path:
    """One run dir per name in RUNS: one step of a tiny GPT under DeepSpeed on 2 gloo processes, saved by
    `engine.save_checkpoint(step_dir, tag="deepspeed")` beside the state.json and config.yaml that
    lm.checkpoint writes, with the engine's parameters after the step (gathered) in expected.pt."""
    root = tmp_path_factory.mktemp("deepspeed")
    pool(2).run(_deepspeed_job, str(root), env=job_env())
    return root


@pytest.mark.process
@pytest.mark.parametrize("name", RUNS)
def test_deepspeed_checkpoint_consolidates_to_the_engine_parameters(deepspeed_runs, tmp_path, name):
    run = deepspeed_runs / name
    expected = torch.load(run / "expected.pt", weights_only=True)
    out = tmp_path / "model.safetensors"
    consolidate(run, out)

    stored = load_file(out)
    assert set(stored) == set(expected)  # named_parameters() yields the tied head once, as wte.weight
    for key, tensor in expected.items():
        assert stored[key].dtype == torch.float32, key
        # bf16: the file holds the fp32 master weights, which the engine's bf16 parameters are rounded from
        assert torch.equal(stored[key].to(tensor.dtype), tensor), key
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["engine"] == "deepspeed" and f.metadata()["step"] == "1"

    model, cfg = load_consolidated(out, torch.device("cpu"))
    assert cfg.parallel.zero_stage == int(name[4]) and model.lm_head.weight is model.wte.weight
    for key, tensor in stored.items():
        assert torch.equal(model.state_dict()[key], tensor), key
    if not name.endswith("bf16"):
        reference = family_of(cfg.model).build(cfg.model)
        reference.load_state_dict({**expected, "lm_head.weight": expected["wte.weight"]})
        assert torch.equal(_logits(model, cfg), _logits(reference.eval(), cfg))


@pytest.mark.process
def test_a_deepspeed_checkpoint_that_does_not_fill_the_model_is_refused(deepspeed_runs):
    # a model with a block the checkpoint lacks would keep that block's drawn weights: refused by name instead
    step_dir = resolve_checkpoint(deepspeed_runs / "zero2")
    cfg = read_config(step_dir).model
    deeper = family_of(cfg).build(dataclasses.replace(cfg, n_layer=3))
    refused = rf"(?s){step_dir}: cannot read the deepspeed checkpoint: .*Missing key.*blocks\.2\."
    with pytest.raises(CheckpointError, match=refused):
        load_checkpoint_weights(step_dir, deeper)


ONE_LAYER = ["--model.n_layer=1", "--model.n_head=2", "--model.d_model=16", "--model.block_size=8",
             "--data.seq_len=8"]


def tiny_model() -> torch.nn.Module:
    cfg = load_config(None, ONE_LAYER)
    torch.manual_seed(0)
    return family_of(cfg.model).build(cfg.model)


def test_a_stored_config_that_is_invalid_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, path, metadata={"format": "pt", "lm_config": "model:\n  n_layer: 0\n"})
    with pytest.raises(ConfigError) as err:
        read_consolidated_config(path)
    assert str(err.value) == f"{path}: the stored config is invalid: model.n_layer: must be positive, got 0"


def test_loading_weights_alone_refuses_a_file_that_is_not_a_consolidated_one(tmp_path):
    model = tiny_model()
    foreign = tmp_path / "foreign.safetensors"
    save_file({name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}, foreign,
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_consolidated_weights(foreign, model)
    assert str(err.value) == (f"{foreign}: a safetensors file without an lm_config entry in its metadata; "
                              "write one with `python -m lm.consolidate`")
    directory = tmp_path / "dir.safetensors"
    directory.mkdir()
    with pytest.raises(CheckpointError) as err:
        load_consolidated_weights(directory, model)
    assert str(err.value) == f"{directory}: no such file"
