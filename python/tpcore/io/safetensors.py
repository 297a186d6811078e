"""The safetensors format (Hugging Face's), tpcore's own reader and writer: the header
checked against the format's rules (read_safetensors_header), the writer, the memory-mapped
reader (read_safetensors, bfloat16 as BF16View without torch) and to_float32.  The reader
that streams tensors with pread (open_safetensors) is lazy.py's."""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Dict, Tuple

import numpy as np

from tpcore.utils.arrays import asarray
from tpcore.io.checks import _short, bad, is_int, parse_json, regular_file, type_name

_ST_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
              "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_ST_READ = dict(_ST_DTYPES, BF16=np.uint16)        # what a tensor of the file is read as (BF16: its bits)
MAX_HEADER = 100_000_000                           # the safetensors format's bound on the JSON header


class TensorInfo(tuple):
    """(dtype name, shape, begin, end) of one tensor of a safetensors header."""
    __slots__ = ()

    def __new__(cls, dtype, shape, begin, end):
        return tuple.__new__(cls, (dtype, shape, begin, end))

    dtype = property(lambda self: self[0])
    shape = property(lambda self: self[1])
    begin = property(lambda self: self[2])
    end = property(lambda self: self[3])

    @property
    def floating(self) -> bool:
        return self[0] in ("F16", "BF16", "F32", "F64")


def read_safetensors_header(path: str) -> Tuple[Dict[str, TensorInfo], Dict[str, str], int]:
    """The checked header of a safetensors file: ({name: TensorInfo}, metadata, offset of
    the data section).  Reads only the header.  Enforces the format: a header length of at
    most 100 MB inside the file, a UTF-8 JSON object starting with "{" and without duplicate
    keys, "__metadata__" a str -> str object, every tensor an object with a known dtype, a
    shape of non-negative integers and data_offsets [begin, end] with shape x itemsize =
    end - begin, the tensors' byte ranges in order without overlaps or holes and exactly
    covering the data section up to the end of the file.  Else CheckpointError."""
    size = regular_file(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise bad(path, "header length", "an 8-byte little-endian length (a safetensors file)",
                      f"a file of {size} bytes")
        (n,) = struct.unpack("<Q", raw)
        if not 2 <= n <= min(size - 8, MAX_HEADER):
            why = "past the end of the file" if n > size - 8 else "too long" if n > MAX_HEADER else "too short"
            raise bad(path, "header length", f"2 to {min(size - 8, MAX_HEADER)} bytes (the file has {size} bytes, "
                      f"the format allows at most {MAX_HEADER})", f"{n} ({why}; not a safetensors file or truncated)")
        text = f.read(n)
    if len(text) != n:
        raise bad(path, "header", f"{n} bytes", f"{len(text)} (the file changed while read)")
    if text[:1] != b"{":
        raise bad(path, "header", "a JSON object starting with '{'", _short(text[:16]))
    header = parse_json(text, path, "header")
    if not isinstance(header, dict):
        raise bad(path, "header", "a JSON object", type_name(header))
    meta = header.pop("__metadata__", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise bad(path, "__metadata__", "an object of strings", type_name(meta))
    for k, v in meta.items():
        if not isinstance(v, str):
            raise bad(path, f"__metadata__[{k!r}]", "a string", type_name(v))
    data = size - 8 - n
    out, spans = {}, []
    for name, info in header.items():
        where = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise bad(path, where, "an object with dtype, shape and data_offsets", type_name(info))
        for key in ("dtype", "shape", "data_offsets"):
            if key not in info:
                raise bad(path, f"{where}", f"a {key!r} entry", f"keys {sorted(info)}")
        dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dt, str) or dt not in _ST_READ:
            raise bad(path, f"{where} dtype", f"one of {', '.join(sorted(_ST_READ))}", type_name(dt))
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise bad(path, f"{where} shape", "a list of non-negative integers", type_name(shape))
        if not (isinstance(offs, list) and len(offs) == 2 and all(is_int(o) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise bad(path, f"{where} data_offsets", "[begin, end], integers with 0 <= begin <= end", type_name(offs))
        nbytes = math.prod(shape) * np.dtype(_ST_READ[dt]).itemsize
        if offs[1] - offs[0] != nbytes:
            raise bad(path, f"{where} data_offsets", f"{nbytes} bytes (shape {_short(shape)} x {dt})",
                      f"{offs} ({offs[1] - offs[0]} bytes)")
        if offs[1] > data:
            raise bad(path, f"{where} data_offsets", f"an end within the {data} bytes of data the file holds",
                      f"{offs} (the file is truncated or the header lies)")
        out[name] = TensorInfo(dt, tuple(shape), offs[0], offs[1])
        spans.append((offs[0], offs[1], name))
    spans.sort()
    pos, prev = 0, None
    for b0, b1, name in spans:
        if b0 != pos:
            what = f"overlaps tensor {prev!r} (which ends at {pos})" if b0 < pos else \
                f"leaves a hole of {b0 - pos} bytes after {'the header' if prev is None else repr(prev)}"
            raise bad(path, f"tensor {name!r} data_offsets", f"to begin at byte {pos} (tensors are contiguous)",
                      f"[{b0}, {b1}], which {what}")
        pos, prev = b1, name
    if pos != data:
        raise bad(path, "data section", f"{pos} bytes (the end of the last tensor)",
                  f"{data} bytes after the header (trailing bytes or a truncated file)")
    return out, meta, 8 + n


def write_safetensors(path: str, tensors: Dict[str, np.ndarray], metadata: Dict[str, str] = None) -> None:
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        st_name = "BF16" if a.dtype.name == "bfloat16" else _ST_NAMES.get(a.dtype)
        if st_name is None:
            raise TypeError(f"safetensors: dtype {a.dtype} of {name!r} is not supported")
        if st_name == "BF16":  # ml_dtypes' bfloat16: its bits, little-endian
            a = a.view(np.uint16)
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": st_name, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the format pads the header to 8 bytes
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


class BF16View:
    """A bfloat16 tensor of a memory-mapped file (NumPy has no bfloat16): indexing
    reads only the selected elements and gives them as float32."""

    def __init__(self, raw: np.ndarray):
        self._raw = raw  # uint16 bit patterns
        self.shape, self.ndim, self.dtype_name = raw.shape, raw.ndim, "bfloat16"

    def __getitem__(self, key) -> np.ndarray:
        bits = np.asarray(self._raw[key], dtype=np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def __array__(self, dtype=None, copy=None):
        a = self[...]
        return a if dtype is None else a.astype(dtype)


def to_float32(a) -> np.ndarray:
    """Any float tensor (NumPy, memory-mapped, bfloat16 view, ml_dtypes) as float32."""
    if isinstance(a, BF16View):
        return a[...]
    a = asarray(a, "a tensor", "checkpoint")
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise TypeError(f"expected a floating-point tensor, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def read_safetensors(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Every tensor of the file, memory-mapped (read-only: nothing is read until a
    tensor is indexed), and its metadata.  BF16 tensors come as BF16View.  The header
    is checked first (read_safetensors_header): a corrupt file raises CheckpointError."""
    header, meta, start = read_safetensors_header(path)
    size = os.path.getsize(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=start) if size > start else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        dt = np.dtype(_ST_READ[info.dtype]).newbyteorder("<")
        out[name] = mm[info.begin:info.end].view(dt).reshape(info.shape)
        if info.dtype == "BF16":
            out[name] = BF16View(out[name])
    return out, meta
