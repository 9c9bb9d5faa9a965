"""A config.json of the wrong types or ranges is refused by file and key before any family reads it: by
`read_hf_model`, and through the tools, as one `error:` line with exit 2 that leaves the file as it was."""

import json
import random
from pathlib import Path

import pytest
from transformers import AutoConfig

from lm.cli import run
from lm.errors import CheckpointError
from lm.eval import main as eval_main
from lm.hf.config_schema import KEYS, ROPE_KEYS
from lm.models.hf_checkpoint import read_hf_model

SMALL = {
    "llama": dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32),
    "gpt2": dict(vocab_size=300, n_positions=32, n_embd=64, n_layer=2, n_head=4),
}


def config_dir(model_type: str, directory: Path, edit: dict | None = None) -> Path:
    """A directory holding the config.json transformers writes for a small `model_type`, with `edit` applied
    (no weights: everything here is refused before any is read)."""
    AutoConfig.for_model(model_type, **SMALL[model_type]).save_pretrained(directory)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **(edit or {})}))
    return directory


@pytest.mark.parametrize("model_type", SMALL)
def test_the_files_transformers_writes_pass(model_type, tmp_path):
    assert read_hf_model(config_dir(model_type, tmp_path)).fields["vocab_size"] == 300


# (class, edit, the message's end): the examples a user met, then one of each kind of check
COUNT = "a positive integer up to 2147483647"
BAD = [
    ("llama", dict(rope_scaling="linear"), "rope_scaling: expected an object of settings or null, got 'linear'"),
    ("llama", dict(num_hidden_layers="2"), f"num_hidden_layers: expected {COUNT}, got '2'"),
    ("llama", dict(num_hidden_layers=True), f"num_hidden_layers: expected {COUNT}, got True"),
    ("llama", dict(hidden_size=2.0), f"hidden_size: expected {COUNT}, got 2.0"),
    ("llama", dict(intermediate_size=10**40), "intermediate_size: expected a positive integer"),
    ("llama", dict(rms_norm_eps=-1e-6), "rms_norm_eps: expected a finite number above 0, got -1e-06"),
    ("llama", dict(rope_theta=float("inf")), "rope_theta: expected a finite number above 0, got inf"),
    ("llama", dict(attention_dropout=1.5), "attention_dropout: expected a number from 0 to 1, got 1.5"),
    ("llama", dict(tie_word_embeddings="false"), "tie_word_embeddings: expected true or false, got 'false'"),
    ("llama", dict(num_key_value_heads=0), f"num_key_value_heads: expected {COUNT} or null"),
    ("llama", dict(architectures="LlamaForCausalLM"),
     "architectures: expected a list of strings, got 'LlamaForCausalLM'"),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
     "rope_parameters.rope_theta: expected a finite number above 0, got '1e4'"),
    ("llama", dict(rope_scaling={"type": 3}), "rope_scaling.type: expected a string, got 3"),
    ("gpt2", dict(n_inner="big"), f"n_inner: expected {COUNT} or null, got 'big'"),
    ("gpt2", dict(resid_pdrop=None), "resid_pdrop: expected a number from 0 to 1, got None"),
]


@pytest.mark.parametrize("model_type, edit, message", BAD, ids=[f"{t}-{next(iter(e))}" for t, e, _ in BAD])
def test_a_value_of_the_wrong_type_or_range_is_named_with_its_file_and_key(model_type, edit, message, tmp_path):
    with pytest.raises(CheckpointError) as err:
        read_hf_model(config_dir(model_type, tmp_path, edit))
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: ") and message in str(err.value)


RANDOM_CASES = 120
"""Seeded random config.json edits (the README's figure of inputs tried counts them)."""

# Values of every JSON type and of awkward sizes, to put under any key lm reads
VALUES = [None, True, False, 0, 1, 2, 3, -1, 7, 64, 2**31, 10**30, 0.0, 0.5, 1.0, 1e-6, -0.5, 1e308, float("inf"),
          float("nan"), "", "2", "silu", "default", "linear", [], [1], ["LlamaForCausalLM"], ["x", 2], {},
          {"rope_type": "llama3"}, {"factor": "2"}]


