"""The corpus benchmark's pieces: both sides tokenize the same documents into the same number of tokens, its
memory figures see what they claim, its GPT-2 tokenizer.json is GPT-2, and the Debian mix is cut as documented."""

import gzip
import json
import os
import re
import sys

import pytest

from lm.bench import corpus, debian_corpus
from lm.bench.corpus import datasets_row, prepare_row, run_measured, scaled_files, write_gpt2_tokenizer_json
from lm.data.corpora import find_corpus
from lm.tokenizer import load_tokenizer

DOCS = ["First document.\n", "Zweites Dokument, größer: " + "wort " * 50, "<|endoftext|> is text here", "4th 😀\n\n"]


def test_the_gpt2_tokenizer_json_makes_tiktokens_ids(tmp_path):
    hf = load_tokenizer(str(write_gpt2_tokenizer_json(tmp_path / "tokenizer.json")))
    gpt2 = load_tokenizer("gpt2")
    texts = [*DOCS, next(find_corpus("shakespeare").documents("text")), " \t\r\n  x\n\n\n y's 12345 ’’ "]
    assert hf.encode_ordinary_batch(texts) == [gpt2.encode_ordinary(t) for t in texts]
    assert (hf.n_vocab, hf.eot_token) == (50257, 50256)


@pytest.mark.process
def test_both_sides_write_the_same_tokens(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d, "source": "x"}) + "\n" for d in DOCS * 5))
    ours = prepare_row([str(tmp_path / "a.jsonl")], "gpt2", 2, tmp_path)
    theirs = datasets_row([str(tmp_path / "a.jsonl")], "gpt2", 2, tmp_path)
    gpt2 = load_tokenizer("gpt2")
    tokens = 5 * sum(len(gpt2.encode_ordinary(d)) + 1 for d in DOCS)  # each document with its end-of-text token
    assert (ours["documents"], ours["tokens"]) == (theirs["documents"], theirs["tokens"]) == (20, tokens)
    assert theirs["load s"] > 0 and theirs["map s"] > 0 and ours["wall s"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "datasets.log", "prepare.log"]  # outputs gone


def test_prepare_runs_as_many_workers_as_datasets(tmp_path, monkeypatch):
    # --num-proc 1 set datasets' num_proc alone: lm.prepare tokenized on every core, and the ratio was not fair
    ran = []

    def measured(argv, log):  # lm.prepare's run itself is tested above; here only what it is asked to do
        ran.append(argv)
        (tmp_path / "prepared").mkdir()  # what it wrote: a manifest of no splits
        (tmp_path / "prepared" / "manifest.json").write_text(json.dumps({"splits": {}}))
        return {}

    monkeypatch.setattr(corpus, "run_measured", measured)
    prepare_row(["a.jsonl"], "gpt2", 3, tmp_path)
    assert ran[0][1:3] == ["-m", "lm.prepare"] and "--data.num_workers=3" in ran[0]


@pytest.mark.process
def test_memory_is_the_process_itself_and_its_whole_tree(tmp_path):
    child = "b = bytearray(300 << 20); import time; time.sleep(1)"
    row = run_measured([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                                              f"{child!r}])"], tmp_path / "log")
    assert row["max RSS MiB"] < 100  # the parent holds no more than Python itself
    assert row["tree MiB"] > 300  # its child's 300 MiB count in the tree


def test_scaled_files_take_a_share_or_hard_linked_copies(tmp_path):
    files = []
    for i in range(8):
        files.append(str(tmp_path / f"d{i}.jsonl"))
        (tmp_path / f"d{i}.jsonl").write_text("{}\n")
    assert scaled_files(files, 0.25, tmp_path) == files[:2] and scaled_files(files, 1.0, tmp_path) == files
    copies = scaled_files(files, 3.0, tmp_path / "work")
    assert len(copies) == 24 and len(set(copies)) == 24
    assert {os.stat(c).st_ino for c in copies} == {os.stat(f).st_ino for f in files}


