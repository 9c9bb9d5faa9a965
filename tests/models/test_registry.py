"""The registry of model families: built-in ones found by name without importing torch, unknown names refused
with a did-you-mean, a spec checked whole when registered, a broken LM_FAMILIES module one error line naming it,
and configs of older lm versions (every family's keys in one model section) still read."""

import dataclasses
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import yaml

from lm.checkpoint.loading import load_for_inference
from lm.cli import run
from lm.config import config_from_yaml, load_config
from lm.errors import ConfigError
from lm.models import registry
from lm.models.family import HFAdapter, Parallel, Sampler, TaskHead
from lm.models.gpt.config import GPTConfig
from lm.models.registry import config_class, family_names, get_family, register, spec_problems
from lm.train import main as train_main
from tests.conftest import PLUGIN_SPEC, write_plugin
from tests.test_bad_inputs import digest

REPO = Path(__file__).resolve().parents[2]

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
    with pytest.raises(ValueError, match="model family 'gpt' is already registered: it is a built-in family"):
        register(get_family("gpt"))


@dataclasses.dataclass
class MineConfig(GPTConfig):
    arch: str = "mine"
    title: ClassVar[str] = "my GPT"


@dataclasses.dataclass(kw_only=True)
class NeedsKeyConfig(GPTConfig):
    arch: str = "mine"
    width: int


def mine(**changes) -> object:
    return dataclasses.replace(get_family("gpt"), **{"name": "mine", "config_class": MineConfig, **changes})


def test_every_built_in_spec_passes_the_check():
    for name in ("gpt", "encdec", "encoder", "lstm"):
        assert spec_problems(get_family(name)) == [], name


def test_a_good_spec_registers_once(plugin_dir):
    register(mine())
    assert get_family("mine").config_class is MineConfig and config_class("mine") is MineConfig
    with pytest.raises(ConfigError, match=rf"^model family 'mine' is already registered \(by module "
                                          rf"'{re.escape(__name__)}'\); register a family once"):
        register(mine())


@pytest.mark.parametrize("changes, problem", [
    (dict(build=None), "build: expected a callable, got None"),
    (dict(blocks="blocks"), "blocks: expected a callable, got str 'blocks'"),
    (dict(config_class=None), "config_class: expected a dataclass subclassing lm.models.config.ModelConfig, got None"),
    (dict(config_class=GPTConfig), "config_class: GPTConfig.arch defaults to 'gpt', not the family's name 'mine'"),
    (dict(config_class=NeedsKeyConfig), "config_class: NeedsKeyConfig's keys ['width'] have no default"),
    (dict(name=""), "name: expected a model.arch value (letters, digits, '_', '-', '.'), got ''"),
    (dict(name="my model"), "got 'my model'"),
    (dict(name="7"), "name: YAML reads '7' as the int 7, so model.arch could not name the family; expected a name "
                     "YAML reads as text"),
    (dict(name="on"), "name: YAML reads 'on' as the bool True"),
    (dict(training=None), "training: expected Training, got None"),
    (dict(parallel=Parallel(tensor_problem=None)), "parallel.tensor_problem: expected a callable, got None"),
    (dict(sampler=Sampler(sample=None)), "sampler.sample: expected a callable, got None"),
    (dict(sampler="text"), "sampler: expected Sampler or None, got str 'text'"),
    (dict(hf=HFAdapter(targets=None)), "hf.targets: expected tuple, got None"),
    (dict(output_layers=None, check_precision=None), "output_layers: expected a callable, got None; "
                                                     "check_precision: expected a callable, got None"),
])
def test_a_broken_spec_is_refused_when_registered_naming_each_part(plugin_dir, changes, problem):
    family = mine(**changes)
    problems = [problem]
    if "training" not in changes:  # a part of a part is checked too, and every problem is named in one message
        family = dataclasses.replace(family, training=dataclasses.replace(
            family.training, head=TaskHead(keys=("head",), is_param=None, outputs=len)))  # type: ignore[arg-type]
        problems.append("training.head.is_param: expected a callable, got None")
    before = dict(registry._registered)
    with pytest.raises(ConfigError) as refused:
        register(family)
    message = str(refused.value)
    assert message.startswith(f"model family {family.name!r}: ") and all(p in message for p in problems), message
    assert registry._registered == before


