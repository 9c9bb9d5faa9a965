"""Preparing data with a Hugging Face tokenizer.json: each document is [bos] + its whole-document tokens + [eos],
the data is known by the tokenizer's hash (reused from another directory's copy, rebuilt when the file changes),
and shards of another tokenizer are refused."""

import dataclasses
import hashlib
import json
import logging
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer

from lm.data import corpora
from lm.data import prepare as prepare_module
from lm.data.config import DataConfig
from lm.data.pieces import split_pieces
from lm.data.prepare import is_val_document, output_hash, prepare
from lm.data.shards import check_manifest, open_shard, read_manifest
from lm.errors import ConfigError, DataError
from lm.tokenizer import forget_tokenizers, load_tokenizer, tokenizer_hash

DOCS = ["Fair is foul,\nand foul is fair.\n", "When shall we three meet again\nIn thunder, lightning, or in rain?\n",
        "The end </s> and start <s> of a document, as text.\n", "Hover through the fog and filthy air.\n"]


@pytest.fixture(autouse=True)
def fresh_cache():
    forget_tokenizers()
    yield
    forget_tokenizers()


def write_docs(directory, docs) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (directory / f"doc_{i:03d}.txt").write_text(doc)
    return str(directory / "*.txt")


def tokens(data_dir, manifest, split) -> list[int]:
    return np.concatenate([open_shard(data_dir / s["file"]) for s in manifest["splits"][split]["shards"]]).tolist()


def expected(path, docs, val: bool, val_fraction: float) -> list[int]:
    """[bos] + tokens + [eos] of each document of the split, by `tokenizers` itself on the whole document."""
    reference = Tokenizer.from_file(str(path))
    tok = load_tokenizer(str(path))
    prefix = [] if tok.bos_token is None else [tok.bos_token]
    return [t for i, doc in enumerate(docs) if is_val_document(i, val_fraction) == val
            for t in prefix + reference.encode(doc, add_special_tokens=False).ids + [tok.eot_token]]


@pytest.mark.parametrize("kind", ["bos", "metaspace"])
def test_documents_are_bos_tokens_eos_as_if_encoded_whole(tokenizer_jsons, tiny_corpus_dir, tmp_path, monkeypatch,
                                                          kind):
    path = tokenizer_jsons[kind]
    docs = [p.read_text() for p in sorted(tiny_corpus_dir.glob("*.txt"))]
    monkeypatch.setattr(corpora, "TEXT_CHUNK", 1000)  # each scene read in pieces
    monkeypatch.setattr(prepare_module, "_BATCH_PIECES", 3)  # and several documents per task
    cfg = DataConfig(source=str(tiny_corpus_dir / "*.txt"), tokenizer=str(path), dir=str(tmp_path / "data"),
                     val_fraction=0.1, shard_tokens=4096, num_workers=2)
    manifest = prepare(cfg)
    data = tmp_path / "data"
    assert tokens(data, manifest, "train") == expected(path, docs, False, 0.1)
    assert tokens(data, manifest, "val") == expected(path, docs, True, 0.1)
    assert (manifest["tokenizer"], manifest["vocab_size"], manifest["dtype"]) == (str(path), 400, "uint16")
    assert (manifest["eot_id"], manifest["bos_id"]) == (1, 0)
    assert manifest["tokenizer_hash"] == tokenizer_hash(str(path))
    assert [manifest["splits"][s]["documents"] for s in ("train", "val")] == [26, 2]
    if kind == "metaspace":
        # why documents are encoded whole: its pieces would each start a new "first word"
        reference = Tokenizer.from_file(str(path))
        pieces = split_pieces([docs[1][i:i + 1000] for i in range(0, len(docs[1]), 1000)], "", 1000)
        by_piece = [t for piece in pieces for t in reference.encode(piece.text, add_special_tokens=False).ids]
        assert by_piece != reference.encode(docs[1], add_special_tokens=False).ids


