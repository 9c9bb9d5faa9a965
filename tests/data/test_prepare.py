import dataclasses
import hashlib
import json
import logging
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lm.cli import run
from lm.data import corpora
from lm.data import prepare as prepare_module
from lm.data.config import DataConfig
from lm.data.corpora import find_corpus
from lm.data.prepare import is_val_document, prepare, smallest_val_fraction
from lm.data.shards import open_shard
from lm.errors import DataError
from lm.prepare import main
from lm.tokenizer import load_tokenizer

DOCS = [f"Document {i}: " + "word " * (i % 7) + ("<|endoftext|> as text" if i == 5 else "") for i in range(20)]


def tree_digest(path) -> dict[str, str]:
    """sha256 of every file under `path`, by relative name."""
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def write_txt(dir_, docs):
    dir_.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (dir_ / f"doc_{i:03d}.txt").write_text(doc)
    return str(dir_ / "*.txt")


def config(tmp_path, source, **kw) -> DataConfig:
    defaults = dict(source=source, dir=str(tmp_path / "data"), val_fraction=0.25, shard_tokens=16, num_workers=1)
    return DataConfig(**{**defaults, **kw})


def split_tokens(data_dir, manifest, split) -> list[int]:
    shards = manifest["splits"][split]["shards"]
    return np.concatenate([open_shard(data_dir / s["file"]) for s in shards]).tolist() if shards else []


def expected_tokens(docs, val: bool, val_fraction=0.25) -> list[int]:
    enc = load_tokenizer("gpt2")
    return [t for i, d in enumerate(docs) if is_val_document(i, val_fraction) == val
            for t in enc.encode_ordinary(d) + [enc.eot_token]]


def test_val_documents_are_evenly_spaced():
    assert [i for i in range(8) if is_val_document(i, 0.25)] == [3, 7]
    assert [i for i in range(38) if is_val_document(i, 0.1)] == [9, 19, 29]
    assert sum(is_val_document(i, 0.05) for i in range(1000)) == 50
    assert not any(is_val_document(i, 0.0) for i in range(100))


def test_prepare_text_files(tmp_path):
    cfg = config(tmp_path, write_txt(tmp_path / "in", DOCS))
    manifest = prepare(cfg)
    data = tmp_path / "data"
    assert {k: v for k, v in manifest.items() if k != "splits"} == {
        "format_version": 1, "tokenizer": "gpt2", "vocab_size": 50257, "dtype": "uint16", "eot_id": 50256,
        "document_boundaries": "eot",
        "source": cfg.source, "content_hash": manifest["content_hash"],
    }
    assert json.loads((data / "manifest.json").read_text()) == manifest
    train, val = split_tokens(data, manifest, "train"), split_tokens(data, manifest, "val")
    # documents 3, 7, 11, 15, 19 are val; each document ends with one EOT; "<|endoftext|>" in text is not EOT
    assert train == expected_tokens(DOCS, val=False)
    assert val == expected_tokens(DOCS, val=True)
    assert train.count(50256) == 15 and val.count(50256) == 5
    assert load_tokenizer("gpt2").decode(val).split("<|endoftext|>")[:2] == [DOCS[3], DOCS[7]]
    for split, docs in (("train", 15), ("val", 5)):
        info = manifest["splits"][split]
        assert info["documents"] == docs
        assert info["tokens"] == len(train if split == "train" else val)
        assert [s["tokens"] for s in info["shards"]][:-1] == [16] * (len(info["shards"]) - 1)


def test_row_formats_give_the_same_tokens(tmp_path):
    (tmp_path / "rows").mkdir()
    with open(tmp_path / "rows" / "a.jsonl", "w") as f:
        for doc in DOCS[:12]:
            f.write(json.dumps({"body": doc, "meta": 1}) + "\n")
    pq.write_table(pa.table({"body": DOCS[12:]}), tmp_path / "rows" / "b.parquet")
    rows = prepare(config(tmp_path, str(tmp_path / "rows" / "*"), text_column="body"))
    text = prepare(config(tmp_path, write_txt(tmp_path / "in", DOCS), dir=str(tmp_path / "text")))
    for split in ("train", "val"):
        assert split_tokens(tmp_path / "data", rows, split) == split_tokens(tmp_path / "text", text, split)
        assert rows["splits"][split]["documents"] == text["splits"][split]["documents"]


