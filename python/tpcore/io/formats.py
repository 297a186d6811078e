"""Checkpoint formats, in one place: every file tpcore reads or writes for parameters.

- safetensors (the Hugging Face format; tpcore's own reader and writer: headers checked
  against the format's rules, tensors read with pread on indexing (open_safetensors; the
  loaders stream them, tpcore.io.stream) or memory-mapped (read_safetensors), bfloat16 without torch),
- NumPy .npz (checked before it is read: no pickles, headers that match the members),
- strict JSON (config.json, tpcore_config.json, generation_config.json, index files),
- the files of tpcore.save (one file, or one per rank "<stem>.rank<r>-of-<n><suffix>",
  with tpcore's metadata),
- a model folder: Hugging Face's (config.json, *.safetensors and the
  *.safetensors.index.json of a sharded checkpoint) and tpcore's own from
  save_pretrained (tpcore_config.json with model.safetensors, or
  model.rank<r>-of-<n>.safetensors of tensors param.<i>).

Every corrupt or inconsistent file raises CheckpointError (a ValueError) naming the
file, the tensor or field, what was expected and what was found.  This module knows
file layouts only: what the tensors mean (names, shapes of a model) is the Hugging Face
module's (hf.py) and the models' (models.py)."""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import stat
import struct
import sys
import zipfile
from typing import Dict, Tuple

import numpy as np

from tpcore.utils.args import is_int
from tpcore.utils.arrays import asarray

# safetensors and strict JSON ----------------------------------------------------------
_ST_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
              "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_ST_READ = dict(_ST_DTYPES, BF16=np.uint16)        # what a tensor of the file is read as (BF16: its bits)
MAX_HEADER = 100_000_000                           # the safetensors format's bound on the JSON header


class CheckpointError(ValueError):
    """A checkpoint file that is corrupt, or that disagrees with itself or with its config:
    a safetensors file (header length, JSON, dtypes, shapes, data_offsets), a config.json,
    tpcore_config.json, generation_config.json or *.safetensors.index.json, or one of
    tpcore's own .npz / .safetensors checkpoints.  The message reads
    "<file>: <tensor or field>: expected <what>, found <what>"; the parts are also the
    attributes path, field, expected and found.  A lower-level error (JSON, UTF-8, zip)
    is chained as __cause__.  Raised before any memory is allocated for the model."""

    def __init__(self, message: str, *, path=None, field=None, expected=None, found=None):
        super().__init__(message)
        self.path, self.field, self.expected, self.found = path, field, expected, found


def _short(v, n: int = 80) -> str:
    r = v if isinstance(v, str) and not v.startswith("'") else repr(v)
    return r if len(r) <= n else r[:n - 3] + "..."


def bad(path, field, expected, found) -> CheckpointError:
    """CheckpointError "<path>: <field>: expected <expected>, found <found>" (found: a
    string as it is, another value as its repr cut at 80 characters)."""
    found_s = found if isinstance(found, str) else _short(found)
    return CheckpointError(f"{path}: {field}: expected {expected}, found {found_s}",
                           path=str(path), field=field, expected=expected, found=found)


def type_name(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__) + f" ({_short(v, 40)})"


def parse_json(raw: bytes, path, field: str = "JSON"):
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, bounded nesting."""
    def pairs(kv):
        d = {}
        for k, v in kv:
            if k in d:
                raise bad(path, f"key {k!r}", "each key once (duplicate keys are ambiguous)", "it twice")
            d[k] = v
        return d

    def const(name):
        raise bad(path, field, "standard JSON numbers", name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(path, field, "UTF-8 text", f"invalid byte {raw[e.start:e.start + 1]!r} at offset {e.start}") from e
    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=const)
    except RecursionError as e:
        raise bad(path, field, "JSON nested to a sane depth", "nesting too deep to parse") from e
    except json.JSONDecodeError as e:
        raise bad(path, field, "valid JSON", f"{e.msg} at line {e.lineno} column {e.colno}") from e
    except CheckpointError:
        raise
    except ValueError as e:   # e.g. an integer of more than 4300 digits
        raise bad(path, field, "valid JSON", str(e)) from e


def regular_file(path: str) -> int:
    """The size of `path`, which must be a regular file (a symlink to one is fine): a
    directory, a FIFO (open would block) or a device (/dev/zero: endless) is refused."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise bad(path, "file", "a readable regular file", f"{type(e).__name__}: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else
                "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise bad(path, "file", "a regular file", kind)
    return st.st_size


