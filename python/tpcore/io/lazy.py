"""Lazy tensors of a file: FileTensor (a tensor of a safetensors file or a stored .npz
member, read with pread on indexing, no memory map), open_safetensors (every tensor of a
file as one), and the row-index helpers the streaming reads share (tpcore.io.stream)."""
from __future__ import annotations

import math
import os
import sys
from typing import Dict, Tuple

import numpy as np

from tpcore.io.checks import bad
from tpcore.io.safetensors import _ST_READ, read_safetensors_header


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
