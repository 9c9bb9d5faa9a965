"""Seeded random inputs for the files lm reads but did not write, through the real tools.

Each case puts values of random types and sizes under keys the project reads (a YAML config and its mixture,
a sweep grid, a tokenizer.json, a labelled file, a model family plugin) and random numbers and output paths on
lm.train_tokenizer's command line, and asserts the contract of `lm.cli.run`: exit 0 with a correct result, or
exit 2 with exactly one `error:` line (after argparse's usage, for its own errors); never a traceback; and the
files the tool was given, and the workspace around them, byte-identical afterwards. Hugging Face config.json
files have theirs in tests/hf/test_config_schema.py (and the keys a file can hold twice, read against transformers
itself, in tests/hf/test_random_config_keys.py), the tools' own inputs theirs in tests/test_random_prepare.py
(corpora), tests/test_random_finetune.py (labelled files) and tests/test_layouts.py (lm.layouts' --layout lists).
The seeds are fixed, so a failure here replays exactly.
"""

import dataclasses
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from lm.cli import run
from lm.config import JobConfig
from lm.data.labelled import read_labelled
from lm.errors import LMError
from lm.models import registry
from lm.prepare import main as prepare_main
from lm.sweep.__main__ import main as sweep_main
from lm.train import main as train_main
from lm.train_tokenizer import main as train_tokenizer_main
from tests.conftest import PLUGIN_SPEC, write_plugin
from tests.test_bad_inputs import digest, only_error_line

REPO = Path(__file__).resolve().parents[1]
CASES = {"config": 80, "grid": 40, "tokenizer": 24, "labelled": 40, "tokenizer_flags": 24, "plugin": 16}
"""How many random cases each kind of input gets (README's figure of inputs tried counts them)."""

# Values of every YAML/JSON type and of awkward sizes
VALUES = [None, True, False, 0, 1, 2, 3, -1, 7, 64, 2**31, 10**30, 0.0, 0.5, 1e-6, -0.5, 1e308, float("inf"),
          float("nan"), "", "2", "auto", "gpt", "x" * 300, [], [1], ["a", 2], {}, {"dir": "d"}]


def _keys() -> list[tuple[str, str]]:
    cfg = JobConfig()
    return [(section.name, key.name) for section in dataclasses.fields(cfg)
            for key in dataclasses.fields(getattr(cfg, section.name))]


def random_config(rng: random.Random) -> dict:
    """configs/demo.yaml with 1 to 3 keys set to random values, a mixture entry's parts included."""
    raw = yaml.safe_load((REPO / "configs/demo.yaml").read_text())
    keys = [*_keys(), ("data", "mixture.weight"), ("data", "mixture.dir"), ("data", "mixture.name")]
    for section, key in rng.sample(keys, rng.randint(1, 3)):
        value = rng.choice(VALUES)
        if key.startswith("mixture."):
            entry = {"dir": "data", "weight": 1.0, key.split(".")[1]: value}
            raw.setdefault("data", {})["mixture"] = [entry, {"dir": "data2", "weight": 1.0}]
        else:
            raw.setdefault(section, {})[key] = value
    return raw


def assert_contract(code: int, err: str, label: object) -> None:
    assert "Traceback" not in err, (label, err)
    assert code in (0, 2), (label, code, err)
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "error: " in lines[0], (label, err)


def call(main, argv: list[str]) -> int:
    try:
        return run(main, argv)
    except SystemExit as exit_:  # argparse's usage errors
        return exit_.code


@pytest.fixture()
def workspace(tiny_data_dir, tmp_path, monkeypatch) -> Path:
    (tmp_path / "data").symlink_to(tiny_data_dir)
    monkeypatch.chdir(tmp_path)  # anything written by a relative path lands in the hashed tree
    return tmp_path


@pytest.mark.slow
def test_random_configs_are_planned_or_refused_in_one_line(workspace, capsys):
    """lm.train --dry-run reads the whole config (its family's keys, the mixture, every range) and writes
    nothing, valid or not."""
    rng = random.Random(0)
    for i in range(CASES["config"]):
        raw = random_config(rng)
        path = workspace / f"config_{i}.yaml"
        path.write_text(yaml.safe_dump(raw))
        before = digest(workspace)
        code = call(train_main, ["--config", str(path), "--dry-run"])
        assert_contract(code, capsys.readouterr().err, raw)
        assert digest(workspace) == before, raw