def read_json_object(path: str, max_bytes: int = 64 << 20) -> dict:
    """A small JSON file (config.json and the like) that must hold one object."""
    size = regular_file(path)
    if size > max_bytes:
        raise bad(path, "file size", f"at most {max_bytes} bytes for a JSON file", f"{size} bytes")
    with open(path, "rb") as f:
        data = f.read(size + 1)  # bounded even if the file grows meanwhile (size <= max_bytes)
    if len(data) > max_bytes:
        raise bad(path, "file size", f"at most {max_bytes} bytes for a JSON file", "more")
    obj = parse_json(data, path)
    if not isinstance(obj, dict):
        raise bad(path, "top level", "a JSON object", type_name(obj))
    return obj


MISSING = object()
INT_MAX = 2 ** 31 - 1       # sizes the C core takes as C ints


class ConfigFields:
    """Typed reads of a config dict, each failure a CheckpointError naming the file and
    field: fields.int("n_head"), fields.num("layer_norm_epsilon", 1e-5), ..."""

    def __init__(self, d: dict, source: str):
        if not isinstance(d, dict):
            raise bad(source, "top level", "a JSON object", type_name(d))
        self.d, self.source = d, str(source)

    def get(self, key, default=MISSING):
        if key not in self.d:
            if default is MISSING:
                raise bad(self.source, key, "a value (a required field)", "no such field")
            return default
        return self.d[key]

    def int(self, key, default=MISSING, lo=1, hi=INT_MAX, null=False):
        v = self.get(key, default)
        if v is None and null:
            return None
        if not (is_int(v) and lo <= v <= hi):
            raise bad(self.source, key, f"an integer from {lo} to {hi}{' or null' if null else ''}", type_name(v))
        return v

    def num(self, key, default=MISSING, positive=True):
        v = self.get(key, default)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and (v > 0 or not positive)):
            raise bad(self.source, key, f"a finite number{' > 0' if positive else ''}", type_name(v))
        return float(v)

    def bool(self, key, default=MISSING):
        v = self.get(key, default)
        if v is None:
            v = default
        if not isinstance(v, bool):
            raise bad(self.source, key, "true or false", type_name(v))
        return v

    def str(self, key, default=MISSING, choices=None, note=""):
        v = self.get(key, default)
        if not isinstance(v, str) or (choices is not None and v not in choices):
            want = "a string" if choices is None else f"one of {', '.join(map(repr, choices))}{note}"
            raise bad(self.source, key, want, type_name(v))
        return v

    def obj(self, key):
        v = self.get(key, None)
        if v is not None and not isinstance(v, dict):
            raise bad(self.source, key, "an object or null", type_name(v))
        return v or {}

    def fail(self, key, expected, found):
        return bad(self.source, key, expected, found)


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


def open_safetensors(path: str) -> Tuple[Dict[str, object], Dict[str, str]]:
    """Every tensor of the file as a tpcore.io.formats.FileTensor (read with pread on indexing,
    never memory-mapped: a load streams a rank's slices through one staging buffer), and
    its metadata.  The header is checked first (read_safetensors_header)."""
    header, meta, start = read_safetensors_header(path)
    return {name: FileTensor(path, name, info.dtype, info.shape, start + info.begin)
            for name, info in header.items()}, meta


# Lazy tensors of a file: rows read with pread on indexing (tpcore.io.stream streams them) ----------
def split_row_index(key, n):
    """The row part of an index into an n-row tensor, as NumPy would resolve it (negative
    indices, clamped slices, boolean masks): (index for the base rows, is_scalar, rest)."""
    if key is Ellipsis:
        key = ()
    key = key if isinstance(key, tuple) else (key,)
    if key and key[0] is Ellipsis:
        key = (slice(None),) + key[1:]
    first = key[0] if key else slice(None)
    rows = np.arange(n)[first]
    return rows, np.ndim(rows) == 0, key[1:]


