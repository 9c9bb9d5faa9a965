"""A mixture's sources (data.mixture): each value's range is checked in one table, and a bad one is named by its
place in the list and its key; what the loader already refuses (a weight that is no finite number) keeps its
message."""

import pytest

from lm.config import load_config
from lm.data.config import DataConfig, MixtureSource
from lm.errors import ConfigError


def mixture(entries: str) -> list[MixtureSource]:
    return load_config(None, [f"--data.mixture={entries}"]).data.mixture


def test_good_sources_pass_with_their_defaults():
    sources = mixture("[{dir: data/plays}, {dir: /corpora/kjv/, weight: 0, name: bible.v1}, {dir: d, weight: 1e308}]")
    assert [(s.dir, s.weight, s.name) for s in sources] == [
        ("data/plays", 1.0, "plays"), ("/corpora/kjv/", 0.0, "bible.v1"), ("d", 1e308, "d")]


@pytest.mark.parametrize("entries, message", [
    ("[{dir: a}, {dir: b, weight: -1}]", "data.mixture[1].weight: expected a finite number >= 0, got -1.0"),
    ("[{dir: a, weight: -1e-300}]", "data.mixture[0].weight: expected a finite number >= 0, got -1e-300"),
    ("[{dir: ''}]", "data.mixture[0].dir: missing; each entry names the directory lm.prepare wrote"),
    ("[{dir: a}, {weight: 2}]", "data.mixture[1].dir: missing; each entry names the directory lm.prepare wrote"),
    ("[{dir: a}, {dir: '  '}]", "data.mixture[1].dir: expected a non-empty string, got '  '"),
    ("[{dir: a, name: 'x y'}]", "data.mixture[0].name: expected a name of letters, digits, '_', '.' and '-' (it "
                                "names the source's metrics), got 'x y'"),
    ("[{dir: /}]", "data.mixture[0].name: expected a name of letters"),  # the directory's last part is empty
    ("[{dir: a, weight: .nan}]", "data.mixture[0].weight: must be a finite number, got nan"),  # the loader's
    ("[{dir: a, weight: [1]}]", "data.mixture[0].weight: expected float, got list [1]"),
], ids=["negative", "tiny-negative", "empty-dir", "no-dir", "blank-dir", "name", "root-dir", "nan", "list"])
def test_a_bad_value_is_named_by_its_place_and_key(entries, message):
    with pytest.raises(ConfigError) as err:
        mixture(entries)
    assert str(err.value).startswith(message)


def test_a_source_built_in_code_is_checked_too():
    with pytest.raises(ConfigError, match=r"^weight: expected a finite number >= 0, got nan$"):
        MixtureSource(dir="a", weight=float("nan"))


@pytest.mark.parametrize("arg, message", [
    ("--data.val_fraction=1.0", r"data.val_fraction: must be in \[0, 1\), got 1.0"),  # no document left to train on
    ("--data.seq_len=0", "data.seq_len: must be positive, got 0"),
    ("--data.shard_tokens=0", "data.shard_tokens: must be positive, got 0"),
    ("--data.num_workers=-1", r"data.num_workers: must be 0 \(one per core\) or positive, got -1"),
])
def test_a_data_value_at_the_edge_of_its_range_is_refused(arg, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [arg])


def test_the_edges_themselves_that_are_in_range_pass():
    data = load_config(None, ["--data.val_fraction=0", "--data.seq_len=1", "--data.num_workers=0"]).data
    assert (data.val_fraction, data.seq_len, data.num_workers) == (0.0, 1, 0)


def test_two_mixture_sources_of_one_name_are_refused():
    # both would log as val/plays/loss: the second is named by its directory's last part too
    with pytest.raises(ConfigError, match=r"data.mixture: 'a/plays' and 'b/plays' share the name 'plays'; give one "
                                          r"of them another `name`"):
        load_config(None, ["--data.mixture=[{dir: a/plays}, {dir: b/plays}]"])
    sources = load_config(None, ["--data.mixture=[{dir: a/plays}, {dir: b/plays, name: plays2}]"]).data.mixture
    assert [s.name for s in sources] == ["plays", "plays2"]


def test_mixture_weights_that_sum_to_zero_are_refused():
    with pytest.raises(ConfigError, match=r"data.mixture: the weights sum to 0; give at least one source a positive "
                                          r"weight"):
        load_config(None, ["--data.mixture=[{dir: a, weight: 0}, {dir: b, weight: 0}]"])


def test_a_negative_val_fraction_is_refused():
    with pytest.raises(ConfigError, match=r"^data.val_fraction: must be in \[0, 1\), got -0.1$"):
        load_config(None, ["--data.val_fraction=-0.1"])


def test_a_blank_source_is_refused():
    with pytest.raises(ConfigError, match=r"^data.source: must name a corpus or files, got an empty string$"):
        DataConfig(source="   ")


@pytest.mark.parametrize("name", ["-x", "_x", ".x", ".."])
def test_a_source_name_must_start_with_a_letter_or_digit(name):
    with pytest.raises(ConfigError, match=rf"^name: expected a name of letters, digits, '_', '.' and '-' \(it names "
                                          rf"the source's metrics\), got '{name}'$"):
        MixtureSource(dir="a", name=name)
    assert MixtureSource(dir="a", name="x_." + name).name == "x_." + name


@pytest.mark.parametrize("escape", ["\\n", "\\r", "\\t", "\\f"])
def test_every_backslash_escape_typed_as_two_characters_is_refused(escape):
    with pytest.raises(ConfigError, match=r"^data.document_separator: '.*' holds a backslash escape as two "):
        DataConfig(document_separator=f"<{escape}>")
    assert DataConfig(document_separator="\f").document_separator == "\f"  # the character itself is fine