def test_prepare_twice_reuses_and_rebuilds_identically(tmp_path, caplog):
    cfg = config(tmp_path, write_txt(tmp_path / "in", DOCS))
    first = prepare(cfg)
    before = tree_digest(tmp_path / "data")
    inode = (tmp_path / "data" / "train_00000.bin").stat().st_ino
    with caplog.at_level(logging.INFO, logger="lm.data.prepare"):
        assert prepare(cfg) == first
    assert "is up to date" in caplog.text
    assert (tmp_path / "data" / "train_00000.bin").stat().st_ino == inode  # reused, not rewritten
    rebuilt = prepare(dataclasses.replace(cfg, num_workers=2), force=True)
    assert rebuilt == first
    assert (tmp_path / "data" / "train_00000.bin").stat().st_ino != inode
    assert tree_digest(tmp_path / "data") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "in"]  # no temporary dirs left


def test_changed_input_or_settings_rebuild(tmp_path):
    cfg = config(tmp_path, write_txt(tmp_path / "in", DOCS))
    first = prepare(cfg)
    assert prepare(dataclasses.replace(cfg, shard_tokens=32))["content_hash"] != first["content_hash"]
    (tmp_path / "in" / "doc_000.txt").write_text("changed")
    changed = prepare(cfg)
    assert changed["content_hash"] != first["content_hash"]
    assert split_tokens(tmp_path / "data", changed, "train")[:2] == load_tokenizer("gpt2").encode("changed") + [50256]


def test_damaged_shard_is_rebuilt(tmp_path):
    cfg = config(tmp_path, write_txt(tmp_path / "in", DOCS))
    prepare(cfg)
    before = tree_digest(tmp_path / "data")
    with open(tmp_path / "data" / "train_00001.bin", "ab") as f:
        f.write(b"\0\0")
    prepare(cfg)
    assert tree_digest(tmp_path / "data") == before


def test_verify_hashes_rebuilds_a_shard_with_a_flipped_byte(tmp_path, caplog):
    cfg = config(tmp_path, write_txt(tmp_path / "in", DOCS), verify_hashes=True)
    prepare(cfg)
    before = tree_digest(tmp_path / "data")
    shard = tmp_path / "data" / "train_00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x80
    shard.write_bytes(bytes(raw))
    with caplog.at_level(logging.INFO, logger="lm.data.prepare"):
        prepare(cfg)
    assert "rebuilding: " in caplog.text and "train_00001.bin: sha256 differs" in caplog.text
    assert tree_digest(tmp_path / "data") == before


def test_a_manifest_without_checksums_is_rebuilt_with_them(tmp_path):
    cfg = config(tmp_path, write_txt(tmp_path / "in", DOCS))
    manifest = prepare(cfg)
    path = tmp_path / "data" / "manifest.json"
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            del shard["sha256"]
    path.write_text(json.dumps(manifest))  # as written before shards had checksums
    assert all("sha256" in s for split in prepare(cfg)["splits"].values() for s in split["shards"])


def _bad_utf8(d):
    (d / "doc_004.txt").write_bytes(b"ok \xc3\x28")
    return str(d / "*.txt")


def _empty(d):
    (d / "doc_004.txt").write_bytes(b"")
    return str(d / "*.txt")


def _no_column(d):
    (d / "rows.jsonl").write_text('{"body": "x"}\n')
    return f"{d}/*.txt,{d}/rows.jsonl"


def _too_few_for_val(d):
    return str(d / "doc_000.txt")