def test_random_sweep_grids_are_refused_in_one_line_before_any_run(workspace, capsys):
    """A grid of random keys and values: refused, or (all valid) listed by --dry-run; no run directory made."""
    rng = random.Random(1)
    keys = [f"{s}.{k}" for s, k in _keys()] + ["nokey", "model", "model.", ".lr"]
    for i in range(CASES["grid"]):
        values = ",".join(str(rng.choice(VALUES)) for _ in range(rng.randint(1, 3)))
        grid = f"{rng.choice(keys)}={values}"
        before = digest(workspace)
        code = call(sweep_main, ["--config", str(REPO / "configs/demo.yaml"), "--grid", grid, "--dry-run",
                                 "--out", str(workspace / f"sweep_{i}")])
        assert_contract(code, capsys.readouterr().err, grid)
        assert digest(workspace) == before, grid


def _corrupt(node: object, rng: random.Random) -> object:
    """`node` (parsed JSON) with one value somewhere below it replaced by a random one."""
    if isinstance(node, dict) and node and rng.random() < 0.8:
        key = rng.choice(list(node))
        return {**node, key: _corrupt(node[key], rng)}
    if isinstance(node, list) and node and rng.random() < 0.8:
        i = rng.randrange(len(node))
        return [*node[:i], _corrupt(node[i], rng), *node[i + 1:]]
    return rng.choice(VALUES)


@pytest.mark.slow
def test_random_tokenizer_files_prepare_or_are_refused_in_one_line(workspace, tokenizer_jsons, capsys):
    rng = random.Random(2)
    (workspace / "corpus.txt").write_text("Fair is foul, and foul is fair. " * 20)
    sources = sorted(tokenizer_jsons.items())
    for i in range(CASES["tokenizer"]):
        kind, source = sources[i % len(sources)]
        spec = workspace / f"tok_{i}" / "tokenizer.json"
        spec.parent.mkdir()
        spec.write_text(json.dumps(_corrupt(json.loads(source.read_text()), rng)))
        before = digest(workspace)
        out = workspace / f"prepared_{i}"
        code = call(prepare_main, ["--data.source=corpus.txt", f"--data.tokenizer={spec}", f"--data.dir={out}",
                                   "--data.num_workers=1", "--data.val_fraction=0"])
        assert_contract(code, capsys.readouterr().err, (kind, i))
        after = digest(workspace)
        if code == 0:  # a tokenizer that still loads: its shards, and nothing else, are new
            after = {k: v for k, v in after.items() if not k.startswith(out.name)}
        assert after == before, (kind, i)


LABELS = [0, 1, 1.0, 1.5, -1, 2, "1", "one", "", None, True, [1], {"a": 1}, float("nan"), 10**30]
TEXTS = ["a line", "", "x" * 300, 0, 1.5, None, True, ["a"], {"t": "a"}, "comma, \"quoted\"\nline"]


def _write_labelled(path: Path, rows: list[dict]) -> None:
    if path.suffix == ".csv":
        import csv

        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["text", "label"])
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.slow
def test_random_labelled_files_are_read_or_refused_with_their_name(tmp_path):
    rng = random.Random(3)
    for i in range(CASES["labelled"]):
        rows = [{"text": rng.choice(TEXTS), "label": rng.choice(LABELS)} for _ in range(rng.randint(1, 4))]
        path = tmp_path / f"rows_{i}{rng.choice(['.csv', '.jsonl', '.json'])}"
        _write_labelled(path, rows)
        before = path.read_bytes()
        kind = rng.choice(["classify", "regress"])
        try:
            texts, labels = read_labelled(path, "text", "label", kind, num_classes=2, every_class=False)
        except LMError as err:
            assert str(path) in str(err) and "\n" not in str(err), (rows, err)
        else:
            assert all(isinstance(t, str) for t in texts) and len(labels) == len(texts) == len(rows), rows
            if kind == "classify":
                assert labels.dtype == np.int64 and set(labels.tolist()) <= {0, 1}, rows
            else:
                assert labels.dtype == np.float64 and np.isfinite(labels).all(), rows
        assert path.read_bytes() == before


