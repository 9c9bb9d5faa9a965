"""Rows of the tensors in a safetensors file, read with plain file reads.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape
and byte range, then the row-major data. Reading rows [lo, hi) of a tensor is one read of a contiguous byte
range, straight into the destination when the dtypes agree. Not memory-mapping the file keeps the bytes read
out of the process's resident set (a map's pages count in it until the whole map is dropped), so importing
a model costs its parameters' memory and one tensor's, and an FSDP rank reads only the rows it keeps.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from lm.errors import CheckpointError

__all__ = ["DTYPES", "StoredTensor", "read_header", "read_rows"]

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_MAX_HEADER = 100 * 2**20  # the format's own limit


@dataclass(frozen=True)
class StoredTensor:
    path: Path
    name: str
    stored_dtype: str
    """The file's name for the dtype (F32, BF16, BOOL, ...)."""
    shape: tuple[int, ...]
    start: int
    """Byte offset of the tensor's first element in the file."""

    @property
    def is_float(self) -> bool:
        return self.stored_dtype in DTYPES

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of a floating-point tensor (the only kind a weight is: check `is_float` first)."""
        return DTYPES[self.stored_dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one element for a 1-D tensor)."""
        return torch.Size(self.shape[1:]).numel() * self.dtype.itemsize


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors file `path` by name; CheckpointError for a file that is not one. A
    tensor of another dtype than a float's (a buffer of flags, say) is listed, and refused only if read."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= _MAX_HEADER:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file: {err}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file: the header is JSON "
                              f"{type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    tensors = {}
    try:
        for name, info in header.items():
            begin, end = info["data_offsets"]
            tensor = StoredTensor(path, name, str(info["dtype"]), tuple(info["shape"]), 8 + length + begin)
            # rows are read by offset: a byte range too short for the shape would read the next tensor's bytes
            need = torch.Size(tensor.shape).numel() * tensor.dtype.itemsize if tensor.is_float else end - begin
            if end - begin != need:
                raise CheckpointError(f"{path}: not a readable safetensors file: {name} ({tensor.stored_dtype} "
                                      f"{list(tensor.shape)}) needs {need} bytes, and its data_offsets give "
                                      f"{end - begin}")
            tensors[name] = tensor
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file: bad header entry ({err})") from None
    return tensors


def read_rows(tensor: StoredTensor, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [lo, hi) of `tensor` (elements, for a 1-D one), read into `out` when it is given, contiguous and of
    the stored dtype, else into a new tensor; returns what was read into."""
    shape = (hi - lo, *tensor.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=tensor.dtype)
    assert out.is_contiguous() and out.dtype == tensor.dtype and tuple(out.shape) == shape
    buffer = out.view(torch.uint8).view(-1).numpy()  # the tensor's own bytes: reading fills it
    with open(tensor.path, "rb") as f:
        f.seek(tensor.start + lo * tensor.row_bytes)
        if f.readinto(buffer) != buffer.nbytes:
            raise CheckpointError(f"{tensor.path}: ends inside {tensor.name}; the file is truncated")
    return out