def test_special_token_text_stays_text_and_no_bos_without_one(tokenizer_jsons, tmp_path):
    path = tokenizer_jsons["eot"]
    cfg = DataConfig(source=write_docs(tmp_path / "in", DOCS + ["<|endoftext|> " * 3]), tokenizer=str(path),
                     dir=str(tmp_path / "data"), val_fraction=0.2, shard_tokens=16, num_workers=1)
    manifest = prepare(cfg)
    train = tokens(tmp_path / "data", manifest, "train")
    assert train == expected(path, DOCS + ["<|endoftext|> " * 3], False, 0.2)
    assert train.count(0) == manifest["splits"]["train"]["documents"] == 4  # one end-of-text per document
    assert "bos_id" not in manifest


def test_same_file_elsewhere_reuses_the_data_and_an_edited_one_rebuilds(tokenizer_jsons, tmp_path, caplog):
    source = write_docs(tmp_path / "in", DOCS)
    here = tmp_path / "here" / "tokenizer.json"
    here.parent.mkdir()
    shutil.copy(tokenizer_jsons["bos"], here)
    cfg = DataConfig(source=source, tokenizer=str(tokenizer_jsons["bos"]), dir=str(tmp_path / "data"),
                     val_fraction=0.25, shard_tokens=16, num_workers=1)
    first = prepare(cfg)
    with caplog.at_level(logging.INFO, logger="lm.data.prepare"):
        assert prepare(dataclasses.replace(cfg, tokenizer=str(here))) == first
    assert "is up to date" in caplog.text
    edited = json.loads(here.read_text())
    edited["decoder"] = None  # the same ids, other bytes: the tokenizer is not the one the data was made with
    here.write_text(json.dumps(edited))
    forget_tokenizers()  # a new process would read the file again
    rebuilt = prepare(dataclasses.replace(cfg, tokenizer=str(here)))
    assert rebuilt["content_hash"] != first["content_hash"]
    assert rebuilt["tokenizer_hash"] == tokenizer_hash(str(here)) != first["tokenizer_hash"]


def test_tiktoken_data_keeps_its_content_hash_and_manifest(tiny_data_config, tiny_data_dir):
    # the key of data prepared before tokenizer hashes existed, so that data stays current
    key = {"input": "abc", "tokenizer": "gpt2", "val_fraction": 0.1, "shard_tokens": 4096, "format_version": 1}
    assert output_hash("abc", tiny_data_config) == hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    manifest = read_manifest(tiny_data_dir)
    assert "tokenizer_hash" not in manifest and "bos_id" not in manifest  # the name says which ids


def test_shards_of_another_tokenizer_are_refused(tokenizer_jsons, tmp_path):
    bos, eot = str(tokenizer_jsons["bos"]), str(tokenizer_jsons["eot"])
    data = tmp_path / "data"
    manifest = prepare(DataConfig(source=write_docs(tmp_path / "in", DOCS), tokenizer=bos, dir=str(data),
                                  val_fraction=0.25, shard_tokens=16, num_workers=1))
    elsewhere = tmp_path / "copy" / "tokenizer.json"
    elsewhere.parent.mkdir()
    shutil.copy(bos, elsewhere)
    check_manifest(manifest, bos, 400, data)
    check_manifest(manifest, str(elsewhere), 448, data)  # the same file anywhere; more embedding rows are fine
    with pytest.raises(DataError, match=rf"{data}: prepared with tokenizer '{bos}' \(tokenizer hash "
                                        rf"{tokenizer_hash(bos)[:12]}\), but data.tokenizer='{eot}' \(tokenizer hash "
                                        rf"{tokenizer_hash(eot)[:12]}\), which makes other ids; prepare again"):
        check_manifest(manifest, eot, 400, data)
    with pytest.raises(DataError, match=rf"prepared with tokenizer '{bos}' \(tokenizer hash [0-9a-f]{{12}}\), but "
                                        r"data.tokenizer='gpt2', which makes other ids"):
        check_manifest(manifest, "gpt2", 50257, data)
    with pytest.raises(ConfigError, match=r"model.vocab_size: 399 is smaller than tokenizer .* which has 400 ids"):
        check_manifest(manifest, bos, 399, data)
