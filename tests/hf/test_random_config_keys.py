"""Seeded random config.json files whose keys can disagree, read by lm and by transformers itself.

Each file is one transformers writes (`save_pretrained`) with random edits to the settings that a file can hold
twice: the rotary tables rope_scaling and rope_parameters (random rope_type or type, theta, factor and Llama 3
keys, sometimes equal, sometimes not) against each other and against the top-level rope_theta,
partial_rotary_factor and original_max_position_embeddings; GPT-2's attribute_map aliases (n_embd and
hidden_size, ...); the two names of a mixture's number of experts. The contract is a differential one: lm refuses
the file in one CheckpointError line that starts with its path, or it reads it, and then its rotary frequencies,
rotary settings and sizes are the ones transformers resolves from the same file (`AutoConfig.from_pretrained`
and the class's rotary embedding, no weights). A file lm reads one way and transformers another fails here.
The seed is fixed, so a failure replays exactly.
"""

import copy
import importlib
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, PretrainedConfig

from lm.errors import CheckpointError
from lm.models.hf_checkpoint import read_hf_model
from lm.models.layers import rope_frequencies
from lm.models.registry import config_class
from tests.hf.test_config_schema import MIXTRAL, SMALL

RANDOM_HF_KEY_CASES = 400
"""Seeded random config.json files with keys that can disagree (the README's figure of inputs tried counts them)."""

ROTARY = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral", "olmoe": "Olmoe", "qwen3_moe": "Qwen3Moe",
          "smollm3": "SmolLM3"}
"""the rotary classes drawn: transformers.models.<type>.modeling_<type>.<name>RotaryEmbedding is what their
attention rotates by"""
EXPERTS = {key: value for key, value in MIXTRAL.items() if key != "num_local_experts"}
SIZES = {
    "gpt2": SMALL["gpt2"], "llama": SMALL["llama"], "mistral": SMALL["llama"],
    "smollm3": {**SMALL["llama"], "pad_token_id": None},  # its default pad id is outside a vocabulary of 300
    "mixtral": MIXTRAL, "olmoe": {**EXPERTS, "num_experts": 4},
    "qwen3_moe": {**EXPERTS, "num_experts": 4, "moe_intermediate_size": 48, "head_dim": 16},
}
"""small models of each class drawn"""
MIXTURES = ("mixtral", "olmoe", "qwen3_moe")
"""the classes with a number of experts under two names (num_local_experts, num_experts: one the alias)"""

ROPE_TYPES = {"default": 1, "linear": 3, "llama3": 4, "dynamic": 1, "yarn": 1}
"""the rotary types drawn, and their weights: lm reads the first three"""
THETAS = [10000.0, 10000, 500000.0, 1e6]
FACTORS = [1.0, 2.0, 4, 8.0, 0.5]
LOW_FREQ_FACTORS, HIGH_FREQ_FACTORS = [1.0, 1.0, 2.0, 4.0], [4.0, 4.0, 8.0, 1.0]
"""Llama 3's two bands: the low one mostly below the high one, as it must be"""
PARTIAL = [1.0, 1.0, 0.5]
CONTEXTS = [8, 16, 32, 64]
GPT2_ALIASES = {"n_embd": ("hidden_size", [32, 64, 128]), "n_layer": ("num_hidden_layers", [1, 2, 3]),
                "n_head": ("num_attention_heads", [2, 4, 8]), "n_positions": ("max_position_embeddings", [16, 32, 64])}
"""GPT2Config's attribute_map: each key, its alias and the values drawn for them"""


def rope_table(rng: random.Random) -> dict:
    """A rotary table of a random rope_type (under rope_type, type, or both, not always the same), with each
    setting there or not: the ones its type reads most of the time, the others now and then."""
    kind = rng.choices(list(ROPE_TYPES), weights=list(ROPE_TYPES.values()))[0]
    naming = rng.random()
    if naming < 0.6:
        table: dict = {"rope_type": kind}
    elif naming < 0.85:
        table = {"type": kind}  # transformers 4.x's name
    else:
        table = {"rope_type": kind, "type": rng.choice([kind, *ROPE_TYPES])}  # the same or not
    scaled, llama3 = kind != "default", kind == "llama3"
    for key, values, rate in (("rope_theta", THETAS, 0.6), ("factor", FACTORS, 0.9 if scaled else 0.1),
                              ("low_freq_factor", LOW_FREQ_FACTORS, 0.95 if llama3 else 0.1),
                              ("high_freq_factor", HIGH_FREQ_FACTORS, 0.95 if llama3 else 0.1),
                              ("original_max_position_embeddings", CONTEXTS, 0.4),
                              ("partial_rotary_factor", PARTIAL, 0.1)):
        if rng.random() < rate:
            table[key] = rng.choice(values)
    return table