VOCAB_SIZES = (["257", "300", "1048576"],
               ["0", "-1", "256", "1048577", "4294967296", str(10**26), "1e3", "nan", "inf", "-inf", "", "x",
                "9" * 5000])
"""--vocab-size values, (plausible, awkward): the ends of its range [257, 1048576], and beyond them (past u32, past
int64) and not numbers."""
TOKENIZER_OUTS = (["tok.json", "new/dir/tok.json", "t" * 241 + ".json"],
                  ["old.json", "dir.json", "corpus/a.txt", "corpus/a.txt/tok.json", "t" * 245 + ".json",
                   "d" * 256 + "/tok.json", "hf/tokenizer.json", "tok.txt", "", "/"])
"""--out values, (plausible, awkward): new (the longest name whose temporary name fits), or existing, a directory,
an input, below a file, a name whose temporary name is too long, a directory name too long, beside a
tokenizer_config.json, not .json, nothing, the root."""
SPECIAL_TOKENS = (["<|pad|>", "<|im_start|>", "x" * 300], ["", "<|endoftext|>", "<|pad|>"])


def pick(rng: random.Random, choices: tuple[list, list], odd: float) -> object:
    return rng.choice(choices[1] if rng.random() < odd else choices[0])


@pytest.fixture()
def tokenizer_workspace(tmp_path, monkeypatch) -> Path:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("To be, or not to be, that is the question. " * 8)
    (tmp_path / "corpus" / "b.txt").write_text("Whether 'tis nobler in the mind to suffer. " * 8)
    (tmp_path / "old.json").write_text("{}")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_random_tokenizer_flags_train_or_are_refused_in_one_line(tokenizer_workspace, capsys):
    """Random numbers for --vocab-size (huge, negative, non-finite, not numbers), special tokens and output paths
    that cannot be written: the tokenizer and nothing else is written, or one error line and nothing changes."""
    ws = tokenizer_workspace
    rng = random.Random(6)
    trained = 0
    for i in range(CASES["tokenizer_flags"]):
        odd = rng.choice([0.0, 0.2, 0.5])  # the rate of awkward choices: some cases are valid throughout
        out = pick(rng, TOKENIZER_OUTS, odd)
        argv = ["--data.source=corpus/*.txt", f"--data.val_fraction={rng.choice([0, 0.5])}",
                "--vocab-size", pick(rng, VOCAB_SIZES, odd), "--out", out]
        for _ in range(rng.choice([0, 0, 1, 2])):
            argv += ["--special-token", pick(rng, SPECIAL_TOKENS, odd)]
        argv += ["--force"] if rng.random() < 0.3 else []
        before = digest(ws)
        code = call(train_tokenizer_main, argv)
        err = capsys.readouterr().err
        assert "Traceback" not in err and code in (0, 2), (i, argv, code, err)
        after = digest(ws)
        if code == 2:
            only_error_line(err)
            assert after == before, (i, argv)
            continue
        trained += 1
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}  # none: same bytes again
        assert (ws / out).is_file() and all(out == k or out.startswith(k + "/") for k in changed), (i, argv, changed)
    assert trained >= CASES["tokenizer_flags"] // 8, trained  # enough cases are valid to test the results too