def base_row_index(rows, off):
    rows = np.atleast_1d(rows) + off
    if rows.size and np.all(np.diff(rows) == 1):
        return slice(int(rows[0]), int(rows[-1]) + 1)  # a contiguous run: a plain (cheap) slice of the map
    return rows


def row_runs(rows: np.ndarray):
    """(position in rows, first row, count) of each run of consecutive rows."""
    if rows.size == 0:
        return
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.r_[0, cut]
    ends = np.r_[cut, rows.size]
    for s, e in zip(starts.tolist(), ends.tolist()):
        yield s, int(rows[s]), e - s


def _col_range(cols, n: int):
    """(lo, hi) of a step-1 column slice (None: all columns)."""
    if cols is None:
        return 0, n
    lo, hi, step = cols.indices(n)
    if step != 1:
        raise IndexError("a column slice with a step is not supported here")
    return lo, max(lo, hi)


def _pread_into(fd, buf: np.ndarray, offset: int, path, name) -> None:
    """buf's bytes from the file at offset; a short read (a truncated file, one that shrank
    while read) is a CheckpointError naming the file and tensor."""
    mv = memoryview(buf).cast("B")
    want, got = mv.nbytes, 0
    while got < want:
        n = os.preadv(fd, [mv[got:]], offset + got)
        if n <= 0:
            raise bad(path, f"tensor {name!r}", f"{want} bytes at offset {offset}",
                      f"{got} bytes (the file is truncated or changed while read)")
        got += n


def read_rows(path, name, offset: int, row_bytes: int, rows: np.ndarray, lo: int, hi: int, out: np.ndarray) -> None:
    """Bytes lo:hi of each of rows (rows of row_bytes from offset in the file) into out
    (C-contiguous, len(rows) x (hi - lo) bytes): one pread per run of consecutive whole
    rows, one per row for a part of each."""
    flat = out.reshape(len(rows), -1)
    fd = os.open(path, os.O_RDONLY)
    try:
        if lo == 0 and hi == row_bytes:
            for pos, r, n in row_runs(np.asarray(rows, np.int64)):
                _pread_into(fd, flat[pos:pos + n], offset + r * row_bytes, path, name)
        elif hi > lo:
            for i, r in enumerate(np.asarray(rows, np.int64).tolist()):
                _pread_into(fd, flat[i], offset + r * row_bytes + lo, path, name)
    finally:
        os.close(fd)


