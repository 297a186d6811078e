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
from typing import Optional

import numpy as np

from tpcore.utils.args import is_int, shown
from tpcore.io.lazy import FileTensor, base_row_index, _col_range, split_row_index, row_runs, read_rows  # noqa: F401  (file-level: there)

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
    from tpcore.io.safetensors import to_float32
    sel = base_row_index(rows, 0)
    v = src[sel] if cols is None else src[sel, cols]
    out[...] = to_float32(v).reshape(out.shape)


def fill(dst, src, rows, cols, fmt: str, who: str, put_weight, at: int = 0) -> None:
    """dst = src[rows, cols] (cols None: src[rows]), streamed: src's rows read in chunks
    that fit the staging buffer.  dst: a host array of the selection's shape (float32, a
    16-bit float, or fmt's raw quantized rows), or a DeviceArray whose rows at, at + 1, ...
    take the selection (each chunk made on the host in the staging buffer, then copied to
    those rows of the device); fmt: dst's storage format; put_weight(dst_rows, fmt, values,
    who) (the layers' put_weight, passed in: this module imports no layer) stores a chunk of
    float32 values, or of a source's QuantTensor rows, into dst's rows."""
    if not isinstance(dst, np.ndarray):   # a DeviceArray (a GPU's): chunks on the host, rows to the device
        _fill_device(dst, src, rows, cols, fmt, who, at, put_weight)
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
    def put(d, v):
        put_weight(d, fmt, v, who)
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
        sel = base_row_index(r, 0)
        v = src[sel] if cols is None else src[sel, cols]
        put(d, v)


def _fill_device(dst, src, rows, cols, fmt, who, at, put_weight):
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
        fill(host, src, r, cols, fmt, who, put_weight)
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