def _dictd(root, name: str, entries: list[tuple[str, bytes]], order: list[int] | None = None) -> None:
    """A dictd database: its entries' text gzipped, and an index of headword, offset and length in base 64, in
    `order` (dictd's index is sorted by headword, not by offset)."""
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(n: int) -> str:
        out = ""
        while True:
            n, d = divmod(n, 64)
            out = digits[d] + out
            if n == 0:
                return out

    data, index, offsets = b"", [], {}
    for headword, text in entries:
        if text not in offsets:
            offsets[text] = len(data)
            data += text
        index.append(f"{headword}\t{b64(offsets[text])}\t{b64(len(text))}")
    if order is not None:
        index = [index[i] for i in order]
    (root / "usr/share/dictd").mkdir(parents=True, exist_ok=True)
    (root / f"usr/share/dictd/{name}.dict.dz").write_bytes(gzip.compress(data))
    (root / f"usr/share/dictd/{name}.index").write_text("\n".join(index) + "\n")


def test_the_debian_mix_is_cut_into_documents_spread_over_the_files(tmp_path, capsys):
    root = tmp_path / "root"
    _dictd(root, "gcide", [("00-database-info", b"about\n"), ("Apple", b"Apple\n   A fruit.\n"),
                           ("apple", b"Apple\n   A fruit.\n"), ("Caf\xe9", b"Caf\xe9\n   bad byte\n")])
    _dictd(root, "wn", [("tree", b"tree\n    n 1: a plant\n")])
    pages = {"usr/share/doc/linux-doc-6.1/html/_sources/a/b.rst.txt": "Kernel\n======\n",
             "usr/share/doc/python3.11/html/_sources/library/os.rst.txt": "os\n--\n",
             "usr/share/perl/5.36.0/pod/perlre.pod": "=head1 NAME\n"}
    for path, text in pages.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    assert debian_corpus.main([str(root), str(tmp_path / "out"), "--files", "2"]) == 0
    rows = [[json.loads(line) for line in (tmp_path / "out" / f"debian-{i:02d}.jsonl").read_text().splitlines()]
            for i in range(2)]
    documents = [row for pair in zip(rows[0], rows[1] + [None]) for row in pair if row]  # document i in file i % 2
    assert [(d["source"], d["text"]) for d in documents] == [
        ("gcide", "Apple\n   A fruit.\n"), ("gcide", "Caf\ufffd\n   bad byte\n"),
        ("wordnet", "tree\n    n 1: a plant\n"), ("linux-doc", "Kernel\n======\n"),
        ("python-doc", "os\n--\n"), ("perl-doc", "=head1 NAME\n")]
    assert re.search(r"^total +6 documents", capsys.readouterr().out, re.M)


def test_a_missing_package_is_named(tmp_path):
    with pytest.raises(SystemExit, match=r"no gcide documents; unpack its Debian package there first"):
        debian_corpus.main([str(tmp_path), str(tmp_path / "out")])


def test_the_section_needs_a_corpus(capsys):
    from lm.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--sections", "corpus"])
    assert exit_.value.code == 2 and "--sections corpus needs --corpus GLOB" in capsys.readouterr().err