def nudged(rng: random.Random, table: dict) -> dict:
    """`table` with one setting changed or dropped: a hand edit of one of two copies."""
    table = copy.deepcopy(table)
    key = rng.choice([*table, "rope_theta", "factor", "original_max_position_embeddings"])
    if key in table and rng.random() < 0.3:
        del table[key]
    else:
        table[key] = rng.choice({"rope_type": list(ROPE_TYPES), "type": list(ROPE_TYPES), "rope_theta": THETAS,
                                 "low_freq_factor": LOW_FREQ_FACTORS, "high_freq_factor": HIGH_FREQ_FACTORS,
                                 "original_max_position_embeddings": CONTEXTS,
                                 "partial_rotary_factor": PARTIAL}.get(key, FACTORS))
    return table


def edit_rotary(rng: random.Random, hf: dict) -> None:
    """The rotary settings of `hf` redrawn in place: rope_parameters kept, replaced, null, empty or gone;
    rope_scaling absent, null, empty, its own, the same as rope_parameters or one setting off it; the top-level
    rope_theta, partial_rotary_factor and original_max_position_embeddings absent, the same as a table's or not."""
    hf["max_position_embeddings"] = rng.choice([32, 64, 128])
    roll = rng.random()
    if roll < 0.6:
        hf["rope_parameters"] = rope_table(rng)
    elif roll < 0.65:
        hf["rope_parameters"] = rng.choice([None, {}])
    elif roll < 0.75:
        del hf["rope_parameters"]
    parameters = hf.get("rope_parameters") or {}
    roll = rng.random()
    if roll < 0.1:
        hf["rope_scaling"] = rng.choice([None, {}])
    elif roll < 0.2:
        hf["rope_scaling"] = rope_table(rng)
    elif roll < 0.6:
        hf["rope_scaling"] = copy.deepcopy(parameters)
    elif roll < 0.75:
        hf["rope_scaling"] = nudged(rng, parameters)
    tables = [table for table in (hf.get("rope_scaling"), parameters) if table]
    for key, values in (("rope_theta", THETAS), ("partial_rotary_factor", PARTIAL),
                        ("original_max_position_embeddings", CONTEXTS)):
        roll = rng.random()
        if roll < 0.12:
            hf[key] = rng.choice(values)
        elif roll < 0.45 and (same := [table[key] for table in tables if key in table]):
            hf[key] = rng.choice(same)
    if rng.random() < 0.2:
        hf["head_dim"] = rng.choice([None, 8, 16, 32])


def edit_aliases(rng: random.Random, hf: dict) -> None:
    """GPT-2's keys and their aliases in place: the key alone (changed or not), the alias alone, or both, the
    same or not."""
    for key, (alias, values) in GPT2_ALIASES.items():
        roll = rng.random()
        if roll < 0.2:
            hf[alias] = hf.pop(key) if rng.random() < 0.5 else rng.choice(values)
            hf.pop(key, None)
        elif roll < 0.4:
            hf[alias] = hf[key]
        elif roll < 0.6:
            hf[alias] = rng.choice(values)
        elif roll < 0.7:
            hf[key] = rng.choice(values)


def edit_experts(rng: random.Random, hf: dict) -> None:
    """A mixture's number of experts under the name transformers wrote, its alias, or both (the same or not)."""
    name = "num_local_experts" if "num_local_experts" in hf else "num_experts"
    alias = "num_experts" if name == "num_local_experts" else "num_local_experts"
    roll = rng.random()
    if roll < 0.25:
        hf[alias] = hf.pop(name)
    elif roll < 0.45:
        hf[alias] = hf[name]
    elif roll < 0.7:
        hf[alias] = rng.choice([2, 4, 8])
    hf["num_experts_per_tok"] = rng.choice([1, 2])


def random_files(seed: int, cases: int, bases: dict[str, dict]) -> list[tuple[str, dict]]:
    """`cases` config.json contents, seeded: transformers' own file of a random class (`bases`) with the keys
    that can disagree redrawn."""
    rng = random.Random(seed)
    files = []
    for _ in range(cases):
        model_type = rng.choice(list(bases))
        hf = copy.deepcopy(bases[model_type])
        if model_type == "gpt2":
            edit_aliases(rng, hf)
        else:
            edit_rotary(rng, hf)
        if model_type in MIXTURES:
            edit_experts(rng, hf)
        files.append((model_type, hf))
    return files


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, dict]:
    """The config.json transformers writes for a small model of each class drawn."""
    out = {}
    for model_type, sizes in SIZES.items():
        directory = tmp_path_factory.mktemp(model_type)
        AutoConfig.for_model(model_type, **sizes).save_pretrained(directory)
        out[model_type] = json.loads((directory / "config.json").read_text())
    return out