class FileTensor:
    """A tensor of a safetensors file, read with pread on indexing (no memory map): t[rows]
    / t[rows, a:b] follow NumPy's rules for the first axis and read only the selected rows
    (and columns); a BF16 tensor reads as float32 (NumPy has no bfloat16)."""

    def __init__(self, path: str, name: str, st_dtype: str, shape, offset: int):
        self.path, self.name, self.st_dtype = path, name, st_dtype
        self.raw_dtype = np.dtype(_ST_READ[st_dtype]).newbyteorder("<")
        self.shape, self.ndim, self.offset = tuple(shape), len(shape), int(offset)
        self.dtype_name = "bfloat16" if st_dtype == "BF16" else self.raw_dtype.name
        self.dtype = np.dtype(np.float32) if st_dtype == "BF16" else self.raw_dtype
        self.row_elems = math.prod(self.shape[1:]) if self.ndim else 1
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.raw_dtype.itemsize

    def __repr__(self):
        return f"FileTensor({os.path.basename(self.path)!r}, {self.name!r}, {self.st_dtype}, shape={self.shape})"

    def __len__(self):
        if not self.ndim:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def read_raw(self, rows: np.ndarray, cols, out: np.ndarray) -> None:
        """The stored values of rows (ascending or not) and columns (a step-1 slice of a 2-D
        tensor, or None) into out (raw dtype, (len(rows), ncols), C-contiguous)."""
        it = self.raw_dtype.itemsize
        lo, hi = _col_range(cols, self.row_elems) if self.ndim >= 2 else (0, self.row_elems)
        read_rows(self.path, self.name, self.offset, self.row_elems * it, rows, lo * it, hi * it, out)

    def _convert(self, raw: np.ndarray, out: np.ndarray) -> None:
        if self.st_dtype == "BF16":
            np.left_shift(raw, 16, out=out.view(np.uint32), dtype=np.uint32)
        else:
            np.copyto(out, raw, casting="unsafe")

    def _read_into(self, rows: np.ndarray, cols, out: np.ndarray, stage) -> None:   # stage: _stream.Staging
        """float32 values of rows, cols into out (float32 of their shape; any strides)."""
        direct = (self.raw_dtype == np.dtype("<f4") and out.dtype == np.float32 and out.flags.c_contiguous
                  and sys.byteorder == "little")
        if direct:
            self.read_raw(rows, cols, out)
            return
        raw = stage.take(out.shape, self.raw_dtype)
        self.read_raw(rows, cols, raw)
        if out.flags.c_contiguous or self.st_dtype != "BF16":
            self._convert(raw, out) if out.flags.c_contiguous else np.copyto(out, raw, casting="unsafe")
        else:
            tmp = stage.take(out.shape, np.float32)
            self._convert(raw, tmp)
            out[...] = tmp

    def __getitem__(self, key) -> np.ndarray:
        if self.ndim == 0:
            raw = np.empty((1,), self.raw_dtype)
            self.read_raw(np.zeros(1, np.int64), None, raw)
            return self._finish(raw.reshape(()))[key]
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):   # as NumPy: the axes the rest of the key does not name
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            named = sum(1 for k in key if k is not Ellipsis and k is not None)
            key = key[:i] + (slice(None),) * max(0, self.ndim - named) + tuple(k for k in key[i + 1:]
                                                                                 if k is not Ellipsis)
        rows, scalar, rest = split_row_index(key, self.shape[0])
        rows = np.atleast_1d(rows).astype(np.int64)
        cols = None
        if rest and self.ndim >= 2 and isinstance(rest[0], slice) and rest[0].step in (None, 1):
            cols, rest = rest[0], rest[1:]
        lo, hi = _col_range(cols, self.shape[1]) if cols is not None else (0, None)
        inner = self.shape[1:] if cols is None else (hi - lo,) + self.shape[2:]
        if cols is not None and self.ndim > 2:   # a column slice of a 3-D+ tensor: whole rows, then cut
            inner, cols_read = self.shape[1:], None
        else:
            cols_read = cols if cols is not None and self.ndim == 2 else None
        raw = np.empty((rows.size,) + tuple(inner), self.raw_dtype)
        self.read_raw(rows, cols_read, raw)
        out = self._finish(raw)
        if cols is not None and cols_read is None:
            out = out[:, cols]
        if rest:   # the indices after the rows (and the column slice, when one was taken)
            out = out[(slice(None),) * (1 if cols is None else 2) + tuple(rest)]
        return out[0] if scalar else out

    def _finish(self, raw):
        if self.st_dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(raw.dtype.newbyteorder("="), copy=False)

    def __array__(self, dtype=None, copy=None):
        a = self[...]
        return a if dtype is None else a.astype(dtype)


# Filling a destination region ------------------------------------------------------------

