import hashlib
import json
import struct

import numpy as np
import pytest

from lm.data.shards import (
    HEADER_BYTES,
    ShardWriter,
    check_manifest,
    document_eot,
    dtype_for_vocab,
    is_prepared_file,
    new_manifest,
    open_shard,
    read_header,
    read_manifest,
    shard_name,
    verify_hashes,
    write_manifest,
    write_shard,
)
from lm.errors import DataError


def test_dtype_for_vocab():
    assert dtype_for_vocab(50257) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32
    assert dtype_for_vocab(100277) == np.uint32


def test_shard_name():
    assert shard_name("train", 3) == "train_00003.bin"
    # past 99,999 shards the index grows, and lm.prepare still knows the file for its own (to rebuild it)
    assert shard_name("val", 123456) == "val_123456.bin" and is_prepared_file(shard_name("val", 123456))
    assert not is_prepared_file("val_12.bin") and not is_prepared_file("notes_00001.bin")


@pytest.mark.parametrize("dtype, top", [(np.uint16, 65535), (np.uint32, 100276)])
def test_round_trip(tmp_path, dtype, top):
    tokens = np.array([0, 1, 50256, top, 7], dtype=dtype)
    path = tmp_path / "train_00000.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    assert raw[:HEADER_BYTES] == b"LMTOKENS" + struct.pack("<IIQ", 1, np.dtype(dtype).itemsize, 5) + bytes(8)
    assert len(raw) == 32 + 5 * np.dtype(dtype).itemsize
    loaded = open_shard(path)
    assert loaded.dtype == dtype
    assert loaded.tolist() == [0, 1, 50256, top, 7]
    assert not loaded.flags.writeable
    assert [p.name for p in tmp_path.iterdir()] == ["train_00000.bin"]


def test_writer_cuts_exact_shards(tmp_path):
    writer = ShardWriter(tmp_path, "val", 4, np.uint16)
    chunks = [np.arange(0, 3), np.arange(3, 4), np.arange(4, 13), np.arange(13, 13)]
    for chunk in chunks:
        writer.add(chunk.astype(np.uint16))
    shards = writer.close()
    assert [(s["file"], s["tokens"]) for s in shards] == [
        ("val_00000.bin", 4), ("val_00001.bin", 4), ("val_00002.bin", 4), ("val_00003.bin", 1),
    ]
    # the checksum covers the whole file, header included, so `sha256sum` on the shard agrees with it
    assert [s["sha256"] for s in shards] == [hashlib.sha256((tmp_path / s["file"]).read_bytes()).hexdigest()
                                             for s in shards]
    assert np.concatenate([open_shard(tmp_path / s["file"]) for s in shards]).tolist() == list(range(13))
    assert sorted(p.name for p in tmp_path.iterdir()) == [s["file"] for s in shards]  # no .tmp left


def test_writer_without_tokens_writes_nothing(tmp_path):
    assert ShardWriter(tmp_path, "val", 4, np.uint16).close() == []
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_other_dtype(tmp_path):
    with pytest.raises(ValueError, match="expected uint16 tokens, got int64"):
        ShardWriter(tmp_path, "train", 4, np.uint16).add(np.arange(3))


def _corrupt(path, kind):
    raw = bytearray(path.read_bytes())
    if kind == "magic":
        raw[:8] = b"NOTTOKEN"
    elif kind == "version":
        raw[8:12] = struct.pack("<I", 2)
    elif kind == "itemsize":
        raw[12:16] = struct.pack("<I", 3)
    elif kind == "truncated":
        raw = raw[:-1]
    elif kind == "longer":
        raw += b"\0\0"
    elif kind == "headless":
        raw = raw[:20]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind, message", [
    ("magic", r"magic b'NOTTOKEN', expected b'LMTOKENS'"),
    ("version", r"format version 2, expected 1"),
    ("itemsize", r"3 bytes per token, expected 2 \(uint16\) or 4 \(uint32\)"),
    ("truncated", r"file is 41 bytes, but its header \(5 tokens x 2 bytes\) implies 42"),
    ("longer", r"file is 44 bytes, but its header \(5 tokens x 2 bytes\) implies 42"),
    ("headless", r"20 bytes, shorter than the 32-byte shard header"),
])
def test_corrupt_shard_errors_name_the_file(tmp_path, kind, message):
    path = tmp_path / "train_00000.bin"
    write_shard(path, np.arange(5, dtype=np.uint16))
    _corrupt(path, kind)
    with pytest.raises(DataError, match=message) as err:
        open_shard(path)
    assert str(path) in str(err.value)


