import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lm.data import corpora
from lm.data.corpora import clean_markdown, find_corpus, iter_documents
from lm.errors import DataError

REPO = Path(__file__).resolve().parents[2]

PLAY = """# Hamlet

## ACT I

### SCENE I. Elsinore. A platform before the castle.

_FRANCISCO at his post. Enter to him BERNARDO_

**BERNARDO**  
Who's there?


**FRANCISCO**  
Nay, answer me: stand,  
and unfold yourself.

*Exeunt,
severally.*

**LORENZO**  
__\\[Reads]_  
'Ladies,'\\--or 'Fair-ladies
"""

CLEAN = """Hamlet

ACT I

SCENE I. Elsinore. A platform before the castle.

FRANCISCO at his post. Enter to him BERNARDO

BERNARDO:
Who's there?

FRANCISCO:
Nay, answer me: stand,
and unfold yourself.

Exeunt,
severally.

LORENZO:
[Reads]
'Ladies,'--or 'Fair-ladies
"""


def test_clean_markdown():
    assert clean_markdown(PLAY) == CLEAN


def test_shakespeare_is_38_cleaned_plays_in_path_order():
    corpus = find_corpus("shakespeare")
    names = [p.relative_to(corpus.root).as_posix() for p in corpus.files]
    assert len(names) == 38 and corpus.num_documents == 38
    assert names == sorted(names)
    assert names[0] == "comedies/a-midsummer-night-s-dream.md"
    first = next(iter_documents("shakespeare", "text"))
    assert first.startswith("A Midsummer Night's Dream\n\nACT I\n\nSCENE I. Athens. The palace of THESEUS.\n\n"
                            "Enter THESEUS, HIPPOLYTA, PHILOSTRATE, and Attendants\n\nTHESEUS:\nNow, fair Hippolyta")


def test_kjv_is_the_bible_by_chapter_with_its_citation_first():
    chapters = list(iter_documents("kjv", "text"))
    assert len(chapters) == 1189
    assert chapters[0].startswith("Genesis 1\nIn the beginning God created the heaven and the earth.\nAnd the earth")
    assert chapters[-1].startswith("Revelation 22\n") and chapters[-1].endswith("be with you all. Amen.\n")
    assert sum(c.count("\n") - 1 for c in chapters) == 31_103  # every verse (a line of kjv.jsonl), one line each


def test_text_files_are_documents_in_pattern_then_name_order(tmp_path):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.txt").write_text("ay **bold**")  # user Markdown is read verbatim
    (tmp_path / "z.md").write_text("zed")
    corpus = find_corpus(f"{tmp_path}/z.md, {tmp_path}/*.txt,{tmp_path}/a.txt")  # a.txt twice is one input
    assert [p.name for p in corpus.files] == ["z.md", "a.txt", "b.txt"]
    assert corpus.num_documents == 3
    assert list(corpus.documents("text")) == ["zed", "ay **bold**", "bee"]


def test_document_separator_splits_text_files_only(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\n\ntwo\n \nthree\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "four\n\nstill four"}) + "\n")
    source = f"{tmp_path}/a.txt,{tmp_path}/b.jsonl"
    assert list(iter_documents(source, "text")) == ["one\n\n\ntwo\n \nthree\n", "four\n\nstill four"]
    assert list(iter_documents(source, "text", "\n\n")) == ["one\n", "two\n", "three\n", "four\n\nstill four"]
    assert find_corpus(str(tmp_path / "a.txt"), "\n\n").num_documents is None  # known only once read
    shakespeare = find_corpus("shakespeare", "\n\n")
    assert shakespeare.num_documents == 38 and shakespeare == find_corpus("shakespeare")  # one document a play


def test_a_byte_order_mark_is_no_part_of_a_document(tmp_path):
    bom = "\ufeff".encode()
    (tmp_path / "a.txt").write_bytes(bom + b"first\n\nsecond " + bom + b"\n")
    (tmp_path / "b.jsonl").write_bytes(bom + json.dumps({"text": "third"}).encode() + b"\n")
    source = f"{tmp_path}/a.txt,{tmp_path}/b.jsonl"
    # only the mark that opens a file goes: one inside the text is a character of it
    assert list(iter_documents(source, "text", "\n\n")) == ["first\n", "second \ufeff\n", "third"]
    before = find_corpus(source).content_hash("text")
    (tmp_path / "a.txt").write_bytes((tmp_path / "a.txt").read_bytes()[len(bom):])
    assert list(iter_documents(source, "text", "\n\n")) == ["first\n", "second \ufeff\n", "third"]
    # the same documents, but the data prepared while lm kept the mark must not pass for today's
    assert find_corpus(source).content_hash("text") != before


