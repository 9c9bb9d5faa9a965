"""The registry of model families: built-in ones found by name without importing torch, unknown names refused
with a did-you-mean, and configs of older lm versions (every family's keys in one model section) still read."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lm.checkpoint.loading import load_for_inference
from lm.config import config_from_yaml, load_config
from lm.errors import ConfigError
from lm.models.registry import config_class, family_names, get_family, register

OLD_MODEL_SECTION = dict(
    arch="gpt", vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_kv_head=0, d_model=768, d_ff=0,
    dropout=0.0, bias=True, qkv_bias=False, pos="learned", rope_theta=10000.0, norm="layernorm", norm_eps=1e-5,
    norm_position="pre", mlp="gelu", qk_norm=False, logit_softcap=0.0, tie_embeddings=True, share_embeddings=True,
    n_sentinels=100, vocab_multiple=64, head="mlm", num_classes=0, pooling="first", loss_chunk=0,
)
"""The model section lm wrote before each family had keys of its own: every key of every family."""


def test_the_built_in_families_are_found_by_name_and_know_their_config():
    assert family_names()[:4] == ["gpt", "encdec", "encoder", "lstm"]
    for name in ("gpt", "encdec", "encoder", "lstm"):
        family = get_family(name)
        assert family.name == name and family.config_class is config_class(name)
        assert family.config_class().arch == name and family.title == family.config_class.title


def test_an_unknown_family_is_refused_with_the_names_there_are():
    with pytest.raises(ConfigError, match=r"model.arch: unknown model family 'encoderr'; did you mean 'encoder'\? "
                                          r"expected one of \['gpt', 'encdec', 'encoder', 'lstm'"):
        get_family("encoderr")
    with pytest.raises(ConfigError, match=r"model.arch: unknown model family 7"):
        load_config(None, ["--model.arch=7"])


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="model family 'gpt' is already registered"):
        register(get_family("gpt"))


@pytest.mark.process
def test_reading_a_config_imports_no_torch():
    code = ("import sys; from lm.config import load_config; "
            "cfg = load_config('configs/demo-encdec.yaml', ['--model.n_layer=3']); "
            "assert cfg.model.n_layer == 3 and cfg.model.title == 'an encoder-decoder'; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.process
def test_lm_families_naming_a_module_that_is_not_there_is_one_error():
    result = subprocess.run([sys.executable, "-m", "lm.train", "--model.arch=mine", "--dry-run"], capture_output=True,
                            text=True, env={**os.environ, "LM_FAMILIES": "no_such_package.family"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: LM_FAMILIES: cannot import 'no_such_package.family': No module named 'no_such_package'"]


@pytest.mark.parametrize("arch, keys", [
    ("gpt", {}),
    ("lstm", {"d_model": 32, "n_layer": 2, "block_size": 256}),
])
def test_an_older_checkpoints_config_keeps_its_familys_keys(arch, keys):
    # an LSTM of an older lm carried n_head=12 it never read, and d_model 32 that 12 heads do not divide
    stored = {"model": {**OLD_MODEL_SECTION, "arch": arch, **keys}}
    cfg = config_from_yaml(yaml.safe_dump(stored), "step_00000004/config.yaml")
    assert cfg.model.arch == arch and type(cfg.model) is config_class(arch)
    assert all(getattr(cfg.model, key) == value for key, value in keys.items())
    # what the user writes is checked as ever: a key the family does not read is an error
    if arch == "lstm":
        with pytest.raises(ConfigError, match=r"model.n_head: not a key of an LSTM"):
            load_config(None, ["--model.arch=lstm", "--model.n_head=12"])


def test_a_checkpoint_written_by_an_older_lm_loads_and_scores_the_same(trained_run, tmp_path):
    import shutil

    from lm.checkpoint.manifest import MANIFEST

    run_dir = tmp_path / "old"
    shutil.copytree(trained_run, run_dir)
    step_dir = run_dir / "checkpoints" / "step_00000004"
    current = yaml.safe_load((step_dir / "config.yaml").read_text())
    # lm now writes its family's keys alone, among them keys added since (an older file lacks them: defaults)
    later = {"d_head", "nope_interval", "qk_norm_scope", "rope_scaling", "rope_factor", "rope_low_freq_factor",
             "rope_high_freq_factor", "rope_original_context", "n_experts", "experts_per_token", "n_shared_experts",
             "expert_d_ff", "moe_every", "moe_first_dense", "router", "router_renorm", "aux_loss_coef",
             "router_z_loss_coef", "router_bias_rate", "router_bias_update"}
    assert set(current["model"]) - later < set(OLD_MODEL_SECTION)
    old = {**current, "model": {**OLD_MODEL_SECTION, **{k: v for k, v in current["model"].items() if k not in later}}}
    (step_dir / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    (step_dir / MANIFEST).unlink()  # its hashes were of the new config.yaml; an older checkpoint may have none
    model, cfg, _ = load_for_inference(run_dir, torch.device("cpu"))
    reference, _, _ = load_for_inference(trained_run, torch.device("cpu"))
    idx = torch.arange(12)[None]
    with torch.no_grad():
        assert torch.equal(model.logits(model(idx)), reference.logits(reference(idx)))
    assert cfg.model == load_config(Path(trained_run) / "config.yaml").model