def test_what_is_not_a_family_is_refused(plugin_dir):
    with pytest.raises(ConfigError, match=r"model family 'mine': expected a lm.models.family.Family instance, got "
                                          r"SimpleNamespace"):
        register(types.SimpleNamespace(name="mine", build=None))  # type: ignore[arg-type]


PLUGINS = {
    "raises": ("raise RuntimeError('no GPU here')\n",
               r"LM_FAMILIES: importing 'plug_raises' raised RuntimeError: no GPU here \(.*/plug_raises.py, line 1\)"),
    "syntax": ("def family(:\n", r"LM_FAMILIES: 'plug_syntax' has a syntax error: .* \(.*/plug_syntax.py, line 1\)"),
    "builtin": ("from lm.models.registry import get_family, register\nregister(get_family('gpt'))\n",
                r"LM_FAMILIES: 'plug_builtin': model family 'gpt' is already registered: it is a built-in family; "
                r"give yours another name"),
    "twice": (PLUGIN_SPEC.format(name="mine") + "register(FAMILY)\nregister(FAMILY)\n",
              r"LM_FAMILIES: 'plug_twice': model family 'mine' is already registered \(by module 'plug_twice'\)"),
    "no-build": (PLUGIN_SPEC.format(name="mine") + "register(dataclasses.replace(FAMILY, build=None))\n",
                 r"LM_FAMILIES: 'plug_no_build': model family 'mine': build: expected a callable, got None$"),
    "no-config-class": ("from lm.models.family import Family\nFAMILY = Family(name='mine', build=len, blocks=len, "
                        "training=None)\n",
                        r"LM_FAMILIES: importing 'plug_no_config_class' raised TypeError: .*missing 1 required "
                        r"positional argument: 'config_class' \(.*/plug_no_config_class.py, line 2\)"),
    "register-then-raise": (PLUGIN_SPEC.format(name="mine") + "register(FAMILY)\nraise ValueError('half done')\n",
                            r"LM_FAMILIES: importing 'plug_register_then_raise' raised ValueError: half done"),
}


