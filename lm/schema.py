"""What the values of a file lm did not write may hold, declared once per file kind, and one walker that names
the first value out of place by its file and dotted key.

A schema is a dict of key -> spec. A spec is a check (a function of the value that returns what was expected,
or "" when the value is fine), a `Table` of keys one level down, `Each` item of a list, or `Entries`, every
value of an object whose keys the file chooses; `or_null` lets any of them be null. Keys a schema does not list,
and keys a file leaves out, pass unchecked: these files carry many settings lm never reads, and what a missing
key means is its reader's to say.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm.errors import LMError

__all__ = [
    "MAX_COUNT", "Check", "Each", "Entries", "Spec", "Table", "check", "count", "flag", "fraction", "ints", "name",
    "names", "nonblank", "nonnegative", "or_null", "positive", "table", "token_id", "token_ids",
]

Check = Callable[[Any], str]
"""A leaf check: the value in, what was expected out, or "" when the value is fine."""

# Sizes beyond this are typos, and they would overflow a float or a tensor dimension long before they fit.
MAX_COUNT = 2**31 - 1


def _is_int(value: Any) -> bool:
    """Whether `value` is an integer; JSON's and YAML's true is not a count."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if _is_int(value):
        return abs(value) <= MAX_COUNT
    return isinstance(value, float) and math.isfinite(value)


def count(value: Any) -> str:
    return "" if _is_int(value) and 1 <= value <= MAX_COUNT else f"a positive integer up to {MAX_COUNT}"


def positive(value: Any) -> str:
    return "" if _is_number(value) and value > 0 else "a finite number above 0"


def nonnegative(value: Any) -> str:
    return "" if _is_number(value) and value >= 0 else "a finite number >= 0"


def fraction(value: Any) -> str:
    return "" if _is_number(value) and 0 <= value <= 1 else "a number from 0 to 1"


def flag(value: Any) -> str:
    return "" if isinstance(value, bool) else "true or false"


def name(value: Any) -> str:
    return "" if isinstance(value, str) else "a string"


def nonblank(value: Any) -> str:
    return "" if isinstance(value, str) and value.strip() else "a non-empty string"


def names(value: Any) -> str:
    return "" if isinstance(value, list) and all(isinstance(v, str) for v in value) else "a list of strings"


def token_id(value: Any) -> str:
    return "" if _is_int(value) and 0 <= value <= MAX_COUNT else f"a token id (an integer from 0 to {MAX_COUNT})"


def token_ids(value: Any) -> str:
    ok = _is_int(value) and 0 <= value <= MAX_COUNT or isinstance(value, list) and all(
        _is_int(v) and 0 <= v <= MAX_COUNT for v in value)
    return "" if ok else "a token id or a list of token ids"


def ints(value: Any) -> str:
    return "" if isinstance(value, list) and all(_is_int(v) for v in value) else "a list of integers"


def table(value: Any) -> str:
    return "" if isinstance(value, dict) else "an object of settings"


@dataclass(frozen=True)
class Table:
    """An object whose keys in `keys` are checked in turn, each named `outer.key`."""

    keys: Mapping[str, "Spec"]
    expected: str = "an object of settings"
    nullable: bool = False


@dataclass(frozen=True)
class Each:
    """A list whose every item is `item`, each named `outer[i]`."""

    item: "Spec"
    expected: str = "a list"
    nullable: bool = False


@dataclass(frozen=True)
class Entries:
    """An object whose keys the file chooses (the names of a template's special tokens) and whose every value
    is `item`, each named `outer.key`."""

    item: "Spec"
    expected: str = "an object"
    nullable: bool = False


Spec = Check | Table | Each | Entries


def or_null(spec: Spec) -> Spec:
    """`spec`, or null."""
    if isinstance(spec, (Table, Each, Entries)):
        return dataclasses.replace(spec, nullable=True)

    def checked(value: Any) -> str:
        expected = spec(value) if value is not None else ""
        return f"{expected} or null" if expected else ""
    return checked


def _join(outer: str, key: str) -> str:
    return f"{outer}.{key}" if outer else key


def _first_problem(value: Any, spec: Spec, key: str) -> tuple[str, Any, str] | None:
    """(dotted key, value, what was expected) of the first value at or below `key` that `spec` refuses."""
    if not isinstance(spec, (Table, Each, Entries)):
        expected = spec(value)
        return (key, value, expected) if expected else None
    if value is None and spec.nullable:
        return None
    if not isinstance(value, list if isinstance(spec, Each) else dict):
        return key, value, spec.expected + (" or null" if spec.nullable else "")
    if isinstance(spec, Table):
        below = ((_join(key, k), value[k], s) for k, s in spec.keys.items() if k in value)
    elif isinstance(spec, Each):
        below = ((f"{key}[{i}]", v, spec.item) for i, v in enumerate(value))
    else:
        below = ((_join(key, k), v, spec.item) for k, v in value.items())
    return next((found for k, v, s in below if (found := _first_problem(v, s, k))), None)


def _shown(value: Any) -> str:
    """`value` as its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def check(values: Mapping[str, Any], schema: Mapping[str, Spec], origin: str | Path | None,
          error: type[LMError]) -> None:
    """Raise `error`("ORIGIN: KEY: expected WHAT, got VALUE") for the first value of `values` that `schema`
    refuses, nested keys named with dots (rope_scaling.factor) and list items by index (added_tokens[3].id);
    without an origin the message starts at the key."""
    found = _first_problem(values, Table(schema), "")
    if found is not None:
        key, value, expected = found
        where = f"{origin}: " if origin is not None else ""
        raise error(f"{where}{key}: expected {expected}, got {_shown(value)}")