# NumPy .npz and the files of tpcore.save ----------------------------------------------
def read_npz(path: str, lazy: bool = False) -> Dict[str, np.ndarray]:
    """Every array of a .npz archive, checked before it is read: a zip of .npy members
    only, no pickled objects, each member's .npy header consistent with the member's
    size (a header that lies about its shape allocates nothing).  Else CheckpointError.
    lazy: a stored (uncompressed, np.savez's) C-order member of a numeric little-endian
    dtype is a tpcore.io.formats.FileTensor at its bytes in the archive (read with pread on
    indexing: the loaders stream it; its CRC is checked first, reading it in 1 MiB pieces);
    the others are read."""
    if os.path.exists(path):
        regular_file(path)
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise bad(path, "file", "a NumPy .npz archive (zip)", f"{type(e).__name__}: {e}") from e
    out = {}
    with zf:
        for info in zf.infolist():
            member = info.filename
            if not member.endswith(".npy") or info.is_dir():
                raise bad(path, f"member {member!r}", "only .npy arrays in the archive", "another kind of member")
            key = member[:-4]
            if key in out:
                raise bad(path, f"array {key!r}", "each array once", "it twice")
            try:
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                    elif version == (2, 0):
                        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                    else:
                        raise bad(path, f"array {key!r}", ".npy format version 1.0 or 2.0", f"version {version}")
                    if dtype.hasobject:
                        raise bad(path, f"array {key!r} dtype", "a numeric dtype (pickled objects are refused)",
                                  str(dtype))
                    hdr = f.tell()
                    need = hdr + math.prod(shape) * dtype.itemsize
                if need != info.file_size:
                    raise bad(path, f"array {key!r}", f"{need} bytes for shape {shape} of {dtype}",
                              f"{info.file_size} bytes in the archive")
                st = _ST_NAMES.get(dtype.newbyteorder("=")) if dtype.byteorder in "<|" or \
                    (dtype.byteorder == "=" and sys.byteorder == "little") else None
                if lazy and st is not None and not fortran and info.compress_type == zipfile.ZIP_STORED:
                    with zf.open(info) as f:   # its CRC checked first, 1 MiB at a time (zipfile raises)
                        while f.read(1 << 20):
                            pass
                    out[key] = FileTensor(path, key, st, shape, _zip_data_offset(path, info) + hdr)
                    continue
                with zf.open(info) as f:
                    out[key] = np.lib.format.read_array(f, allow_pickle=False)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001  zip CRC, zlib, EOF, a malformed .npy header
                raise bad(path, f"array {key!r}", "a readable .npy array", f"{type(e).__name__}: {e}") from e
    return out


def _zip_data_offset(path: str, info) -> int:
    """Where a zip member's bytes start in the archive: after its local header (30 bytes,
    the name and an extra field whose lengths it gives)."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise bad(path, f"member {info.filename!r}", "a zip local file header", "something else")
    return info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")


def _meta_json(path, text, field):
    if not isinstance(text, str):
        raise bad(path, field, "a JSON string", type_name(text))
    meta = parse_json(text.encode("utf-8", "surrogatepass"), path, field)
    if not isinstance(meta, dict):
        raise bad(path, field, "a JSON object", type_name(meta))
    return meta


def check_tensors(path, tensors, expected: Dict[str, tuple], what: str = "the model") -> None:
    """CheckpointError unless tensors holds exactly the names of expected, each a float
    tensor of exactly the expected shape."""
    for k, shape in expected.items():
        t = tensors.get(k)
        if t is None:
            raise bad(path, f"tensor {k!r}", f"a tensor of shape {tuple(shape)} ({what} has it)", "no such tensor")
        if tuple(t.shape) != tuple(shape):
            raise bad(path, f"tensor {k!r}", f"shape {tuple(shape)}", f"shape {tuple(t.shape)}")
        dt = getattr(t, "dtype_name", None) or np.dtype(t.dtype).name
        if not (dt in ("float16", "float32", "float64", "bfloat16")):
            raise bad(path, f"tensor {k!r} dtype", "a floating-point dtype", dt)
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise bad(path, f"tensor {extra[0]!r}", f"only the tensors of {what} ({len(expected)})",
                  f"{len(extra)} unexpected tensor{'s' if len(extra) > 1 else ''}: {_short(extra, 120)}")


def shard_path(path: str, rank: int, world: int) -> str:
    """Rank r's file of a sharded checkpoint: "<stem>.rank<r>-of-<n><suffix>"."""
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}-of-{world}{suffix}"


def file_format(path):
    """"npz" or "safetensors", from the suffix of a tpcore.save path."""
    if path.endswith(".npz"):
        return "npz"
    if path.endswith(".safetensors"):
        return "safetensors"
    raise ValueError(f"checkpoint path must end in .npz or .safetensors, got {path!r}")


def write_tensors_file(path, tensors, meta):
    """One of tpcore.save's files: tensors and tpcore's metadata (a JSON object)."""
    if file_format(path) == "npz":
        np.savez(path, **tensors, __metadata__=np.array(json.dumps(meta)))
    else:
        write_safetensors(path, tensors, {"tpcore": json.dumps(meta)})


