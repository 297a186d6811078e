"""Streaming checkpoint loads: a rank's slices of a file's tensors read straight into their
final place, chunk by chunk, through one bounded staging buffer.

Files are read with os.preadv into NumPy buffers (never memory-mapped), so the only memory a
load uses beyond the model's own is the staging buffer: peak resident memory during a load
is the steady state plus the staging buffer, at any world size and on the GPU path too.

- FileTensor: a tensor of a safetensors file (dtype, shape, byte offset), read on indexing
  (NumPy's rules for the first axis; a step-1 column slice reads only those columns of each
  row).  A read that comes back short is a CheckpointError naming the file and the tensor.
- fill(dst, src, rows, cols, fmt, who): dst (a layer's weight rows or block, float or raw
  quantized rows) = src[rows, cols], in chunks of whole rows that fit the staging buffer;
  float32 rows of a float32 file are read straight into dst, others read into staging and
  converted (bf16/f16/f64 -> float32, float -> bf16/f16/quantized storage by the layers'
  converters).  Sources with a `_read_into(rows, cols, out, stage)` method (FileTensor,
  hf.View, hf._Stack) use it; any other source (an array, a memory map, a DLPack tensor,
  a GGUF lazy tensor) is indexed chunk by chunk.
- loading(staging_bytes): the staging buffer of one load (from_pretrained, from_gguf,
  tpcore.load); outside it each fill makes its own.  Its size: staging_bytes, else the
  environment's TPCORE_LOAD_STAGING_MB, else 64 MiB.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Optional

import numpy as np

from ._args import is_int, shown
from ._formats import _ST_READ, bad

DEFAULT_STAGING = 64 << 20
ENV = "TPCORE_LOAD_STAGING_MB"


def staging_arg(staging_bytes, who: str) -> int:
    """The staging buffer's size in bytes: staging_bytes (a positive int) when given, else
    TPCORE_LOAD_STAGING_MB (a positive number of MiB), else 64 MiB."""
    if staging_bytes is not None:
        if not is_int(staging_bytes):
            raise TypeError(f"{who}: staging_bytes must be a positive int (bytes), got {shown(staging_bytes)}")
        if staging_bytes < 1:
            raise ValueError(f"{who}: staging_bytes must be a positive int (bytes), got {staging_bytes}")
        return int(staging_bytes)
    env = os.environ.get(ENV)
    if env is None or env.strip() == "":
        return DEFAULT_STAGING
    try:
        mb = float(env)
    except ValueError:
        mb = float("nan")
    if not (math.isfinite(mb) and mb > 0):
        raise ValueError(f"{who}: the environment variable {ENV} must be a positive number of MiB, got {env!r}")
    return max(1, int(mb * (1 << 20)))


class Staging:
    """One staging buffer of at most `nbytes`, handed out as regions by a bump allocator
    that `reset` rewinds for every chunk.  The buffer is allocated on first use at the size
    the chunks ask for (`reserve`), never above nbytes: a staging size far larger than the
    model's tensors costs nothing.  A region that does not fit (a single row larger than
    the buffer) is a temporary of its own."""

    def __init__(self, nbytes: int):
        self.nbytes, self.buf, self.pos, self.want = int(nbytes), None, 0, 0

    def reset(self) -> None:
        self.pos = 0

    def reserve(self, nbytes: int) -> None:
        """The next chunks take up to nbytes of regions: the buffer grows to that (at most
        the staging size) before the next chunk's first region."""
        self.want = max(self.want, min(int(nbytes), self.nbytes))

    def take(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        if self.pos + n > self.nbytes:
            return np.empty(shape, dtype)
        if self.pos == 0 and (self.buf is None or self.buf.size < max(n, self.want)):
            self.buf = None   # the old one goes before the new one is made
            self.buf = np.empty(max(n, self.want), np.uint8)
        if self.pos + n > self.buf.size:
            return np.empty(shape, dtype)
        v = self.buf[self.pos:self.pos + n].view(dtype).reshape(shape)
        self.pos += -(-n // 64) * 64
        return v


_current: Optional[Staging] = None


@contextlib.contextmanager
def loading(staging_bytes: int):
    """The staging buffer every fill inside uses (one per load; freed at the end)."""
    global _current
    prev, _current = _current, Staging(staging_bytes)
    try:
        yield _current
    finally:
        _current = prev


@contextlib.contextmanager
def loading_default(who: str):
    """The current load's staging buffer, or (outside one) a load of the default size: one
    buffer for every tensor of, e.g., a model's load_state_dict_full called directly."""
    if _current is not None:
        yield _current
        return
    with loading(staging_arg(None, who)) as st:
        yield st


def _stage() -> Staging:
    return _current if _current is not None else Staging(staging_arg(None, "load"))


# Indexing helpers (NumPy's rules for the first axis) ----------------------------------
def _rows(key, n):
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


def _as_base_index(rows, off):
    rows = np.atleast_1d(rows) + off
    if rows.size and np.all(np.diff(rows) == 1):
        return slice(int(rows[0]), int(rows[-1]) + 1)  # a contiguous run: a plain (cheap) slice of the map
    return rows


def _runs(rows: np.ndarray):
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
            for pos, r, n in _runs(np.asarray(rows, np.int64)):
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

    def _read_into(self, rows: np.ndarray, cols, out: np.ndarray, stage: Staging) -> None:
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
        rows, scalar, rest = _rows(key, self.shape[0])
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
def _n_cols(src, cols) -> int:
    shape = tuple(src.shape)
    if len(shape) < 2:
        return 1
    inner = math.prod(shape[2:])
    if cols is None:
        return shape[1] * inner
    lo, hi, step = cols.indices(shape[1])
    return len(range(lo, hi, step)) * inner


def _host_f32(dst, fmt) -> bool:
    return isinstance(dst, np.ndarray) and fmt == "float32" and dst.dtype == np.float32


def read_into(src, rows: np.ndarray, cols, out: np.ndarray, stage: Staging) -> None:
    """out (float32, (len(rows), ncols)) = src[rows, cols]: through src's _read_into when it
    has one, else by indexing (rows: ascending ints)."""
    reader = getattr(src, "_read_into", None)
    if reader is not None:
        reader(rows, cols, out, stage)
        return
    from ._formats import to_float32
    sel = _as_base_index(rows, 0)
    v = src[sel] if cols is None else src[sel, cols]
    out[...] = to_float32(v).reshape(out.shape)


def fill(dst, src, rows, cols, fmt: str, who: str, put=None, at: int = 0) -> None:
    """dst = src[rows, cols] (cols None: src[rows]), streamed: src's rows read in chunks
    that fit the staging buffer.  dst: a host array of the selection's shape (float32, a
    16-bit float, or fmt's raw quantized rows), or a DeviceArray whose rows at, at + 1, ...
    take the selection (each chunk made on the host in the staging buffer, then copied to
    those rows of the device); fmt: dst's storage format; put(dst_rows, values) (default:
    the layers' _put_weight) stores a chunk of float32 values, or of a source's QuantTensor
    rows, into dst's rows."""
    from .layers import _put_weight
    if not isinstance(dst, np.ndarray):   # a DeviceArray (a GPU's): chunks on the host, rows to the device
        _fill_device(dst, src, rows, cols, fmt, who, at)
        return
    n0 = tuple(src.shape)[0] if len(tuple(src.shape)) else 0
    idx = np.arange(n0)[rows] if not isinstance(rows, np.ndarray) or rows.dtype == np.bool_ else rows
    idx = np.atleast_1d(np.asarray(idx, np.int64))
    ncols = _n_cols(src, cols)
    st = _stage()
    reader = getattr(src, "_read_into", None)
    raw_it = getattr(getattr(src, "raw_dtype", None), "itemsize", 4)
    # bytes per element a chunk costs: raw + float32 in staging through a reader; another
    # source's own temporaries (a GGUF block dequantizer's: several float32 arrays) otherwise
    per_row = max(1, ncols) * ((raw_it + 8) if reader is not None else 32)
    k = max(1, st.nbytes // per_row)
    n = idx.size
    if reader is not None:   # a chunk's regions, each rounded up to 64 bytes
        st.reserve(min(n, k) * per_row + 4 * 64)
    if put is None:
        def put(d, v):
            _put_weight(d, fmt, v, who)
    direct = _host_f32(dst, fmt) and dst.flags.c_contiguous
    for i in range(0, n, k):
        r = idx[i:i + k]
        st.reset()
        d = dst[i:i + r.size]
        if reader is not None:
            out = d.reshape(r.size, ncols) if direct else st.take((r.size, ncols), np.float32)
            reader(r, cols, out, st)
            if not direct:
                quant_rows = isinstance(d, np.ndarray) and d.dtype == np.uint8 and d.ndim == 2
                put(d, out if quant_rows else out.reshape(d.shape))
            continue
        sel = _as_base_index(r, 0)
        v = src[sel] if cols is None else src[sel, cols]
        put(d, v)


def _fill_device(dst, src, rows, cols, fmt, who, at):
    """fill into rows at.. of a DeviceArray: each chunk of rows made in a host buffer of
    dst's dtype (at most half the staging size), then copied to those rows of the device
    (dst[i:j] = chunk), so host memory stays within 1.5 staging buffers whatever the
    model's size."""
    st = _stage()
    n0 = tuple(src.shape)[0]
    idx = np.atleast_1d(np.arange(n0)[rows] if not isinstance(rows, np.ndarray) or rows.dtype == np.bool_
                        else np.asarray(rows, np.int64))
    shape = tuple(dst.shape)
    row_bytes = math.prod(shape[1:]) * np.dtype(str(dst.dtype)).itemsize
    k = max(1, st.nbytes // (2 * row_bytes))   # a host chunk of at most half the staging size
    for i in range(0, idx.size, k):
        r = idx[i:i + k]
        host = np.empty((r.size,) + shape[1:], np.dtype(str(dst.dtype)))
        fill(host, src, r, cols, fmt, who)
        dst[at + i:at + i + r.size] = host
        del host


def copy_raw(dst, src) -> None:
    """dst = src's stored values as they are (a quantized layer's raw rows): a FileTensor
    of dst's dtype read straight into a host dst; anything else assigned."""
    if isinstance(dst, np.ndarray) and isinstance(src, FileTensor) and dst.flags.c_contiguous and \
            src.raw_dtype == dst.dtype and tuple(src.shape) == dst.shape and src.ndim:
        src.read_raw(np.arange(src.shape[0]), None, dst)
    else:
        dst[...] = src[...]
