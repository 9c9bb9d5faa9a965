"""The schema walker: good values pass, and the first bad one is named by its origin and dotted key, with its
value shown short and what was expected, as the caller's error class."""

import pytest

from lm import schema
from lm.errors import CheckpointError, ConfigError
from lm.schema import MAX_COUNT, Each, Entries, Table, check, count, fraction, name, nonnegative, or_null, positive

TOKEN = Table({"id": schema.token_id, "content": name}, "an object with an id and its content")
SCHEMA = {
    "size": count,
    "rate": or_null(fraction),
    "scaling": or_null(Table({"factor": positive, "type": name})),
    "tokens": Each(TOKEN),
    "special": Entries(Table({"ids": Each(schema.token_id)})),
}
GOOD = {"size": 3, "rate": None, "scaling": {"factor": 2.0, "type": "linear", "other": "unread"},
        "tokens": [{"id": 0, "content": "<s>"}, {"id": 1, "content": "</s>", "special": True}],
        "special": {"<s>": {"ids": [0]}}, "unlisted": object()}


def test_good_values_and_unlisted_or_missing_keys_pass():
    check(GOOD, SCHEMA, "f.json", ConfigError)
    check({}, SCHEMA, "f.json", ConfigError)
    check({**GOOD, "scaling": None}, SCHEMA, "f.json", ConfigError)


@pytest.mark.parametrize("edit, message", [
    ({"size": "3"}, f"f.json: size: expected a positive integer up to {MAX_COUNT}, got '3'"),
    ({"size": True}, "size: expected a positive integer up to 2147483647, got True"),
    ({"rate": 1.5}, "f.json: rate: expected a number from 0 to 1 or null, got 1.5"),
    ({"scaling": "linear"}, "f.json: scaling: expected an object of settings or null, got 'linear'"),
    ({"scaling": {"factor": float("nan")}}, "f.json: scaling.factor: expected a finite number above 0, got nan"),
    ({"tokens": {"id": 0}}, "f.json: tokens: expected a list, got {'id': 0}"),
    ({"tokens": [{"id": 0, "content": "a"}, "b"]}, "f.json: tokens[1]: expected an object with an id and its "
                                                   "content, got 'b'"),
    ({"tokens": [{"id": -1, "content": "a"}]}, "f.json: tokens[0].id: expected a token id"),
    ({"special": {"<s>": {"ids": [0, "1"]}}}, "f.json: special.<s>.ids[1]: expected a token id"),
    ({"special": []}, "f.json: special: expected an object, got []"),
], ids=lambda v: str(v)[:30])
def test_the_first_bad_value_is_named_by_file_and_key(edit, message):
    with pytest.raises(CheckpointError) as err:
        check({**GOOD, **edit}, SCHEMA, "f.json", CheckpointError)
    assert message in str(err.value) and str(err.value).startswith("f.json: ")


def test_the_first_in_schema_order_is_named_and_long_values_are_cut():
    with pytest.raises(ConfigError, match=r"^f.json: size: .*got 'x'$"):
        check({"rate": 7, "size": "x"}, SCHEMA, "f.json", ConfigError)
    with pytest.raises(ConfigError) as err:
        check({"size": list(range(100))}, SCHEMA, "f.json", ConfigError)
    assert str(err.value).endswith("got [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16...")


def test_without_an_origin_the_message_starts_at_the_key():
    with pytest.raises(ConfigError, match=r"^weight: expected a finite number >= 0, got -1$"):
        check({"weight": -1}, {"weight": nonnegative}, None, ConfigError)


@pytest.mark.parametrize("check_, good, bad", [
    (schema.count, [1, MAX_COUNT], [0, -1, MAX_COUNT + 1, 1.0, True, "1", None]),
    (schema.positive, [1e-9, 3, 1e308], [0, -1e-9, float("inf"), float("nan"), 10**40, False, "1"]),
    (schema.nonnegative, [0, 0.0, 1e308], [-1e-300, float("nan"), "0"]),
    (schema.fraction, [0, 0.5, 1], [-0.1, 1.01, "0.5"]),
    (schema.flag, [True, False], [0, 1, "true", None]),
    (schema.name, ["", "x"], [1, None, ["x"]]),
    (schema.nonblank, ["x", " x "], ["", "  ", 1]),
    (schema.token_id, [0, 5], [-1, 1.0, True, "0", [0]]),
    (schema.token_ids, [0, [0, 1], []], [[0, "1"], -1, [True]]),
])
def test_each_check_takes_its_kind_and_nothing_else(check_, good, bad):
    assert [check_(v) for v in good] == [""] * len(good)
    assert all(check_(v) for v in bad), [v for v in bad if not check_(v)]


def test_a_list_of_token_ids_takes_each_id_in_range():
    # a list (Llama 3's eos_token_id) holds ids as a single id does: none negative, none past MAX_COUNT
    assert schema.token_ids([0, 5, schema.MAX_COUNT]) == ""
    assert schema.token_ids([0, -1]) == "a token id or a list of token ids"
    assert schema.token_ids([schema.MAX_COUNT + 1]) == "a token id or a list of token ids"