def read_tensors_file(path):
    """(tensors, tpcore metadata) of one of tpcore.save's files; CheckpointError if corrupt."""
    if file_format(path) == "npz":
        tensors = read_npz(path, lazy=True)   # stored members read on indexing (pread), streamed
        meta = tensors.pop("__metadata__", None)
        if meta is None:
            return tensors, {}
        if meta.ndim != 0 or meta.dtype.kind != "U":
            raise bad(path, "array '__metadata__'", "a 0-d unicode string", f"{meta.dtype} of shape {meta.shape}")
        return tensors, _meta_json(path, str(meta), "__metadata__")
    tensors, meta = open_safetensors(path)   # read on indexing (pread), streamed by the loaders
    return tensors, _meta_json(path, meta.get("tpcore", "{}"), "__metadata__['tpcore']")


# A Hugging Face checkpoint folder: its safetensors files and index -------------------
def index_files(path: str):
    """The safetensors files of a Hugging Face checkpoint folder, with the tensor -> file
    map of its *.safetensors.index.json when it has one (checked: an object whose
    weight_map names plain files of the folder).  Without an index: every *.safetensors."""
    idx = os.path.join(path, MODEL_FILE + ".index.json")
    found = sorted(glob.glob(os.path.join(path, "*.safetensors.index.json")))
    if not os.path.exists(idx):
        if len(found) > 1:
            raise bad(path, "index", "one *.safetensors.index.json", f"{len(found)}: "
                      f"{[os.path.basename(f) for f in found]}")
        idx = found[0] if found else None
    if idx is None:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        return files, None, None
    f = ConfigFields(read_json_object(idx), idx)
    wm = f.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise f.fail("weight_map", "an object of tensor name -> file name", type_name(wm))
    for name, fn in wm.items():
        if not (isinstance(fn, str) and fn and fn == os.path.basename(fn) and fn not in (".", "..")
                and fn.endswith(".safetensors")):
            raise f.fail(f"weight_map[{name!r}]", "the name of a .safetensors file in the folder", type_name(fn))
        if not os.path.isfile(os.path.join(path, fn)):
            raise f.fail(f"weight_map[{name!r}]", "an existing file of the folder", f"{fn!r}, which is missing")
    return [os.path.join(path, fn) for fn in sorted(set(wm.values()))], wm, idx


def read_headers(path: str):
    """{tensor name: (file, TensorInfo)} over every file of the checkpoint, headers checked
    (no tensor data read): a name in two files, or a file and its index disagreeing, is a
    CheckpointError."""
    files, wm, idx = index_files(path)
    out = {}
    for fn in files:
        header, _, _ = read_safetensors_header(fn)
        for name, info in header.items():
            if name in out:
                raise bad(fn, f"tensor {name!r}", "each tensor in one file", f"it also in {out[name][0]}")
            if wm is not None and wm.get(name) != os.path.basename(fn):
                raise bad(idx, f"weight_map[{name!r}]", f"{os.path.basename(fn)!r} (the file that holds it)",
                          type_name(wm.get(name)) if name in wm else "no entry")
            out[name] = (fn, info)
    if wm is not None:
        for name, fn in wm.items():
            if name not in out:
                raise bad(os.path.join(path, fn), f"tensor {name!r}", f"the tensor (as {os.path.basename(idx)} says)",
                          "no such tensor")
    return out


def open_tensors(path: str, headers=None) -> Dict[str, object]:
    """Every tensor of a Hugging Face checkpoint folder, as FileTensors read on indexing
    (open_safetensors; headers checked; headers: read_headers(path) when the caller has it)."""
    headers = read_headers(path) if headers is None else headers
    starts = {}
    out = {}
    for name, (fn, info) in headers.items():
        if fn not in starts:
            starts[fn] = read_safetensors_header(fn)[2]
        out[name] = FileTensor(fn, name, info.dtype, info.shape, starts[fn] + info.begin)
    return out




# A model folder (TransformerLM.save_pretrained, from_pretrained) ------------------------
HF_CONFIG = "config.json"                   # Hugging Face's config
GENERATION_CONFIG = "generation_config.json"
OWN_CONFIG = "tpcore_config.json"           # tpcore's: Config's fields
MODEL_FILE = "model.safetensors"            # full tensors (tpcore's names, or Hugging Face's)
OWN_PARAM = re.compile(r"param\.(0|[1-9][0-9]*)")  # the tensors of a shard file: parameters() in order


