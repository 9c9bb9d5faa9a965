"""Seeded random inputs for the files lm reads but did not write, through the real tools.

Each case puts values of random types and sizes under keys the project reads (a YAML config and its mixture,
a sweep grid, a tokenizer.json, a labelled file) and asserts the contract of `lm.cli.run`: exit 0 with a
correct result, or exit 2 with exactly one `error:` line; never a traceback; and the files the tool was
given, and the workspace around them, byte-identical afterwards. Hugging Face config.json files have theirs in
tests/hf/test_config_schema.py, the tools' own inputs theirs in tests/test_random_prepare.py (corpora) and
tests/test_random_finetune.py (labelled files). The seeds are fixed, so a failure here replays exactly.
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
from lm.prepare import main as prepare_main
from lm.sweep.__main__ import main as sweep_main
from lm.train import main as train_main
from tests.test_bad_inputs import digest

REPO = Path(__file__).resolve().parents[1]
CASES = {"config": 80, "grid": 40, "tokenizer": 24, "labelled": 40}
"""How many random cases each file kind gets (README's figure of inputs tried counts them)."""

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


def inputs_tried() -> tuple[int, int]:
    """(written by hand, seeded random): the bad and awkward inputs the suite puts through the tools."""
    from tests.hf.test_config_schema import BAD, RANDOM_CASES
    from tests.test_bad_inputs import CASES as WRITTEN
    from tests.test_bad_inputs import RANDOM_TOOL_CASES
    from tests.test_random_finetune import RANDOM_FINETUNE_CASES, RANDOM_PREDICT_CASES
    from tests.test_random_prepare import RANDOM_PREPARE_CASES

    drawn = RANDOM_CASES + RANDOM_TOOL_CASES + RANDOM_PREPARE_CASES + RANDOM_FINETUNE_CASES + RANDOM_PREDICT_CASES
    return len(WRITTEN) + len(BAD), sum(CASES.values()) + drawn


def test_the_readme_counts_the_inputs_the_suite_tries():
    written, drawn = inputs_tried()
    figure = re.search(r"\*\*Bad input\*\*: (\d+) inputs, (\d+) written by hand and (\d+) drawn at random",
                       (REPO / "README.md").read_text())
    assert figure is not None, "README.md: the Development section's **Bad input** figure is missing"
    assert tuple(map(int, figure.groups())) == (written + drawn, written, drawn)