def test_row_files(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "one", "id": 1}) + "\n" + json.dumps({"body": "two"}) + "\n")
    (tmp_path / "b.json").write_text(json.dumps([{"body": "three"}]))
    pq.write_table(pa.table({"body": ["four", "<|endoftext|>"], "n": [4, 5]}), tmp_path / "c.parquet")
    corpus = find_corpus(str(tmp_path / "*"))
    assert corpus.num_documents is None
    assert list(corpus.documents("body")) == ["one", "two", "three", "four", "<|endoftext|>"]


def test_missing_text_column_names_file_and_columns(tmp_path):
    pq.write_table(pa.table({"content": ["x"], "id": [1]}), tmp_path / "c.parquet")
    message = r"c.parquet: no column 'text' \(data.text_column\); the columns are \['content', 'id'\]"
    with pytest.raises(DataError, match=message):
        list(iter_documents(str(tmp_path / "c.parquet"), "text"))


def test_non_string_text(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    message = r"a.jsonl: column 'text' holds both string values \(row 0: 'ok'\) and number values \(row 1: 5\)"
    with pytest.raises(DataError, match=message):
        list(iter_documents(str(tmp_path / "a.jsonl"), "text"))


def test_malformed_json(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"text": oops\n')
    with pytest.raises(DataError, match=r"a.jsonl: cannot read as json: line 2: Expecting value$"):
        list(iter_documents(str(tmp_path / "a.jsonl"), "text"))
    # deep in a large file: pyarrow counts its row from the start of a block (it said row 9530 for line 30001)
    lines = [json.dumps({"text": f"row {i} " + "x" * 80}) for i in range(30000)] + ['{"text": "broken"']
    (tmp_path / "late.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"late.jsonl: cannot read as json: line 30001: "):
        list(iter_documents(str(tmp_path / "late.jsonl"), "text"))


def test_rows_without_text(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n\n")
    (tmp_path / "b.jsonl").write_text("{}\n")  # a row, but none of its keys: datasets streams no row at all
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "c.parquet")  # was pyarrow's BatchSize
    for name in ("a.jsonl", "b.jsonl", "c.parquet"):
        with pytest.raises(DataError, match=rf"{name}: no rows with a column 'text' \(data.text_column\); expected"):
            list(iter_documents(str(tmp_path / name), "text"))
    (tmp_path / "d.jsonl").write_text('{"text": "one"}\n{"other": 1}\n')  # no key is no null the user wrote
    with pytest.raises(DataError, match=r"d.jsonl: row 1: column 'text' is missing or null, expected a string$"):
        list(iter_documents(str(tmp_path / "d.jsonl"), "text"))


def test_non_utf8_names_file_and_offset(tmp_path):
    (tmp_path / "a.txt").write_bytes("caf\u00e9 ok ".encode() + b"\xff rest")
    with pytest.raises(DataError, match=r"a.txt: not UTF-8: byte 0xff at offset 9"):
        list(iter_documents(str(tmp_path / "a.txt"), "text"))


@pytest.mark.parametrize("make, source, message", [
    (None, "tinystories", r"unknown corpus 'tinystories'; expected one of \['shakespeare', 'kjv'\]"),
    (None, "{tmp}/*.txt", r"matches no files"),
    ("a.csv", "{tmp}/a.csv", r"a.csv: unsupported extension '.csv'; expected one of .txt, .md, .json"),
    ("a.txt", "{tmp}/a.txt", r"a.txt: empty file"),
    (None, "{tmp}", r"is a directory; name files or a glob"),
    (None, ", ,", r"^data.source: ', ,' names no corpus or files$"),  # was commonpath's traceback
])
def test_bad_sources(tmp_path, make, source, message):
    if make:
        (tmp_path / make).write_text("x,y\n" if make.endswith(".csv") else "")
    with pytest.raises(DataError, match=message):
        find_corpus(source.format(tmp=tmp_path))


def test_content_hash(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("alpha")
    (tmp_path / "in" / "b.jsonl").write_text('{"text": "beta"}\n')
    source = str(tmp_path / "in" / "*")
    base = find_corpus(source).content_hash("text")
    assert find_corpus(source).content_hash("text") == base
    assert find_corpus(source).content_hash("body") != base  # the column changes the documents
    text_only = find_corpus(str(tmp_path / "in" / "*.txt"))
    assert text_only.content_hash("body") == text_only.content_hash("text")  # ... only for row files
    shutil.copytree(tmp_path / "in", tmp_path / "moved")
    assert find_corpus(str(tmp_path / "moved" / "*")).content_hash("text") == base  # names are relative
    (tmp_path / "in" / "a.txt").write_text("alphA")
    assert find_corpus(source).content_hash("text") != base
    (tmp_path / "in" / "a.txt").write_text("alpha")
    (tmp_path / "in" / "b.jsonl").rename(tmp_path / "in" / "c.jsonl")
    assert find_corpus(source).content_hash("text") != base


@pytest.mark.parametrize("name, content", [("a.jsonl", "not json\n"), ("a.json", "[{\"text\": \"a\"}"),
                                           ("a.parquet", "not parquet")])
def test_a_row_file_datasets_cannot_parse_is_our_one_line_and_none_of_its_log(name, content, tmp_path, capsys):
    from lm.cli import run
    from lm.prepare import main as prepare_main

    (tmp_path / name).write_text(content)
    assert run(prepare_main, [f"--data.source={tmp_path / name}", f"--data.dir={tmp_path / 'out'}"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [captured.err.strip()] and captured.err.startswith(
        f"error: {tmp_path / name}: cannot read as "), captured.err
    assert "Failed" not in captured.out and not (tmp_path / "out").exists(), captured.out


def test_a_dataset_saved_to_disk_reads_like_its_rows(tmp_path):
    import datasets

    rows = {"body": ["one", "two", "three", "four"], "n": [1, 2, 3, 4]}
    datasets.Dataset.from_dict(rows).select([3, 1, 0, 2]).save_to_disk(tmp_path / "saved", num_shards=2)
    corpus = find_corpus(str(tmp_path / "saved"))
    assert [p.name for p in corpus.files] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert list(corpus.documents("body")) == ["four", "two", "one", "three"]  # the order it was saved in
    assert list(iter_documents(str(tmp_path / "saved/*.arrow"), "body")) == ["four", "two", "one", "three"]
    with pytest.raises(DataError, match=r"saved/data-00000-of-00002.arrow: no column 'text' \(data.text_column\); "
                                        r"the columns are \['body', 'n'\]"):
        list(corpus.documents("text"))
    with pytest.raises(DataError, match=r"row 0: column 'n' holds 4, expected a string"):
        list(corpus.documents("n"))


def test_a_saved_dataset_dictionary_asks_for_a_split(tmp_path):
    import datasets

    split = datasets.Dataset.from_dict({"text": ["a", "b"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(tmp_path / "dd")
    with pytest.raises(DataError, match=r"holds a dataset dictionary with splits \['train', 'test'\]; name the split "
                                        r"to read, e.g. .*/dd/train"):
        find_corpus(str(tmp_path / "dd"))
    assert list(iter_documents(str(tmp_path / "dd" / "train"), "text")) == ["a", "b"]


@pytest.mark.parametrize("file, edit, message", [
    ("state.json", {"_data_files": [{"filename": None}]}, r"state.json: lists None as a data file; expected file"),
    ("state.json", {"_data_files": [{"filename": 5}]}, r"state.json: lists 5 as a data file"),
    ("../dataset_dict.json", {"splits": 5}, r"dataset_dict.json: splits is 5, expected a list of split names"),
    ("../dataset_dict.json", {"splits": [None]}, r"dataset_dict.json: splits is \[None\]"),
])
def test_a_saved_dataset_with_damaged_metadata_is_one_error(file, edit, message, tmp_path):
    import datasets

    split = datasets.Dataset.from_dict({"text": ["a", "b"]})
    datasets.DatasetDict({"train": split}).save_to_disk(tmp_path / "dd")
    path = tmp_path / "dd" / "train" / file
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(DataError, match=message):  # were a TypeError out of pathlib, and one out of the message
        find_corpus(str(tmp_path / "dd" / ("train" if file == "state.json" else "")))


def test_a_long_row_streams_in_pieces_of_its_document(tmp_path, monkeypatch):
    monkeypatch.setattr(corpora, "TEXT_CHUNK", 64)
    long = "word and word\n" * 40
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": long}) + "\n" + json.dumps({"text": "short"}) + "\n")
    pieces = list(find_corpus(str(tmp_path / "a.jsonl")).pieces("text"))
    assert len(pieces) > 2 and [p.ends_document for p in pieces].count(True) == 2
    assert "".join(p.text for p in pieces[:-1]) == long and pieces[-1] == ("short", True)


@pytest.mark.parametrize("source, message", [
    ("hf:", r"'hf:': expected hf:NAME\[:CONFIG\[:SPLIT\]\]"),
    ("hf:a/b:c:d:e", r"expected hf:NAME\[:CONFIG\[:SPLIT\]\]"),
    ("hf:a/b,{tmp}/*.txt", r"a Hub dataset \(hf:...\) is read alone"),
])
def test_bad_hub_sources(tmp_path, source, message):
    with pytest.raises(DataError, match=message):
        find_corpus(source.format(tmp=tmp_path))


@pytest.mark.process
def test_a_hub_dataset_offline_is_one_error_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "lm.prepare", "--data.source=hf:stanfordnlp/imdb",
                           f"--data.dir={tmp_path / 'data'}"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("error: data.source: cannot resolve 'hf:stanfordnlp/imdb' on the Hugging Face Hub "
                           "(OfflineModeIsEnabled: ") and line.endswith("check the name and the network, or prepare "
                                                                        "local files"), line
    assert sorted(tmp_path.iterdir()) == []  # nothing written


def test_a_hub_dataset_is_hashed_by_name_config_split_and_commit():
    hub = corpora.HubDataset("owner/name", None, "train", "a" * 40)
    base = corpora.Corpus(files=(), root=Path("."), hub=hub)
    assert base.num_documents is None and base.num_parts == 1
    for other in (dataclasses.replace(hub, revision="b" * 40), dataclasses.replace(hub, split="test"),
                  dataclasses.replace(hub, config="small"), dataclasses.replace(hub, name="owner/other")):
        assert dataclasses.replace(base, hub=other).content_hash("text") != base.content_hash("text")
    assert base.content_hash("body") != base.content_hash("text")


def test_content_hash_covers_the_first_bytes_of_a_text_file(tmp_path):
    # the byte-order-mark probe reads a text file's first bytes: the hash must still cover them
    (tmp_path / "a.txt").write_text("alpha beta")
    before = find_corpus(str(tmp_path / "a.txt")).content_hash("text")
    (tmp_path / "a.txt").write_text("Alpha beta")  # same size, first byte changed
    assert find_corpus(str(tmp_path / "a.txt")).content_hash("text") != before
    (tmp_path / "a.txt").write_text("alpha beta")
    assert find_corpus(str(tmp_path / "a.txt")).content_hash("text") == before


def test_a_blank_row_is_no_document(tmp_path):
    # a row of only whitespace is skipped, as a blank document of a text file is; an empty one too
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n{"text": " \\n\\t "}\n{"text": ""}\n{"text": "b"}\n')
    assert list(find_corpus(str(tmp_path / "rows.jsonl")).documents("text")) == ["a", "b"]


def test_a_first_row_without_its_text_is_named_missing_or_null(tmp_path):
    # datasets reads a null and a missing key alike, as None: the message says so, from the first row on
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": null}\n{"text": "b"}\n')
    with pytest.raises(DataError, match=rf"^{path}: row 0: column 'text' is missing or null, expected a string$"):
        list(find_corpus(str(path)).documents("text"))


def test_a_missing_text_column_lists_the_columns_there_are_sorted(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"zeta": "a", "alpha": "b"}\n')
    with pytest.raises(DataError, match=rf"^{path}: no column 'text' \(data.text_column\); the columns are "
                                        r"\['alpha', 'zeta'\]$"):
        list(find_corpus(str(path)).documents("text"))


def test_a_text_column_is_unread_for_text_files_and_read_for_rows(tmp_path):
    # data.text_column names a column of row files: set for .txt files alone it does nothing, and is refused
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.jsonl").write_text('{"body": "beta"}\n')
    assert find_corpus(str(tmp_path / "a.txt")).unread_key("body", "") == (
        "data.text_column: names the column of json, jsonl, parquet and arrow rows, and data.source names none; "
        "drop data.text_column")
    assert find_corpus(str(tmp_path / "b.jsonl")).unread_key("body", "") is None
    assert find_corpus(str(tmp_path / "a.txt")).unread_key("text", "") is None


def test_a_saved_dataset_listing_no_data_files_is_refused(tmp_path):
    import datasets


    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(tmp_path / "saved")
    state = tmp_path / "saved" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "_data_files": []}))
    with pytest.raises(DataError, match=r"state.json: lists no data files that .*saved does not hold; save it again"):
        find_corpus(str(tmp_path / "saved"))