def random_edits(seed: int, cases: int) -> list[tuple[str, dict]]:
    """`cases` config.json edits of 1 to 3 keys that lm reads, nested rotary keys included, seeded."""
    rng = random.Random(seed)
    keys = [*KEYS, *(f"rope_parameters.{k}" for k in ROPE_KEYS)]
    edits = []
    for _ in range(cases):
        edit: dict = {}
        for key in rng.sample(keys, rng.randint(1, 3)):
            value = rng.choice(VALUES)
            outer, _, inner = key.partition(".")
            if inner:
                if not isinstance(edit.get(outer), dict):  # a nested key replaces a random value of its table
                    edit[outer] = {"rope_type": "default", "rope_theta": 1e4}
                edit[outer][inner] = value
            else:
                edit[key] = value
        edits.append((rng.choice(list(SMALL)), edit))
    return edits


def test_random_values_under_every_key_end_in_one_error_line_and_leave_the_file_alone(tmp_path, capsys):
    """The tools' contract, over RANDOM_CASES seeded random edits: exit 2 with one `error:` line naming config.json or
    (where the settings are valid) the missing weights, never a traceback, and config.json byte-identical."""
    for i, (model_type, edit) in enumerate(random_edits(seed=0, cases=RANDOM_CASES)):
        directory = config_dir(model_type, tmp_path / str(i), edit)
        before = (directory / "config.json").read_bytes()
        assert run(eval_main, ["--checkpoint", str(directory)]) == 2, edit
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and str(directory) in err[0], (edit, err)
        assert (directory / "config.json").read_bytes() == before


LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

# (class, edit, what the one error line names): two settings of one file that transformers may read differently
# from lm, or 4.x from 5. Each is refused, naming both keys, rather than read one way.
DISAGREEING = [
    # a transformers 5 save (rope_parameters: default) with the hand edit that extends the context
    ("llama", dict(rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_scaling and rope_parameters disagree: rope_type 'linear' against 'default'"),
    ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                   rope_scaling={"rope_type": "linear", "factor": 4.0}),
     "rope_scaling and rope_parameters disagree: factor 4.0 against 2.0"),
    # transformers 5 takes rope_scaling whole: rope_parameters' theta is lost, the default's taken
    ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
                   rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_scaling and rope_parameters disagree: rope_theta 10000.0 against 500000.0"),
    ("llama", dict(rope_theta=5e5), "rope_theta=500000.0 with rope_parameters.rope_theta=10000.0"),
    ("llama", dict(partial_rotary_factor=0.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                               "partial_rotary_factor": 1.0}),
     "partial_rotary_factor=0.5 with rope_parameters.partial_rotary_factor=1.0"),
    ("llama", dict(rope_parameters=None, rope_scaling={"type": "linear", "rope_type": "default", "factor": 2.0}),
     "rope_scaling.type='linear' with rope_scaling.rope_type='default'"),
    # transformers 5's Llama 3 frequencies take a top-level original context first (Phi-3's place for it)
    ("llama", dict(original_max_position_embeddings=16,
                   rope_parameters={**LLAMA3, "original_max_position_embeddings": 8}),
     "original_max_position_embeddings=16 with rope_parameters.original_max_position_embeddings=8"),
    ("llama", dict(rope_parameters={**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
     "rope_parameters.low_freq_factor=4.0 not below its high_freq_factor=1.0"),
    # GPT2Config's attribute_map: hidden_size is n_embd, and so on
    ("gpt2", dict(hidden_size=128), "n_embd=64 with hidden_size=128"),
    ("gpt2", dict(num_hidden_layers=3), "n_layer=2 with num_hidden_layers=3"),
    ("mixtral", dict(num_local_experts=4, num_experts=8), "num_local_experts=4 with num_experts=8"),
]
MIXTRAL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2)


