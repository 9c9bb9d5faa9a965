import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lm.errors import CheckpointError
from lm.hf.safetensors_rows import read_header, read_rows


def raw_file(path: Path, header: bytes, length: int | None = None) -> Path:
    """A file of an 8-byte header length (`length`, else the header's own) and `header`."""
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header)
    return path


def test_rows_are_read_from_their_own_byte_range(tmp_path):
    path = tmp_path / "two.safetensors"
    a = torch.arange(12.0).reshape(4, 3)
    b = torch.arange(100.0, 110.0).reshape(5, 2).to(torch.bfloat16)
    save_file({"a": a, "b": b}, path, metadata={"format": "pt"})
    tensors = read_header(path)
    assert sorted(tensors) == ["a", "b"]
    assert tensors["b"].stored_dtype == "BF16" and tensors["b"].shape == (5, 2) and tensors["b"].row_bytes == 4
    assert torch.equal(read_rows(tensors["a"], 1, 3), a[1:3])
    assert torch.equal(read_rows(tensors["b"], 2, 5), b[2:5])
    out = torch.empty(2, 3)
    assert read_rows(tensors["a"], 2, 4, out=out) is out and torch.equal(out, a[2:4])


def test_a_file_cut_inside_a_tensor_is_refused_as_truncated(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(12.0).reshape(4, 3)}, path)
    path.write_bytes(path.read_bytes()[:-4])  # the last element's bytes are gone
    tensor = read_header(path)["w"]
    assert torch.equal(read_rows(tensor, 0, 3), torch.arange(9.0).reshape(3, 3))  # rows before the cut still read
    with pytest.raises(CheckpointError) as err:
        read_rows(tensor, 0, 4)
    assert str(err.value) == f"{path}: ends inside w; the file is truncated"


def test_a_header_longer_than_the_formats_limit_is_refused(tmp_path):
    path = raw_file(tmp_path / "long.safetensors", b"{}", length=100 * 2**20 + 1)
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    assert str(err.value) == f"{path}: not a readable safetensors file: header length {100 * 2**20 + 1}"


def test_a_file_shorter_than_the_header_length_is_refused(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match=f"^{path}: not a readable safetensors file: "):
        read_header(path)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [2], "data_offsets": None},  # TypeError
    {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 16]},  # ValueError
    {"dtype": "F32", "shape": [2]},  # KeyError
    [1, 2],  # TypeError
])
def test_a_malformed_header_entry_is_refused(entry, tmp_path):
    path = raw_file(tmp_path / "bad.safetensors", json.dumps({"w": entry}).encode())
    with pytest.raises(CheckpointError, match=f"^{path}: not a readable safetensors file: bad header entry"):
        read_header(path)


def test_a_tensor_of_another_dtype_is_listed_but_not_a_float(tmp_path):
    path = tmp_path / "mixed.safetensors"
    save_file({"w": torch.ones(2, 2), "mask": torch.ones(2, dtype=torch.bool), "ids": torch.arange(3)}, path)
    tensors = read_header(path)
    assert {name: t.is_float for name, t in tensors.items()} == {"w": True, "mask": False, "ids": False}
    assert tensors["mask"].stored_dtype == "BOOL" and tensors["ids"].stored_dtype == "I64"


@pytest.mark.parametrize("header, kind", [(b"[]", "list"), (b"3", "int"), (b'"x"', "str")])
def test_a_header_that_is_no_json_object_is_refused(header, kind, tmp_path):
    path = raw_file(tmp_path / "odd.safetensors", header)
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    assert str(err.value) == f"{path}: not a readable safetensors file: the header is JSON {kind}, not an object"


def test_a_byte_range_that_disagrees_with_the_shape_is_refused(tmp_path):
    # 2 x 3 float32s need 24 bytes: 16 would read the next tensor's bytes as the last row
    entries = {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]},
               "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}
    path = raw_file(tmp_path / "short.safetensors", json.dumps(entries).encode())
    path.write_bytes(path.read_bytes() + bytes(24))
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    assert str(err.value) == (f"{path}: not a readable safetensors file: w (F32 [2, 3]) needs 24 bytes, and its "
                              "data_offsets give 16")