@pytest.fixture(scope="module")
def rotary_embeddings() -> dict[str, type[torch.nn.Module]]:
    """transformers' rotary embedding class of each of ROTARY (imported here: the modeling modules are slow to
    import, and only this test needs them)."""
    return {model_type: getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"),
                                f"{name}RotaryEmbedding") for model_type, name in ROTARY.items()}


Reference = tuple[PretrainedConfig, torch.nn.Module | None]
"""what transformers reads from a file: its config, and its rotary embedding (None for GPT-2)"""


def transformers_reads(directory: Path, embedding: type[torch.nn.Module] | None) -> Reference | None:
    """The config transformers loads from `directory` and the class's rotary `embedding` built from it as a model
    builds it (which may complete the rotary table again); None where transformers refuses the file."""
    try:
        config = AutoConfig.from_pretrained(directory)
        return config, embedding(config) if embedding is not None else None
    except Exception:  # noqa: BLE001 (the reference refuses in its own ways: KeyError, ValueError, ...)
        return None


def sizes_of(config: PretrainedConfig, model_type: str) -> dict[str, int]:
    """The sizes transformers took, under lm's names."""
    if model_type == "gpt2":
        return dict(vocab_size=config.vocab_size, d_model=config.n_embd, n_layer=config.n_layer,
                    n_head=config.n_head, block_size=config.n_positions)
    sizes = dict(vocab_size=config.vocab_size, d_model=config.hidden_size, n_layer=config.num_hidden_layers,
                 n_head=config.num_attention_heads, n_kv_head=config.num_key_value_heads,
                 block_size=config.max_position_embeddings,
                 head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    if model_type in MIXTURES:  # either name reads the one attribute (attribute_map)
        sizes |= dict(n_experts=config.num_experts, experts_per_token=config.num_experts_per_tok)
    return sizes


def rotary_settings_of(rope: dict) -> dict:
    """lm's rotary keys for what transformers' rotary embedding read (its config's completed rope_parameters)."""
    kind = rope["rope_type"]
    settings = {"rope_theta": float(rope["rope_theta"]), "rope_scaling": "none" if kind == "default" else kind}
    if kind in ("linear", "llama3"):
        settings["rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        settings |= {"rope_low_freq_factor": float(rope["low_freq_factor"]),
                     "rope_high_freq_factor": float(rope["high_freq_factor"]),
                     "rope_original_context": rope["original_max_position_embeddings"]}
    return settings


def test_random_disagreeing_keys_are_refused_or_read_as_transformers_reads_them(bases, rotary_embeddings,
                                                                               tmp_path):
    """Over RANDOM_HF_KEY_CASES seeded files: a refusal is one CheckpointError line starting with the file's path;
    a file lm reads gives the frequencies, rotary settings and sizes transformers gives, and is one transformers
    reads too."""
    read = refused = 0
    for i, (model_type, hf) in enumerate(random_files(seed=0, cases=RANDOM_HF_KEY_CASES, bases=bases)):
        directory = tmp_path / str(i)
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(hf))
        reference = transformers_reads(directory, rotary_embeddings.get(model_type))
        try:
            source = read_hf_model(directory)
        except CheckpointError as err:
            assert str(err).startswith(f"{directory / 'config.json'}: ") and "\n" not in str(err), (i, hf, err)
            refused += 1
            continue
        assert reference is not None, (i, "lm reads a file transformers refuses", hf)
        config, embedding = reference
        cfg = config_class(source.arch)(**source.fields)  # what lm builds from it: ConfigError fails the test
        ours = {key: getattr(cfg, key) for key in sizes_of(config, model_type)}
        assert ours == sizes_of(config, model_type), (i, hf)
        if embedding is not None:
            theirs = rotary_settings_of(config.rope_parameters)
            assert {key: getattr(cfg, key) for key in theirs} == theirs, (i, hf, config.rope_parameters)
            assert embedding.attention_scaling == 1.0, (i, hf)
            torch.testing.assert_close(rope_frequencies(cfg), embedding.inv_freq, rtol=1e-6, atol=0.0,
                                       msg=lambda m, i=i, hf=hf: f"{i} {hf}: {m}")
        read += 1
    # both outcomes are drawn often enough for each to be tested
    assert read >= RANDOM_HF_KEY_CASES // 5 and refused >= RANDOM_HF_KEY_CASES // 5, (read, refused)