@pytest.mark.parametrize("kind", PLUGINS)
def test_a_broken_plugin_stops_a_dry_run_of_any_preset_in_one_line(plugin_dir, monkeypatch, capsys, kind):
    """The user's case: a plugin named in LM_FAMILIES breaks even `--dry-run` of a preset of a built-in family, with
    one error line naming the module (and the family), exit 2, nothing written and nothing left registered."""
    source, error = PLUGINS[kind]
    module = "plug_" + kind.replace("-", "_")
    write_plugin(plugin_dir, module, source)
    monkeypatch.setenv("LM_FAMILIES", module)
    monkeypatch.chdir(plugin_dir.parent)  # a tool that wrote by a relative path would write in the hashed tree
    before, registered = digest(plugin_dir.parent), dict(registry._registered)
    code = run(train_main, ["--config", str(REPO / "configs/demo.yaml"), "--dry-run"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert re.search(error, lines[0]), lines[0]
    assert digest(plugin_dir.parent) == before and registry._registered == registered
    with pytest.raises(ConfigError, match="LM_FAMILIES: "):  # and the next lookup again, not a half-loaded registry
        family_names()


def test_two_plugins_registering_one_name_name_both_modules(plugin_dir, monkeypatch, capsys):
    write_plugin(plugin_dir, "plug_first", PLUGIN_SPEC.format(name="mine") + "register(FAMILY)\n")
    write_plugin(plugin_dir, "plug_second", PLUGIN_SPEC.format(name="mine") + "register(FAMILY)\n")
    monkeypatch.setenv("LM_FAMILIES", "plug_first, plug_second")
    assert run(train_main, ["--config", str(REPO / "configs/demo.yaml"), "--dry-run"]) == 2
    assert capsys.readouterr().err == ("error: LM_FAMILIES: 'plug_second': model family 'mine' is already registered "
                                       "(by module 'plug_first'); register a family once, under a name of its own\n")


def test_a_good_plugin_and_a_module_named_twice_load_once(plugin_dir, monkeypatch, capsys):
    write_plugin(plugin_dir, "plug_good", PLUGIN_SPEC.format(name="mine") + "register(FAMILY)\n")
    monkeypatch.setenv("LM_FAMILIES", "plug_good,plug_good,")
    assert family_names()[-1] == "mine" and family_names().count("mine") == 1
    assert load_config(None, ["--model.arch=mine", "--model.n_layer=2"]).model.title == "a plugin's GPT"
    assert run(train_main, ["--config", str(REPO / "configs/demo.yaml"), "--model.arch=mine", "--dry-run"]) == 0
    assert capsys.readouterr().err == ""


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


def test_a_plugin_family_is_found_by_the_first_config_lookup(plugin_dir, monkeypatch):
    # nothing has listed the families yet: reading a config is the first lookup, and must load LM_FAMILIES itself
    write_plugin(plugin_dir, "plug_first_lookup", PLUGIN_SPEC.format(name="mine") + "register(FAMILY)\n")
    monkeypatch.setenv("LM_FAMILIES", "plug_first_lookup")
    cfg = load_config(None, ["--model.arch=mine", "--model.n_layer=2"])
    assert cfg.model.arch == "mine" and cfg.model.title == "a plugin's GPT" and cfg.model.n_layer == 2
    assert config_class("mine") is type(cfg.model)


@dataclasses.dataclass
class ListConfig(GPTConfig):
    arch: str = "mine"
    title: ClassVar[str] = "my listed GPT"
    extras: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class UntitledConfig(GPTConfig):
    arch: str = "mine"
    title: ClassVar[object] = 5


def test_a_part_of_the_wrong_type_is_one_problem_not_one_per_part_below_it():
    family = mine(config_class=ListConfig, sampler="text")
    assert spec_problems(family) == ["sampler: expected Sampler or None, got str 'text'"]


def test_a_key_with_a_default_factory_has_a_default():
    assert spec_problems(mine(config_class=ListConfig)) == []


def test_a_title_that_is_not_a_str_is_named():
    assert spec_problems(mine(config_class=UntitledConfig)) == [
        "config_class: UntitledConfig.title: expected a str (how messages name the family), got int 5"]


def test_a_plugin_whose_own_import_fails_leaves_nothing_registered_and_fails_again(plugin_dir, monkeypatch):
    write_plugin(plugin_dir, "plug_half", PLUGIN_SPEC.format(name="mine") + "register(FAMILY)\n"
                 "import plug_no_such_helper\n")
    monkeypatch.setenv("LM_FAMILIES", "plug_half")
    before = dict(registry._registered)
    message = "LM_FAMILIES: cannot import 'plug_half': No module named 'plug_no_such_helper'"
    with pytest.raises(ConfigError) as first:
        family_names()
    assert str(first.value) == message
    assert registry._registered == before
    with pytest.raises(ConfigError) as again:
        family_names()
    assert str(again.value) == message


def test_a_plugins_error_of_several_lines_is_told_in_one(plugin_dir, monkeypatch):
    write_plugin(plugin_dir, "plug_lines", "raise RuntimeError('first line\\n  second line')\n")
    monkeypatch.setenv("LM_FAMILIES", "plug_lines")
    with pytest.raises(ConfigError) as err:
        family_names()
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("LM_FAMILIES: importing 'plug_lines' raised RuntimeError: first line second "
                                     "line (")