@pytest.mark.parametrize("make_bad_source, message", [
    (_bad_utf8, r"doc_004.txt: not UTF-8: byte 0xc3 at offset 3"),
    (_empty, r"doc_004.txt: empty file"),
    (_no_column, r"rows.jsonl: no column 'text' \(data.text_column\); the columns are \['body'\]"),
    (_too_few_for_val, r"data.val_fraction=0.25 needs at least 2 documents \(one for val, one for training\), "
                       r"but data.source holds 1"),
])
def test_bad_input_leaves_prepared_dir_untouched(tmp_path, make_bad_source, message):
    cfg = config(tmp_path, write_txt(tmp_path / "in", DOCS))
    prepare(cfg)
    before = tree_digest(tmp_path / "data")
    bad_source = make_bad_source(tmp_path / "in")
    with pytest.raises(DataError, match=message):
        prepare(dataclasses.replace(cfg, source=bad_source))
    assert tree_digest(tmp_path / "data") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "in"]


def test_bad_input_found_while_tokenizing_leaves_no_directory_it_made(tmp_path):
    write_txt(tmp_path / "in", DOCS)
    (tmp_path / "in" / "doc_004.txt").write_bytes(b"ok \xc3\x28")  # found by the reader, inside the staging
    (tmp_path / "runs").mkdir()
    with pytest.raises(DataError, match=r"doc_004.txt: not UTF-8"):
        prepare(config(tmp_path, str(tmp_path / "in" / "*.txt"), dir=str(tmp_path / "runs" / "new" / "dir" / "data")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "runs"] and not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("directory", [".", "new/..", "/"])  # "": the config refuses it (tests/config)
def test_a_data_dir_without_a_name_of_its_own_is_refused(directory, tmp_path, monkeypatch):
    # the build goes into `<data.dir>.partial`: "." was a ValueError from pathlib, "new/.." an OSError from rename
    source = write_txt(tmp_path / "in", DOCS)
    monkeypatch.chdir(tmp_path / "in")
    with pytest.raises(DataError, match=f"^data.dir: {re.escape(repr(directory))} does not end in a directory's name"):
        prepare(config(tmp_path, source, dir=directory), force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"] and len(list((tmp_path / "in").iterdir())) == 20


def test_val_split_empty_for_row_files_is_detected_after_reading(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    with pytest.raises(DataError, match=r"data.val_fraction=0.25 puts none of the 2 documents in the val split"):
        prepare(config(tmp_path, str(tmp_path / "a.jsonl")))
    assert not (tmp_path / "data").exists()


def test_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=r"holds files but no manifest.json"):
        prepare(config(tmp_path, write_txt(tmp_path / "in", DOCS)))
    assert (tmp_path / "data" / "notes.txt").read_text() == "mine"


def test_a_prepared_directory_holding_another_file_is_not_replaced(tmp_path):
    """A data.dir lm.prepare made, where a user put a file of their own: a rebuild would delete it."""
    source = write_txt(tmp_path / "in", DOCS)
    prepare(config(tmp_path, source))
    (tmp_path / "data" / "ckpt.pt").write_bytes(b"weights")
    before = tree_digest(tmp_path / "data")
    with pytest.raises(DataError, match=r"holds ckpt.pt, which lm.prepare did not write"):
        prepare(config(tmp_path, source, shard_tokens=32))  # other settings: a rebuild
    assert tree_digest(tmp_path / "data") == before


def test_a_source_glob_reaching_into_a_killed_prepares_staging_leaves_it_out(tmp_path):
    """A killed prepare leaves <data.dir>.partial with its progress.json, which a glob of .json files matches."""
    (tmp_path / "rows.jsonl").write_text('{"source": "row one"}\n{"source": "row two"}\n')
    (tmp_path / "data.partial").mkdir()
    (tmp_path / "data.partial" / "progress.json").write_text(json.dumps([{"source": "not a document"}]))
    cfg = config(tmp_path, f"{tmp_path}/**/*.json*", text_column="source", val_fraction=0.0)
    assert prepare(cfg)["splits"]["train"]["documents"] == 2


def test_a_source_glob_reaching_into_data_dir_leaves_lms_own_files_out(tmp_path):
    # the second prepare read the first one's manifest.json as a row: its `source` became a training document
    (tmp_path / "rows.jsonl").write_text('{"source": "row one"}\n{"source": "row two"}\n')
    cfg = config(tmp_path, f"{tmp_path}/**/*.json*", text_column="source", val_fraction=0.0)
    first = prepare(cfg)
    assert prepare(cfg) == first  # up to date: the same input
    assert prepare(cfg, force=True)["splits"]["train"]["documents"] == 2
    with pytest.raises(DataError, match=r"every file it matches is inside data.dir"):
        prepare(config(tmp_path, f"{tmp_path}/data/*.json", dir=str(tmp_path / "data")))


@pytest.mark.parametrize("source, key, message", [
    ("shakespeare", {"document_separator": "\n\n"}, "data.document_separator: the built-in corpus 'shakespeare' is "
                                                    "cut into documents by lm"),
    ("kjv", {"text_column": "body"}, "data.text_column: the built-in corpus 'kjv' is cut into documents by lm"),
    ("{tmp}/rows.jsonl", {"document_separator": "\n\n"}, "data.document_separator: splits .txt and .md files, and "
                                                         "data.source names none"),
    ("{tmp}/in/*.txt", {"text_column": "body"}, "data.text_column: names the column of json, jsonl, parquet and "
                                                "arrow rows, and data.source names none"),
])
def test_a_key_that_would_do_nothing_for_the_source_is_refused(tmp_path, source, key, message):
    # each was accepted and did nothing (the separator still changed the content hash)
    write_txt(tmp_path / "in", DOCS)
    (tmp_path / "rows.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    with pytest.raises(DataError, match=re.escape(message)):
        prepare(config(tmp_path, source.format(tmp=tmp_path), **key))
    assert not (tmp_path / "data").exists()


def test_empty_and_blank_rows_are_no_documents_as_in_text_files(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["one", "", "   ", "two", "three", "\n"]))
    manifest = prepare(config(tmp_path, str(rows), val_fraction=0.34))
    assert {s: manifest["splits"][s]["documents"] for s in ("train", "val")} == {"train": 2, "val": 1}
    rows.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": " "}) + "\n")
    with pytest.raises(DataError, match=r"holds no documents \(empty and blank ones are skipped\)"):
        prepare(config(tmp_path, str(rows), dir=str(tmp_path / "blank")))


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_linked_data_dir_is_prepared_where_it_links_and_stays_a_link(tmp_path, target_exists):
    # data kept on another disk: a rebuild had replaced the link with a directory, left the target stale, and
    # failed on every later run
    source = write_txt(tmp_path / "in", DOCS)
    if target_exists:
        prepare(config(tmp_path, source, dir=str(tmp_path / "disk")))
    (tmp_path / "data").symlink_to(tmp_path / "disk")
    manifest = prepare(config(tmp_path, source, val_fraction=0.5), force=True)
    assert (tmp_path / "data").is_symlink() and (tmp_path / "data").resolve() == tmp_path / "disk"
    assert json.loads((tmp_path / "disk/manifest.json").read_text()) == manifest
    assert manifest["splits"]["val"]["documents"] == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "disk", "in"]


def test_cli(tmp_path, capsys):
    source = write_txt(tmp_path / "in", DOCS)
    argv = [f"--data.source={source}", f"--data.dir={tmp_path / 'data'}", "--data.val_fraction=0.25",
            "--data.num_workers=1"]
    assert run(main, argv) == 0
    out = capsys.readouterr().out
    assert "train: 15 documents," in out and "val: 5 documents," in out and "gpt2 (uint16) in" in out
    assert run(main, argv + ["--force"]) == 0
    assert run(main, [f"--data.source={tmp_path}/none/*.txt", f"--data.dir={tmp_path / 'other'}"]) == 2
    assert "error: data.source: " in capsys.readouterr().err
    assert run(main, ["--data.val_fraction=2"]) == 2
    assert "error: data.val_fraction: must be in [0, 1)" in capsys.readouterr().err
    assert run(main, argv + ["--verify"]) == 0
    assert "all 2 shards match manifest.json (sizes and sha256)" in capsys.readouterr().out
    shard = tmp_path / "data" / "val_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[40] ^= 0x01
    shard.write_bytes(bytes(raw))
    before = tree_digest(tmp_path / "data")
    assert run(main, argv + ["--verify"]) == 2
    assert "val_00000.bin: sha256 differs from manifest.json" in capsys.readouterr().err
    assert tree_digest(tmp_path / "data") == before  # --verify reports; it never rebuilds
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "--force" in capsys.readouterr().out


def test_text_read_in_small_chunks_gives_identical_shards(tmp_path, monkeypatch):
    plays = [doc for _, doc in zip(range(3), find_corpus("shakespeare").documents("text"))]
    source = write_txt(tmp_path / "in", plays)
    cfg = config(tmp_path, source, val_fraction=0.34, shard_tokens=50_000, num_workers=2)
    whole = prepare(cfg)
    monkeypatch.setattr(corpora, "TEXT_CHUNK", 1000)  # each play, ~100 kB, in ~100 pieces
    monkeypatch.setattr(prepare_module, "_BATCH_PIECES", 7)  # and each in several tasks
    assert prepare(dataclasses.replace(cfg, dir=str(tmp_path / "chunked"))) == whole
    assert tree_digest(tmp_path / "chunked") == tree_digest(tmp_path / "data")
    assert split_tokens(tmp_path / "data", whole, "val") == expected_tokens(plays, val=True, val_fraction=0.34)


PARAGRAPHS = ["First paragraph,\nline two.\n", "  Second, indented.\r\n", "Third <|endoftext|> as text.\n",
              "Fourth:\n\tend.\n", "Fifth.\n"]


@pytest.mark.parametrize("separator, text", [
    ("\n\n", "\n\n" + "\n \t\n".join(PARAGRAPHS[:3]) + "\n\n\n" + "\n".join(PARAGRAPHS[3:]) + "\n  \n"),
    ("\f", "\f".join(PARAGRAPHS) + "\f \f"),
    ("<|doc|>", "<|doc|>".join(PARAGRAPHS)),
], ids=["blank-lines", "form-feed", "string"])
@pytest.mark.parametrize("chunk", [4 << 20, 16], ids=["whole", "chunked"])
def test_document_separator_splits_text_files(tmp_path, monkeypatch, separator, text, chunk):
    monkeypatch.setattr(corpora, "TEXT_CHUNK", chunk)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(text, newline="")
    (tmp_path / "in" / "b.txt").write_text("Sixth, alone in its file.")
    docs = [*PARAGRAPHS, "Sixth, alone in its file."]
    manifest = prepare(config(tmp_path, str(tmp_path / "in" / "*.txt"), document_separator=separator,
                              val_fraction=0.5, num_workers=2))
    assert manifest["splits"]["train"]["documents"] == 3 and manifest["splits"]["val"]["documents"] == 3
    train = split_tokens(tmp_path / "data", manifest, "train")
    val = split_tokens(tmp_path / "data", manifest, "val")
    assert train == expected_tokens(docs, val=False, val_fraction=0.5)
    assert val == expected_tokens(docs, val=True, val_fraction=0.5)
    assert [i for i, t in enumerate(val) if t == 50256] == [8, 16, 25]  # after "Second", "Fourth" and "Sixth"
    assert load_tokenizer("gpt2").decode(val) == "".join(docs[i] + "<|endoftext|>" for i in (1, 3, 5))


def test_the_val_fraction_an_error_suggests_puts_exactly_one_document_in_val():
    for n in range(1, 300):  # 1/3 to 3 digits, 0.333, would put none of 3 documents there
        assert sum(is_val_document(i, smallest_val_fraction(n)) for i in range(n)) == 1, n
    assert [smallest_val_fraction(n) for n in (1, 3, 8, 10, 11, 3000)] == [1.0, 0.334, 0.125, 0.1, 0.091, 0.000334]


def test_data_left_aside_by_a_killed_publish_is_restored(tmp_path, caplog):
    cfg = config(tmp_path, write_txt(tmp_path / "in", DOCS))
    manifest = prepare(cfg)
    data = tmp_path / "data"
    data.rename(tmp_path / "data.replaced")  # a kill after publish_dir moved it aside, before the new one came
    with caplog.at_level(logging.WARNING, logger="lm.data"):
        assert prepare(cfg) == manifest  # put back and up to date: nothing tokenized again
    assert "a prepare was killed while replacing it; restored the data it replaced" in caplog.text
    assert not (tmp_path / "data.replaced").exists()


def test_a_source_of_only_blank_documents_is_named(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("\n\n\n  \n")  # two blank paragraphs, both skipped
    cfg = config(tmp_path, str(tmp_path / "in" / "a.txt"), document_separator="\n\n", val_fraction=0.0)
    with pytest.raises(DataError,
                       match=r"^data.source='.*a.txt' holds no documents \(empty and blank ones are skipped\)$"):
        prepare(cfg)
    assert not (tmp_path / "data" / "manifest.json").exists()


def test_changing_document_separator_re_prepares(tmp_path):
    source = write_txt(tmp_path / "in", ["one\n\ntwo\n\nthree\n\nfour", "five"])
    cfg = config(tmp_path, source, val_fraction=0.5)
    files = prepare(cfg)
    assert files["splits"]["train"]["documents"] + files["splits"]["val"]["documents"] == 2
    paragraphs = prepare(dataclasses.replace(cfg, document_separator="\n\n"))
    assert paragraphs["content_hash"] != files["content_hash"]
    assert paragraphs["splits"]["train"]["documents"] + paragraphs["splits"]["val"]["documents"] == 5
    assert prepare(dataclasses.replace(cfg, document_separator="\f"))["content_hash"] not in (
        files["content_hash"], paragraphs["content_hash"])
    assert prepare(cfg) == files  # back to one document per file: the first preparation's bytes again


def test_a_bad_byte_deep_in_a_chunked_file(tmp_path, monkeypatch):
    cfg = config(tmp_path, write_txt(tmp_path / "in", DOCS))
    prepare(cfg)
    before = tree_digest(tmp_path / "data")
    monkeypatch.setattr(corpora, "TEXT_CHUNK", 1000)
    (tmp_path / "in" / "doc_004.txt").write_bytes(b"Many words.\n" * 5000 + b"\xff" + b"More words.\n" * 100)
    with pytest.raises(DataError, match=r"doc_004.txt: not UTF-8: byte 0xff at offset 60000 cannot be decoded") as err:
        prepare(dataclasses.replace(cfg, num_workers=2))
    assert str(err.value).count("\n") == 0
    assert tree_digest(tmp_path / "data") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "in"]


@pytest.mark.parametrize("source, column, message", [
    ("{tmp}/in/none-*.jsonl", "text", r"error: data.source: '.*/in/none-\*.jsonl' matches no files"),
    ("{tmp}/in/rows.jsonl", "body", r"error: .*/in/rows.jsonl: no column 'body' \(data.text_column\); the columns "
                                    r"are \['text'\]"),
])
def test_cli_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, source, column, message):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "rows.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    argv = [f"--data.source={source.format(tmp=tmp_path)}", f"--data.text_column={column}",
            f"--data.dir={tmp_path / 'data'}"]
    assert run(main, argv) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert re.fullmatch(message, line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no data.dir, no half-built data.dir.partial
