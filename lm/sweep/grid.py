"""Sweep grids: parse `KEY=V1,V2` items, expand them into runs, and name each run.

Pure functions: no run is started here. Every run of a sweep trains on the same data with the same seed and
token budget, so the keys that would change those are refused.
"""

import hashlib
import itertools
import json
import random

import yaml

from lm.errors import SweepError

# each run must see the same data, seed and token budget; train.out_dir is the sweep's to set
FIXED_KEYS = ("train.seed", "train.steps", "train.batch_size", "data.seq_len", "train.out_dir")


def parse_grid(items: list[str]) -> dict[str, list[object]]:
    """["model.n_layer=2,4", "optim.lr=3e-4,1e-3"] -> {"model.n_layer": [2, 4], "optim.lr": [0.0003, 0.001]}.

    Values are read as YAML scalars, like command-line overrides; types are checked later, against the config.
    """
    if not items:
        raise SweepError("--grid: empty; give at least one KEY=V1,V2,... (e.g. --grid model.n_layer=2,4)")
    grid: dict[str, list[object]] = {}
    for item in items:
        key, eq, text = item.removeprefix("--").partition("=")
        section, _, leaf = key.partition(".")
        if not eq or not section or not leaf:
            raise SweepError(f"--grid {item}: expected SECTION.KEY=V1,V2,... (e.g. model.n_layer=2,4)")
        if key in grid:
            raise SweepError(f"--grid {key}: given twice; list all its values in one item")
        if key in FIXED_KEYS or section == "data":
            raise SweepError(f"--grid {key}: every run of a sweep has the same data, seed, token budget and "
                             "directory; set it in the base config instead")
        texts = text.split(",")
        if any(not t.strip() for t in texts):
            raise SweepError(f"--grid {item}: empty value; expected comma-separated values like {key}=2,4")
        values = [scalar(t.strip()) for t in texts]
        if len(set(map(repr, values))) < len(values):
            raise SweepError(f"--grid {key}: a value is listed twice in {text!r}")
        grid[key] = values
    return grid


def scalar(text: str) -> object:
    """A grid value as YAML reads it (3e-3, which YAML 1.1 leaves a string, as a float), or the text itself
    where YAML would make a mapping, a list or null, or cannot read it at all (`['a`: the key's own check then
    names it)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return text if isinstance(value, (dict, list)) or value is None else value


def expand(grid: dict[str, list[object]], sample: int | None = None, seed: int = 0) -> list[dict[str, object]]:
    """Every combination of the grid's values, in order (the last key varies fastest), or `sample` of them
    drawn without replacement by a generator seeded with `seed` (kept in grid order)."""
    keys = list(grid)
    combos = [dict(zip(keys, values)) for values in itertools.product(*grid.values())]
    if sample is None:
        return combos
    if not 1 <= sample <= len(combos):
        raise SweepError(f"--random: {sample} runs asked for, but the grid has {len(combos)} combinations")
    picked = sorted(random.Random(seed).sample(range(len(combos)), sample))
    return [combos[i] for i in picked]


def overrides(combo: dict[str, object]) -> list[str]:
    """A combination as the command-line overrides lm.train takes."""
    return [f"--{key}={format_value(value)}" for key, value in combo.items()]


def format_value(value: object) -> str:
    """A value as it reads back through YAML to the same value (true, not True)."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def run_name(combo: dict[str, object], resolved: dict) -> str:
    """A readable, unique directory name: the grid values (leaf key names) and a hash of the whole resolved
    config, so a run of another base config (a sweep continued with --force) never reuses a directory."""
    digest = hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:8]
    label = "_".join(f"{key.rsplit('.', 1)[1]}={format_value(value)}" for key, value in combo.items())
    safe = "".join(c if c.isalnum() or c in "=._-" else "-" for c in label)
    return f"{safe}-{digest}"