def test_a_corpus_that_matches_nothing_is_one_error_line(tmp_path, capsys):
    from lm.bench.__main__ import main
    from lm.cli import run

    assert run(main, ["--sections", "corpus", "--corpus", str(tmp_path / "*.jsonl")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --corpus: [") and "matches no files" in line


def test_a_corpus_lm_prepare_refuses_is_its_error_line_and_a_missing_work_dir_is_named(tmp_path, capsys):
    from lm.bench.__main__ import main
    from lm.cli import run

    (tmp_path / "rows.jsonl").write_text('{"text": "one"}\n{"other": 1}\n{"text": "two"}\n')
    args = ["--sections", "corpus", "--corpus", str(tmp_path / "rows.jsonl"), "--reps-corpus", "1"]
    assert run(main, [*args, "--corpus-work", str(tmp_path)]) == 2  # was a RuntimeError traceback
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: --corpus: {tmp_path / 'rows.jsonl'}: row 1: column "
                                                        "'text' is missing or null, expected a string")
    with pytest.raises(SystemExit):
        main([*args, "--corpus-work", str(tmp_path / "none")])
    assert f"--corpus-work {tmp_path / 'none'}: no such directory" in capsys.readouterr().err


def test_the_median_run_is_the_lower_middle_one():
    rows = [{"wall s": s} for s in (3.0, 1.0, 4.0, 2.0)]
    assert corpus._median_run(rows) == {"wall s": 2.0}
    assert corpus._median_run(rows[:3]) == {"wall s": 3.0}


def _fake(monkeypatch, tmp_path, ours_tokens=100, theirs_tokens=100, shards=("a", "b"), documents=(3, 3),
          read=None):
    """Both sides replaced by rows of the given figures; `read` (a list) collects the files lm.prepare is given."""
    walls = iter([9.0, 5.0, 7.0] * 10)

    def prepare_row(files, tokenizer, num_proc, work):
        if read is not None:
            read.append(list(files))
        shard = shards[0] if tokenizer == "gpt2" else shards[1]
        return {"wall s": next(walls), "max RSS MiB": 1.0, "tree MiB": 1.0, "documents": documents[0],
                "tokens": ours_tokens, "shards": [shard]}

    monkeypatch.setattr(corpus, "prepare_row", prepare_row)
    monkeypatch.setattr(corpus, "datasets_row", lambda files, tokenizer, num_proc, work: {
        "wall s": 1.0, "max RSS MiB": 1.0, "tree MiB": 1.0, "documents": documents[1], "tokens": theirs_tokens})
    monkeypatch.setattr(corpus, "write_gpt2_tokenizer_json", lambda path: path)
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    return [str(tmp_path / "*.jsonl")]


def test_the_shards_of_the_two_tokenizers_are_compared(monkeypatch, tmp_path):
    patterns = _fake(monkeypatch, tmp_path, shards=("a", "b"))
    assert corpus.bench_corpus(patterns, 1, 1, str(tmp_path))["same shards"] is False
    patterns = _fake(monkeypatch, tmp_path, shards=("a", "a"))
    assert corpus.bench_corpus(patterns, 1, 1, str(tmp_path))["same shards"] is True


def test_sides_that_wrote_other_tokens_are_refused(monkeypatch, tmp_path):
    patterns = _fake(monkeypatch, tmp_path, ours_tokens=100, theirs_tokens=99)
    with pytest.raises(RuntimeError, match="gpt2: lm.prepare wrote 100 tokens of 3 documents, datasets 99 of 3"):
        corpus.bench_corpus(patterns, 1, 1, str(tmp_path))


def test_each_side_keeps_its_median_run(monkeypatch, tmp_path):
    patterns = _fake(monkeypatch, tmp_path)
    found = corpus.bench_corpus(patterns, 1, 3, str(tmp_path))
    # gpt2's three runs take 9, 7 and 7 s... in turns with tokenizer.json's: 9, 7, 5 for gpt2 and 5, 9, 7 for the other
    assert found["tokenizers"]["gpt2"]["ours"]["wall s"] == 7.0
    assert found["tokenizers"]["tokenizer.json"]["ours"]["wall s"] == 7.0


def test_a_share_of_files_that_is_not_whole_rounds_to_the_nearest_count(tmp_path):
    files = [str(tmp_path / f"d{i}.jsonl") for i in range(7)]
    # 7 / 4 = 1.75 files and 7 / 2 = 3.5 (Python rounds half to even): 2 and 4, not 1 and 3 cut off
    assert corpus.scaled_files(files, 0.25, tmp_path) == files[:2]
    assert corpus.scaled_files(files, 0.5, tmp_path) == files[:4]


def test_dictd_entries_past_64_bytes_come_in_file_order_without_notes_or_blanks(tmp_path):
    entries = [(f"word{i}", f"word{i}\n".encode() + b"x" * (70 + 10 * i) + b" \n") for i in range(5)]
    entries.insert(2, ("00databaseshort", b"a note of the database\n"))
    entries.insert(4, ("blank", b"   \n"))
    _dictd(tmp_path, "gcide", entries, order=[6, 3, 0, 5, 1, 4, 2])
    found = list(debian_corpus.dictd_entries(tmp_path / "usr/share/dictd/gcide.index",
                                             tmp_path / "usr/share/dictd/gcide.dict.dz"))
    assert found == [f"word{i}\n" + "x" * (70 + 10 * i) + " \n" for i in range(5)]


def _debian_root(tmp_path, page_bytes=b"Kernel\n"):
    root = tmp_path / "root"
    _dictd(root, "gcide", [("cafe", "café\n".encode())])
    _dictd(root, "wn", [("tree", b"tree\n")])
    for path, text in {"usr/share/doc/linux-doc-6.1/html/_sources/a/b.rst.txt": page_bytes,
                       "usr/share/doc/linux-doc-6.1/html/_sources/a/empty.rst.txt": b" \n\n",
                       "usr/share/doc/python3.11/html/_sources/library/os.rst.txt": b"os\n",
                       "usr/share/perl/5.36.0/pod/perlre.pod": b"=head1 NAME\n"}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(text)
    return root


def test_the_counts_are_utf8_bytes_and_blank_pages_are_no_documents(tmp_path):
    counts = debian_corpus.write_corpus(_debian_root(tmp_path, b"Kernel \xff\n"), tmp_path / "out", 2)
    assert counts == {"gcide": {"documents": 1, "bytes": 6}, "wordnet": {"documents": 1, "bytes": 5},
                      "linux-doc": {"documents": 1, "bytes": 11}, "python-doc": {"documents": 1, "bytes": 3},
                      "perl-doc": {"documents": 1, "bytes": 12}}
    rows = [json.loads(line) for f in sorted((tmp_path / "out").iterdir()) for line in f.read_text().splitlines()]
    assert {"text": "Kernel \ufffd\n", "source": "linux-doc"} in rows  # a byte that is not UTF-8 becomes U+FFFD


def test_the_default_is_16_files_and_sizes_print_in_mb(tmp_path, capsys):
    assert debian_corpus.main([str(_debian_root(tmp_path, b"k" * 160_000)), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"debian-{i:02d}.jsonl" for i in range(16)]
    out = capsys.readouterr().out
    assert re.search(r"^linux-doc +1 documents +0\.2 MB$", out, re.M)
    assert re.search(r"^total +5 documents +0\.2 MB in 16 files under ", out, re.M)


def test_each_file_is_read_once_patterns_may_start_with_a_tilde_and_size_is_in_mb(monkeypatch, tmp_path):
    read = []
    _fake(monkeypatch, tmp_path, read=read)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "a.jsonl").write_bytes(b"x" * 500_000)
    (tmp_path / "b.jsonl").write_bytes(b"y" * 250_000)
    found = corpus.bench_corpus(["~/*.jsonl", str(tmp_path / "a.jsonl")], 1, 1, str(tmp_path))
    assert found["files"] == 2 and found["MB"] == pytest.approx(0.75)
    assert read[0] == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]


def test_the_scales_read_a_share_of_the_files_or_copies_of_them(monkeypatch, tmp_path):
    _fake(monkeypatch, tmp_path)
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text('{"text": "x"}\n')
    found = corpus.bench_corpus([str(tmp_path / "*.jsonl")], 1, 1, str(tmp_path))
    for name in ("gpt2", "tokenizer.json"):
        assert {label: row["files"] for label, row in found["scales"][name].items()} == {
            "1/4": 1, "1/2": 1, "all": 2, "3 x": 6}


def test_sides_that_read_other_documents_are_refused(monkeypatch, tmp_path):
    patterns = _fake(monkeypatch, tmp_path, documents=(3, 4))
    with pytest.raises(RuntimeError, match="gpt2: lm.prepare wrote 100 tokens of 3 documents, datasets 100 of 4"):
        corpus.bench_corpus(patterns, 1, 1, str(tmp_path))


def test_a_quarter_of_one_file_is_that_file(tmp_path):
    assert scaled_files(["only.jsonl"], 0.25, tmp_path) == ["only.jsonl"]