def _prepared_dir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    writer = ShardWriter(data, "train", 4, np.uint16)
    writer.add(np.arange(10, dtype=np.uint16))
    shards = writer.close()
    manifest = new_manifest("gpt2", 50257, 50256, "x", "h", {
        "train": {"documents": 1, "tokens": 10, "shards": shards},
        "val": {"documents": 0, "tokens": 0, "shards": []},
    })
    write_manifest(data, manifest)
    return data, manifest


def test_write_shard_refuses_an_empty_array(tmp_path):
    with pytest.raises(ValueError, match=r"a shard holds a non-empty 1-D token array, got shape \(0,\)"):
        write_shard(tmp_path / "train_00000.bin", np.empty(0, dtype=np.uint16))
    assert list(tmp_path.iterdir()) == []


def test_a_header_only_shard_of_zero_tokens_is_refused(tmp_path):
    path = tmp_path / "train_00000.bin"
    path.write_bytes(b"LMTOKENS" + struct.pack("<IIQ", 1, 2, 0) + bytes(8))  # a consistent size, but empty
    with pytest.raises(DataError, match=r"header says 0 tokens; shards are never empty"):
        open_shard(path)


def test_a_manifest_whose_dtype_differs_from_its_shards_is_refused(tmp_path):
    data, manifest = _prepared_dir(tmp_path)
    manifest["dtype"] = "uint32"
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"train_00000.bin: holds 4 uint16 tokens, but .*manifest.json lists 4 uint32"):
        read_manifest(data)


def _killed_writer(data_dir, tokens: np.ndarray, after: np.ndarray) -> dict:
    """The state of a writer of 4-token shards after `tokens`, which then wrote `after` and was killed."""
    writer = ShardWriter(data_dir, "train", 4, np.uint16)
    writer.add(tokens)
    state = writer.state()
    writer.add(after)
    writer._file.close()  # killed: no close(), its open shard left as it was
    return state


def test_restore_goes_on_with_the_tokens_of_the_state(tmp_path):
    state = _killed_writer(tmp_path, np.arange(6, dtype=np.uint16), np.arange(100, 103, dtype=np.uint16))
    resumed = ShardWriter.restore(tmp_path, "train", 4, np.uint16, state)  # 100, 101 finished a shard since
    resumed.add(np.arange(6, 9, dtype=np.uint16))
    shards = resumed.close()
    assert [(s["file"], s["tokens"]) for s in shards] == [("train_00000.bin", 4), ("train_00001.bin", 4),
                                                          ("train_00002.bin", 1)]
    assert np.concatenate([open_shard(tmp_path / s["file"]) for s in shards]).tolist() == list(range(9))


def test_restore_refuses_an_open_shard_whose_tokens_changed(tmp_path):
    state = _killed_writer(tmp_path, np.arange(6, dtype=np.uint16), np.arange(0, dtype=np.uint16))
    _flip_byte(tmp_path / state["open"]["file"], HEADER_BYTES)  # the first open token: the size stays right
    with pytest.raises(DataError, match=r"sha256 of its first 2 tokens differs from the one recorded"):
        ShardWriter.restore(tmp_path, "train", 4, np.uint16, state)


def test_manifest_round_trip(tmp_path):
    data, manifest = _prepared_dir(tmp_path)
    assert read_manifest(data) == manifest
    assert read_header(data / "train_00002.bin") == (np.uint16, 2)


def test_manifest_missing_dir(tmp_path):
    with pytest.raises(DataError, match=r"data.dir: no directory .*nowhere'; run `python -m lm.prepare` first"):
        read_manifest(tmp_path / "nowhere")


def test_manifest_missing(tmp_path):
    with pytest.raises(DataError, match=r"manifest.json: no manifest.*run `python -m lm.prepare` first"):
        read_manifest(tmp_path)


def test_manifest_unreadable(tmp_path):
    data, _ = _prepared_dir(tmp_path)
    (data / "manifest.json").write_text('{"format_version": 1, ')
    with pytest.raises(DataError, match=r"manifest.json: unreadable manifest \(JSONDecodeError"):
        read_manifest(data)


def test_manifest_shard_missing(tmp_path):
    data, _ = _prepared_dir(tmp_path)
    (data / "train_00001.bin").unlink()
    with pytest.raises(DataError, match=r"train_00001.bin: listed in .*manifest.json but missing"):
        read_manifest(data)


