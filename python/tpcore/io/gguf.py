"""GGUF (llama.cpp's file format), tpcore's own reader of its container: the header, the
metadata and the tensor infos, every length and count checked against the bytes left in
the file before anything is sized by it, and the tensors' layout checked as llama.cpp's
loader checks it.  `tpcore.models.gguf` makes models of it; the tensor data is read there
with pread.

The format (version 2 and 3, little-endian)::

    "GGUF"  uint32 version  uint64 tensor_count  uint64 kv_count
    kv_count x  (string key, uint32 value type, value)
    tensor_count x  (string name, uint32 n_dims, uint64 dims[n_dims] innermost first,
                     uint32 ggml type, uint64 offset into the data section)
    padding to general.alignment (default 32), then the data section

A string is a uint64 byte length and UTF-8 bytes; an array a uint32 element type, a uint64
count and the elements.  The checks, each a CheckpointError naming the file and the field
(the key, or the tensor and its name, shape, type or offset):

- every length and count fits in the bytes after it (a string array's count: at least 8
  bytes per string; a tensor count: at least 32 bytes per tensor info; a key count: at
  least 14 bytes per pair), so a forged count costs nothing before it is refused;
- the version is 2 or 3, every value type and ggml type is known, arrays are not nested,
  general.alignment a power of two, keys and tensor names unique, names of 1 to 255
  bytes, a tensor of 1 to 4 dimensions, each dimension at least 1 and the element count
  below 2**63, its rows whole blocks of its type;
- the tensors lie in the data section in the order listed, each at the offset where the
  previous one ends, padded to the alignment (llama.cpp's loader refuses anything else):
  an offset moved, misaligned, overlapping another tensor or leaving a hole, a type or a
  shape changed (the tensor's byte size, type x shape, no longer matches its span) and
  a file truncated or with bytes after the last tensor are all refused.

String arrays (the vocabulary, the merges) are walked once when the metadata is read and
decoded only when asked for (`Field.contents`); numeric arrays are read as NumPy arrays.
Data-only corruption (a NaN scale, a flipped bit in a weight) leaves the layout intact and
cannot be found without a checksum, which GGUF does not have.
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Dict, List, Optional, Tuple

import numpy as np

from tpcore.io.checks import bad, regular_file

__all__ = ["GGUFFile", "Field", "TensorInfo", "GGML_TYPES", "VALUE_TYPES", "MAGIC"]

MAGIC = b"GGUF"
# metadata value types: id -> (name, NumPy dtype of one element or None: string / array)
VALUE_TYPES: Dict[int, Tuple[str, Optional[str]]] = {
    0: ("UINT8", "<u1"), 1: ("INT8", "<i1"), 2: ("UINT16", "<u2"), 3: ("INT16", "<i2"), 4: ("UINT32", "<u4"),
    5: ("INT32", "<i4"), 6: ("FLOAT32", "<f4"), 7: ("BOOL", "<u1"), 8: ("STRING", None), 9: ("ARRAY", None),
    10: ("UINT64", "<u8"), 11: ("INT64", "<i8"), 12: ("FLOAT64", "<f8")}
# ggml tensor types: id -> (name, elements per block, bytes per block)
GGML_TYPES: Dict[int, Tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17)}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_MAX_NAME = 255
_I64_MAX = 2 ** 63 - 1
_MIN_KV = 8 + 1 + 4 + 1                     # a key of one byte and a one-byte value
_MIN_TENSOR = 8 + 1 + 4 + 8 + 4 + 8         # a one-byte name, one dimension


class Field:
    """One metadata value: `kinds` ("UINT32",) or ("ARRAY", "STRING"), `count` (1 for a
    scalar) and `contents()`: a Python scalar or str; an array as a list of str, or a NumPy
    array of its element type (bool for BOOL)."""

    __slots__ = ("kinds", "count", "_value", "_file", "_span")

    def __init__(self, kinds, count, value=None, file=None, span=None):
        self.kinds, self.count, self._value, self._file, self._span = kinds, count, value, file, span

    def contents(self):
        if self._span is not None:                 # a string array: decoded when asked for
            self._value, self._span = self._file._strings(self._span, self.count), None
        return self._value

    def __repr__(self):
        return f"Field({'/'.join(self.kinds)}, count={self.count})"


class TensorInfo:
    """One tensor of the file: name, shape (outermost first: (rows, cols) for a matrix),
    type (the ggml type's name), block and type_size (elements and bytes per block),
    offset (absolute, in the file), nbytes."""

    __slots__ = ("name", "shape", "type", "block", "type_size", "offset", "nbytes")

    def __init__(self, name, shape, type_, block, type_size, offset, nbytes):
        self.name, self.shape, self.type, self.block, self.type_size = name, shape, type_, block, type_size
        self.offset, self.nbytes = offset, nbytes

    def __repr__(self):
        return f"TensorInfo({self.name!r}, shape={self.shape}, type={self.type}, offset={self.offset})"


class _Cursor:
    """Reads the header through a read-only map, every read checked against the file's end."""

    def __init__(self, path: str, buf, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def need(self, n: int, field: str, what: str):
        if n > self.size - self.pos:
            raise bad(self.path, field, what,
                      f"{self.size - self.pos} bytes left in the file at offset {self.pos} (truncated or corrupt)")

    def unpack(self, fmt: str, field: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, field, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self, field: str, what: str = "a string", limit: Optional[int] = None) -> str:
        n = self.unpack("<Q", field, f"{what} (its 8-byte length)")
        if limit is not None and not 1 <= n <= limit:
            raise bad(self.path, field, f"{what} of 1 to {limit} bytes", f"a length of {n}")
        self.need(n, field, f"{what} of {n} bytes")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad(self.path, field, f"{what} in UTF-8", f"invalid byte {raw[e.start:e.start + 1]!r} at "
                                                            f"{e.start}") from e


class GGUFFile:
    """A GGUF file's header, metadata and tensor infos, read and checked (see the module).

    Attributes: path, size (bytes), version, fields ({key: Field} in file order), tensors
    ([TensorInfo] in file order), alignment, data_offset (where the data section starts).
    Holds no open file: string arrays are read again with pread when decoded.
    """

    def __init__(self, path):
        path = os.fspath(path)
        self.path = path
        self.size = size = regular_file(path)
        if size < 24:
            with open(path, "rb") as f:
                head = f.read(4)
            if head != MAGIC:
                raise bad(path, "magic", "a GGUF file (it starts with b'GGUF')", f"a file that starts with {head!r}")
            raise bad(path, "header", "24 bytes (magic, version, tensor and key counts)",
                      f"a file of {size} bytes (truncated)")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            self._parse(_Cursor(path, m, size))

    # --- parsing ---------------------------------------------------------------------
    def _parse(self, c: _Cursor) -> None:
        path = self.path
        head = bytes(c.buf[:4])
        if head != MAGIC:
            raise bad(path, "magic", "a GGUF file (it starts with b'GGUF')", f"a file that starts with {head!r}")
        c.pos = 4
        version = c.unpack("<I", "version", "a uint32")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else " (version 1 is not supported)" \
                if version == 1 else ""
            raise bad(path, "version", "2 or 3", f"{version}{hint}")
        n_tensors = c.unpack("<Q", "tensor_count", "a uint64")
        n_kv = c.unpack("<Q", "kv_count", "a uint64")
        left = c.size - c.pos
        if n_kv > left // _MIN_KV:
            raise bad(path, "kv_count", f"at most {left // _MIN_KV} keys (the {left} bytes left hold no more, "
                                        f"{_MIN_KV} bytes each at least)",
                      f"{n_kv} (a truncated file or a forged count)")
        if n_tensors > left // _MIN_TENSOR:
            raise bad(path, "tensor_count", f"at most {left // _MIN_TENSOR} tensors (the {left} bytes left hold "
                                            f"no more, {_MIN_TENSOR} bytes each at least)",
                      f"{n_tensors} (a truncated file or a forged count)")
        self.version = version
        self.fields: Dict[str, Field] = {}
        prev = None
        for i in range(n_kv):
            where = f"metadata key #{i}" + (f" (after {prev!r})" if prev is not None else "")
            key = c.string(where, "a key", limit=65535)
            if key in self.fields:
                raise bad(path, f"metadata key {key!r}", "each key once", "it twice")
            self.fields[key] = self._value(c, f"metadata key {key!r}")
            prev = key
        self.alignment = self._alignment()
        self.tensors: List[TensorInfo] = []
        names = set()
        for i in range(n_tensors):
            t = self._tensor_info(c, i, self.tensors[-1].name if self.tensors else None)
            if t.name in names:
                raise bad(path, f"tensor {t.name!r}", "one tensor per name", "two tensors of that name")
            names.add(t.name)
            self.tensors.append(t)
        a = self.alignment
        self.data_offset = -(-c.pos // a) * a
        self._check_layout()

    def _value(self, c: _Cursor, field: str) -> Field:
        vt = c.unpack("<I", field, "a uint32 value type")
        if vt not in VALUE_TYPES:
            raise bad(self.path, field, f"a value type in 0..{max(VALUE_TYPES)}", vt)
        name, dt = VALUE_TYPES[vt]
        if vt == _STRING:
            return Field((name,), 1, c.string(field))
        if vt != _ARRAY:
            n = np.dtype(dt).itemsize
            c.need(n, field, f"a {name} value")
            v = np.frombuffer(c.buf, dt, 1, c.pos)[0]
            c.pos += n
            return Field((name,), 1, bool(v) if name == "BOOL" else v.item())
        et = c.unpack("<I", field, "an array's uint32 element type")
        if et not in VALUE_TYPES:
            raise bad(self.path, field, f"an array element type in 0..{max(VALUE_TYPES)}", et)
        if et == _ARRAY:
            raise bad(self.path, field, "an array of scalars or strings", "an array of arrays (not supported)")
        ename, edt = VALUE_TYPES[et]
        count = c.unpack("<Q", field, "an array's uint64 count")
        left = c.size - c.pos
        if et == _STRING:
            if count > left // 8:
                raise bad(self.path, field, f"at most {left // 8} strings (the {left} bytes left hold no more)",
                          f"{count} (a truncated file or a forged count)")
            start = c.pos
            c.pos = self._walk_strings(c, count, field)
            return Field((name, ename), count, file=self, span=(start, c.pos))
        size = np.dtype(edt).itemsize
        if count > left // size:
            raise bad(self.path, field, f"at most {left // size} {ename} values (the {left} bytes left hold no more)",
                      f"{count} (a truncated file or a forged count)")
        arr = np.frombuffer(c.buf, edt, count, c.pos).copy()
        c.pos += count * size
        return Field((name, ename), count, arr.astype(bool) if ename == "BOOL" else arr)

    def _walk_strings(self, c: _Cursor, count: int, field: str) -> int:
        """The end of `count` strings starting at c.pos, each length checked (nothing decoded)."""
        buf, pos, end, unpack = c.buf, c.pos, c.size, struct.Struct("<Q").unpack_from
        for i in range(count):
            if end - pos < 8:
                raise bad(self.path, f"{field} string {i}", "its 8-byte length",
                          f"the end of the file at offset {pos} (truncated, or a forged count of {count})")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos:
                raise bad(self.path, f"{field} string {i}", f"at most the {end - pos} bytes left",
                          f"a length of {n} (truncated or corrupt, or a forged count of {count})")
            pos += n
        return pos

    def _strings(self, span: Tuple[int, int], count: int) -> List[str]:
        start, stop = span
        with open(self.path, "rb") as f:
            raw = os.pread(f.fileno(), stop - start, start)
        if len(raw) != stop - start:
            raise bad(self.path, "metadata", f"{stop - start} bytes at offset {start}", "a file changed since opened")
        out, pos, unpack = [], 0, struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(raw, pos)
            s = raw[pos + 8:pos + 8 + n]
            try:
                out.append(s.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise bad(self.path, f"string {len(out)} of an array at offset {start}", "UTF-8",
                          f"invalid byte {s[e.start:e.start + 1]!r}") from e
            pos += 8 + n
        return out

    def _alignment(self) -> int:
        f = self.fields.get("general.alignment")
        if f is None:
            return 32
        if f.kinds != ("UINT32",):
            raise bad(self.path, "metadata key 'general.alignment'", "a UINT32", "/".join(f.kinds))
        a = f.contents()
        if a < 1 or a & (a - 1):
            raise bad(self.path, "metadata key 'general.alignment'", "a power of two", a)
        return a

    def _tensor_info(self, c: _Cursor, i: int, prev: Optional[str]) -> TensorInfo:
        path = self.path
        where = f"tensor info #{i}" + (f" (after {prev!r})" if prev is not None else "")
        name = c.string(where, "a tensor name", limit=_MAX_NAME)
        field = f"tensor {name!r}"
        nd = c.unpack("<I", field + " n_dims", "a uint32")
        if not 1 <= nd <= _MAX_DIMS:
            raise bad(path, field + " n_dims", f"1 to {_MAX_DIMS} dimensions", nd)
        dims = c.unpack(f"<{nd}Q", field + " shape", f"{nd} uint64 dimensions")
        dims = (dims,) if nd == 1 else dims
        count = 1
        for d in dims:
            if not 1 <= d <= _I64_MAX or count > _I64_MAX // d:
                raise bad(path, field + " shape", "dimensions of at least 1 and fewer than 2**63 elements",
                          tuple(reversed(dims)))
            count *= d
        tt = c.unpack("<I", field + " type", "a uint32 ggml type")
        if tt not in GGML_TYPES:
            raise bad(path, field + " type", "a known ggml type", f"type number {tt} (corrupt, or newer than tpcore)")
        tname, block, tsize = GGML_TYPES[tt]
        if dims[0] % block:
            raise bad(path, field + " shape", f"rows of whole {tname} blocks ({block} elements each)",
                      tuple(reversed(dims)))
        off = c.unpack("<Q", field + " offset", "a uint64")
        nbytes = count // block * tsize
        return TensorInfo(name, tuple(reversed(dims)), tname, block, tsize, off, nbytes)

    def _check_layout(self) -> None:
        """Each tensor where the previous one ends (padded), inside the file, nothing after."""
        path, a, base = self.path, self.alignment, self.data_offset
        if base > self.size and self.tensors:
            raise bad(path, "data section", f"to start at offset {base}", f"a file of {self.size} bytes (truncated)")
        expect, end = 0, 0
        for t in self.tensors:
            if t.offset != expect:
                why = ("misaligned: not a multiple of general.alignment" if t.offset % a else
                       "overlapping the tensor before it" if t.offset < expect else
                       "leaving a hole after the tensor before it")
                raise bad(path, f"tensor {t.name!r} offset",
                          f"{expect} (where the tensor before it ends, padded to {a} bytes: type x shape of each "
                          f"tensor gives its span)", f"{t.offset} ({why})")
            end = expect + t.nbytes
            if end > self.size - base:
                raise bad(path, f"tensor {t.name!r}", f"its {t.nbytes} bytes of data inside the file (at offset "
                                                      f"{base + t.offset})",
                          f"a file of {self.size} bytes that ends before them (truncated?)")
            t.offset += base
            expect = -(-end // a) * a
        if self.tensors and self.size - base > expect:
            last = self.tensors[-1]
            raise bad(path, "data section", f"to end with the last tensor ({last.name!r}, {last.type} of shape "
                                            f"{last.shape}: {base + expect} bytes in all, with padding)",
                      f"{self.size - base - expect} more bytes after it (a type or shape that does not match the "
                      f"data, or a corrupt file)")
