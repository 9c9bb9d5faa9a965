"""A checkpoint loaded for inference (`lm.checkpoint.loading.load_for_inference`)."""

import json
import shutil

import pytest
import torch

from lm.checkpoint.loading import load_for_inference
from lm.checkpoint.manifest import write_manifest
from lm.checkpoint.model_weights import load_checkpoint_weights
from lm.checkpoint.store import read_config, resolve_checkpoint
from lm.models.registry import family_of


def test_a_checkpoint_is_loaded_for_inference_in_eval_mode(trained_run):
    """Scoring and sampling must not run dropout (a model trained with model.dropout > 0 would score and sample
    differently on every call)."""
    model, _, _ = load_for_inference(trained_run, torch.device("cpu"))
    assert not model.training and not any(m.training for m in model.modules())


@pytest.mark.parametrize("engine", [None, "fsdp"])
def test_weights_load_from_a_checkpoint_of_either_dcp_engine_or_of_none_named(engine, trained_run, tmp_path):
    # ddp and fsdp both write DCP shards, and a checkpoint older than state.json's engine key was DDP's
    step_dir = tmp_path / "step"
    shutil.copytree(resolve_checkpoint(trained_run), step_dir)
    state = json.loads((step_dir / "state.json").read_text())
    state.pop("engine", None)
    if engine is not None:
        state["engine"] = engine
    (step_dir / "state.json").write_text(json.dumps(state))
    write_manifest(step_dir)
    cfg = read_config(step_dir).model
    model = family_of(cfg).build(cfg)
    load_checkpoint_weights(step_dir, model)
    expected, _, _ = load_for_inference(trained_run, torch.device("cpu"))
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