def test_manifest_shard_count_differs(tmp_path):
    data, manifest = _prepared_dir(tmp_path)
    manifest["splits"]["train"]["shards"][2]["tokens"] = 3
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"train_00002.bin: holds 2 uint16 tokens, but .* lists 3 uint16"):
        read_manifest(data)


def test_manifest_shard_entry_removed(tmp_path):
    data, manifest = _prepared_dir(tmp_path)
    del manifest["splits"]["train"]["shards"][-1]  # its file is still there; the run would skip its tokens
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"manifest.json: splits.train.tokens is \d+, but its shards list \d+ tokens"):
        read_manifest(data)


@pytest.mark.parametrize("edit", ["val shard in train", "outside", "twice"])
def test_a_manifest_listing_shards_lm_prepare_would_not_is_refused(tmp_path, edit):
    # --verify had passed each: a val shard trained on, a file outside data.dir, a shard read twice
    data, manifest = _prepared_dir(tmp_path)
    train = manifest["splits"]["train"]["shards"]
    train[1] = {"val shard in train": {**train[1], "file": "val_00000.bin"},
                "outside": {**train[1], "file": "../x/train_00001.bin"}, "twice": train[0]}[edit]
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"manifest.json: splits.train.shards\[1\] is '.*', where lm.prepare lists "
                                        r"'train_00001.bin'"):
        read_manifest(data)


@pytest.mark.parametrize("key, value", [("file", 5), ("tokens", "2"), ("tokens", True)])
def test_manifest_shard_entry_of_the_wrong_type(tmp_path, key, value):
    data, manifest = _prepared_dir(tmp_path)
    manifest["splits"]["train"]["shards"][2][key] = value  # a hand edit: one error line, not a traceback
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"manifest.json: unreadable manifest \(TypeError: each shard's file must be"):
        read_manifest(data)


def test_document_eot_must_be_a_token_id(tmp_path):
    data, manifest = _prepared_dir(tmp_path)
    assert document_eot(manifest, data) == 50256
    manifest["eot_id"] = "x"
    with pytest.raises(DataError, match=r"manifest.json: eot_id is 'x', not a token id \(an integer\)"):
        document_eot(manifest, data)


def test_check_manifest(tmp_path):
    data, manifest = _prepared_dir(tmp_path)
    check_manifest(manifest, "gpt2", 50257, data)
    with pytest.raises(DataError, match=r"prepared with tokenizer 'gpt2', but data.tokenizer='cl100k_base'"):
        check_manifest(manifest, "cl100k_base", 100277, data)
    with pytest.raises(DataError, match=r"prepared with vocab_size 50257, but model.vocab_size=50304"):
        check_manifest(manifest, "gpt2", 50304, data)
    with pytest.raises(DataError, match=r"prepared with vocab_size 50257, but model.vocab_size=50000"):
        check_manifest(manifest, "gpt2", 50000, data)  # smaller: ids past the table


def _flip_byte(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_verify_hashes_names_a_shard_with_a_flipped_byte(tmp_path):
    data, manifest = _prepared_dir(tmp_path)
    verify_hashes(data, manifest)
    _flip_byte(data / "train_00001.bin", HEADER_BYTES + 3)  # a token's byte: the size stays right
    read_manifest(data)  # sizes alone cannot see it
    with pytest.raises(DataError, match=r"train_00001.bin: sha256 differs from manifest.json"):
        verify_hashes(data, manifest)


def test_verify_hashes_refuses_a_manifest_without_checksums(tmp_path):
    data, manifest = _prepared_dir(tmp_path)
    del manifest["splits"]["train"]["shards"][0]["sha256"]
    with pytest.raises(DataError, match=r"no sha256 for train_00000.bin .* with --force to add them"):
        verify_hashes(data, manifest)


def test_token_ids_are_checked_against_the_vocabulary(tmp_path):
    from lm.data.shards import check_token_ids

    check_token_ids(np.array([0, 5, 9]), 10, tmp_path / "a.bin")
    with pytest.raises(DataError, match=r"a.bin: token 10 at position 1 is not below the vocabulary size 10"):
        check_token_ids(np.array([9, 10]), 10, tmp_path / "a.bin")
    with pytest.raises(DataError, match=r"a.bin: token 12 at position 1,003 is not below the vocabulary size 10"):
        check_token_ids(np.array([0, 5, 12, 99]), 10, tmp_path / "a.bin", start=1001)