def random_plugin(rng: random.Random, i: int, plugins: Path) -> tuple[str, str, bool]:
    """A plugin module's name, the model.arch it means to add, and whether it is broken: the GPT's spec under a
    name (a built-in one at rate `odd`), then one or two statements: register it, or at rate `odd` something
    broken (register it with a part replaced by a random value, twice, or from a second module too; raise; a
    syntax error)."""
    odd = rng.choice([0.0, 0.3, 0.7])
    module, name = f"plug_r{i}", rng.choice(["gpt", "lstm"]) if rng.random() < odd / 2 else f"mine{i}"
    source, broken = PLUGIN_SPEC.format(name=name), name in ("gpt", "lstm")
    for _ in range(rng.randint(1, 2)):
        roll = rng.random() if rng.random() < odd else 1.0
        if roll < 0.4:
            part, value = rng.choice(["build", "blocks", "training", "parallel", "sampler", "hf", "estimates",
                                      "output_layers", "check_precision", "config_class", "name"]), rng.choice(VALUES)
            source += f"register(dataclasses.replace(FAMILY, {part}={value!r}))\n"
            broken = broken or not (part == "sampler" and value is None)
        elif roll < 0.6:
            write_plugin(plugins, module + "_b", PLUGIN_SPEC.format(name=name) + "register(FAMILY)\n")
            source += f"import {module}_b\nregister(FAMILY)\n"  # a second module registered the name first
            broken = True
        elif roll < 0.8:
            source += f"raise {rng.choice(['RuntimeError', 'KeyError', 'ImportError', 'OSError'])}('broken')\n"
            broken = True
        elif roll < 1.0:
            source += "def family(:\n"
            broken = True
        else:
            source += "register(FAMILY)\n"  # a second time: the name is taken, by this module
            broken = broken or "register(FAMILY)" in source[:-len("register(FAMILY)\n")]
    write_plugin(plugins, module, source)
    return module, name, broken


@pytest.mark.slow
def test_random_family_plugins_load_or_stop_the_tool_in_one_line_naming_them(plugin_dir, monkeypatch, capsys):
    """lm.train --dry-run of the demo preset, or of the plugin's own family, with a random plugin in LM_FAMILIES:
    a plugin that raises, does not parse, takes a taken name or registers a spec with a broken part stops the tool
    in one line that names it, before anything is read or written; a good one plans."""
    monkeypatch.chdir(plugin_dir.parent)
    rng = random.Random(7)
    saved = dict(registry._registered)
    planned = refused = 0
    for i in range(CASES["plugin"]):
        module, name, broken = random_plugin(rng, i, plugin_dir)
        monkeypatch.setenv("LM_FAMILIES", module)
        arch = [f"--model.arch={name}"] if rng.random() < 0.5 else []
        before = digest(plugin_dir.parent)
        code = call(train_main, ["--config", str(REPO / "configs/demo.yaml"), *arch, "--dry-run"])
        err = capsys.readouterr().err
        assert_contract(code, err, (i, name, broken))
        if broken:
            assert code == 2 and err.startswith("error: LM_FAMILIES: ") and module in err, (i, err)
        assert digest(plugin_dir.parent) == before, i
        planned, refused = planned + (code == 0), refused + broken
        registry._registered.clear()  # the next case starts from lm's own families, as a new process would
        registry._registered.update(saved)
        registry._plugins_loaded = False
    assert planned >= CASES["plugin"] // 4 and refused >= CASES["plugin"] // 4, (planned, refused)


def inputs_tried() -> tuple[int, int]:
    """(written by hand, seeded random): the bad and awkward inputs the suite puts through the tools."""
    from tests.hf.test_config_schema import BAD, RANDOM_CASES
    from tests.hf.test_random_config_keys import RANDOM_HF_KEY_CASES
    from tests.test_bad_inputs import CASES as WRITTEN
    from tests.test_bad_inputs import RANDOM_TOOL_CASES
    from tests.test_layouts import RANDOM_LAYOUT_CASES
    from tests.test_random_finetune import RANDOM_FINETUNE_CASES, RANDOM_PREDICT_CASES
    from tests.test_random_prepare import RANDOM_PREPARE_CASES

    drawn = (RANDOM_CASES + RANDOM_TOOL_CASES + RANDOM_PREPARE_CASES + RANDOM_FINETUNE_CASES + RANDOM_PREDICT_CASES
             + RANDOM_HF_KEY_CASES + RANDOM_LAYOUT_CASES)
    return len(WRITTEN) + len(BAD), sum(CASES.values()) + drawn


def test_the_readme_counts_the_inputs_the_suite_tries():
    written, drawn = inputs_tried()
    figure = re.search(r"\*\*Bad input\*\*: (\d+) inputs, (\d+) written by hand and (\d+) drawn at random",
                       (REPO / "README.md").read_text())
    assert figure is not None, "README.md: the Development section's **Bad input** figure is missing"
    assert tuple(map(int, figure.groups())) == (written + drawn, written, drawn)