def own_shard_file(folder: str, rank: int, world: int) -> str:
    """model.rank<r>-of-<n>.safetensors: rank r's parameters (save_pretrained(sharded=True))."""
    return shard_path(os.path.join(folder, MODEL_FILE), rank, world)


def own_shard_files(folder: str):
    return sorted(glob.glob(os.path.join(folder, "model.rank*-of-*.safetensors")))


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def write_own_config(folder: str, cfg) -> None:
    """tpcore_config.json: the fields of a Config (a dataclass)."""
    write_json(os.path.join(folder, OWN_CONFIG), dataclasses.asdict(cfg))


def read_own_config(p: str, cls, choices: Dict[str, tuple]):
    """tpcore_config.json: an object of cls's fields (a Config), each checked, then cls(**fields)
    (whose own checks apply the value rules, written once); choices: the allowed strings of
    the fields norm, activation and positions."""
    d = read_json_object(p)
    f = ConfigFields(d, p)
    fields = {x.name for x in dataclasses.fields(cls)}
    kw = {}
    for k in d:
        if k not in fields:
            raise f.fail(k, f"one of Config's fields ({', '.join(sorted(fields))})", "an unknown field")
        if k in ("vocab_size", "hidden", "layers", "heads", "max_positions"):
            kw[k] = f.int(k)
        elif k in ("kv_heads", "ffn_hidden", "head_dim", "sliding_window"):
            kw[k] = f.int(k, null=True)
        elif k == "type_vocab_size":
            kw[k] = f.int(k, lo=0)
        elif k in ("eps", "rope_theta"):
            kw[k] = f.num(k, positive=False)
        elif k in choices:
            kw[k] = f.str(k, choices=choices[k])
        elif k == "model_type":
            kw[k] = f.str(k)
        else:
            kw[k] = f.bool(k)
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        raise bad(p, "config", "a consistent configuration", str(e)) from e


def write_own_shard(folder: str, rank: int, world: int, params) -> None:
    """Rank r's parameters, in order, as param.<i>, with its rank and world in the metadata."""
    tensors = {f"param.{i}": np.ascontiguousarray(p) for i, p in enumerate(params)}
    write_safetensors(own_shard_file(folder, rank, world), tensors,
                      {"format": "tpcore-sharded", "world": str(world), "rank": str(rank)})


def count_own_shards(folder: str, world: int) -> int:
    """The values the world shard files of a sharded save_pretrained checkpoint hold, every
    file checked first (headers only): it exists, its metadata names its rank and world, it
    holds tensors param.<i> of a float dtype."""
    total = 0
    for r in range(world):
        fn = own_shard_file(folder, r, world)
        if not os.path.exists(fn):
            raise bad(fn, "file", f"rank {r}'s shard of a {world}-rank checkpoint", "no such file")
        header, meta, _ = read_safetensors_header(fn)
        for k, want in (("world", str(world)), ("rank", str(r))):
            if k in meta and meta[k] != want:
                raise bad(fn, f"__metadata__[{k!r}]", repr(want), repr(meta[k]))
        for name, info in header.items():
            if not OWN_PARAM.fullmatch(name):
                raise bad(fn, f"tensor {name!r}", "tensors named param.<i>", "another name")
            if not info.floating:
                raise bad(fn, f"tensor {name!r} dtype", "a floating-point dtype", info.dtype)
            total += math.prod(info.shape)
    return total


def read_generation_config(folder: str) -> dict:
    """eos_token_id and pad_token_id of generation_config.json, checked ({} without the file)."""
    p = os.path.join(folder, GENERATION_CONFIG)
    if not os.path.exists(p):
        return {}
    f = ConfigFields(read_json_object(p), p)
    out = {}
    for k in ("eos_token_id", "pad_token_id"):
        v = f.get(k, None)
        if v is None:
            continue
        ids = v if isinstance(v, list) and k == "eos_token_id" else [v]
        if not ids or not all(is_int(x) and x >= 0 for x in ids):
            raise f.fail(k, "a non-negative integer" + (" or a list of them" if k == "eos_token_id" else ""), type_name(v))
        out[k] = v
    return out