def any_config_dir(model_type: str, directory: Path, edit: dict) -> Path:
    """`config_dir`, for the classes of SMALL and a small Mixtral."""
    if model_type in SMALL:
        return config_dir(model_type, directory, edit)
    AutoConfig.for_model(model_type, **MIXTRAL).save_pretrained(directory)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    return directory


@pytest.mark.parametrize("model_type, edit, message", DISAGREEING,
                         ids=[f"{t}-{'-'.join(e)}" for t, e, _ in DISAGREEING])
def test_two_settings_that_disagree_are_refused_naming_both(model_type, edit, message, tmp_path):
    with pytest.raises(CheckpointError) as err:
        read_hf_model(any_config_dir(model_type, tmp_path, edit))
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("model_type, edit, fields", [
    # what lm's export writes: both tables, the same, and the top-level rope_theta
    ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}, rope_theta=5e5,
                   rope_scaling={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}),
     dict(rope_scaling="linear", rope_factor=2.0, rope_theta=5e5)),
    # 4.x's table (type, no theta) beside the top-level theta it reads
    ("llama", dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5e5),
     dict(rope_scaling="linear", rope_factor=2.0, rope_theta=5e5)),
    ("llama", dict(rope_scaling={}), dict(rope_theta=1e4)),  # an empty table is none
    # only the alias: transformers reads it as n_embd
    ("gpt2", dict(hidden_size=64, num_attention_heads=4), dict(d_model=64, n_head=4)),
    ("mixtral", dict(num_experts=4), dict(n_experts=4)),
    # no rope_theta anywhere: the class's default, Mixtral's 1e6
    ("mixtral", dict(rope_parameters=None), dict(rope_theta=1e6)),
    ("llama", dict(rope_parameters=LLAMA3, original_max_position_embeddings=16), dict(rope_original_context=16)),
])
def test_two_settings_that_agree_are_read_as_one(model_type, edit, fields, tmp_path):
    read = read_hf_model(any_config_dir(model_type, tmp_path, edit)).fields
    assert {key: read[key] for key in fields} == fields


ABOVE_0 = "a finite number above 0"


# (class, edit, the whole message after the file's name): a zero where only a positive value is meaningful, and keys
# that only some classes read, checked whatever the class
REFUSED = [
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 0}),
     f"rope_parameters.rope_theta: expected {ABOVE_0}, got 0"),
    ("llama", dict(rope_parameters={**LLAMA3, "original_max_position_embeddings": 8, "low_freq_factor": 0}),
     f"rope_parameters.low_freq_factor: expected {ABOVE_0}, got 0"),
    ("gpt2", dict(layer_norm_epsilon=0), f"layer_norm_epsilon: expected {ABOVE_0}, got 0"),
    ("llama", dict(sliding_window="4096"), f"sliding_window: expected {COUNT} or null, got '4096'"),
    ("llama", dict(num_experts_per_tok="2"), f"num_experts_per_tok: expected {COUNT}, got '2'"),
]


@pytest.mark.parametrize("model_type, edit, message", REFUSED, ids=[f"{t}-{next(iter(e))}" for t, e, _ in REFUSED])
def test_a_value_out_of_range_is_named_with_its_file_and_key(model_type, edit, message, tmp_path):
    with pytest.raises(CheckpointError) as err:
        read_hf_model(config_dir(model_type, tmp_path, edit))
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: ") and message in str(err.value)


@pytest.mark.parametrize("edit", [dict(router_aux_loss_coef=0.0), dict(router_z_loss_coef=0.0),
                                  dict(quantization_config=None), dict(quantization_config={})],
                         ids=["aux-loss-0", "z-loss-0", "quantization-null", "quantization-empty"])
def test_settings_that_leave_the_forward_alone_pass(edit, tmp_path):
    assert read_hf_model(config_dir("llama", tmp_path, edit)).fields["vocab_size"] == 300
