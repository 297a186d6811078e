"""Quantized weights: llama.cpp's GGUF block formats and int8 rows, kept in their format.

A layer, block or model built with ``dtype="q4_k"`` (or ``"q8_0"``, ``"q4_0"``, ``"q4_1"``,
``"q5_k"``, ``"q6_k"``, ``"int8"``) stores each weight as raw rows of blocks, exactly the bytes
of a GGUF file; the kernels dequantize blocks on the fly into registers (the decode GEMV) or a
bounded panel (the prefill GEMM), so a float32 copy of a weight is never made.  Activations,
biases, norms and the KV cache stay float32; quantized weights are frozen (no gradient: as in
QLoRA, backward still gives the input gradient).

=======  =====  =====  ==========================================================
format   block  bytes  one block
=======  =====  =====  ==========================================================
q8_0     32     34     float16 d, int8 q[32]; x = d q
q4_0     32     18     float16 d, 4-bit q[32]; x = d (q - 8)
q4_1     32     20     float16 d, float16 m, 4-bit q[32]; x = d q + m
q4_k     256    144    8 sub-blocks of 32 with 6-bit scales and mins, 4-bit q
q5_k     256    176    as q4_k with a fifth bit
q6_k     256    210    16 sub-blocks of 16 with int8 scales, 6-bit q
int8     row    4 + K  a float32 scale per row (absmax / 127), then K int8
=======  =====  =====  ==========================================================

Blocks run along a weight's input dimension (the columns of W, shape (out, in)): a
column-parallel layer holds whole rows (any row count), a row-parallel one whole blocks of
each row, so its split is in multiples of the block (``tpcore.partition(n, world,
align=block_size(fmt))``; the layers choose such a split by default).  int8's scale is per
row of each rank's shard: a row-parallel int8 layer has one scale per row per rank.

`QuantTensor` is a full weight in a block format (e.g. a GGUF tensor, memory-mapped): layers'
and models' ``load_full`` / ``load_state_dict_full`` copy a rank's raw blocks from it without
converting when the formats match, and dequantize only the rank's slice otherwise; NumPy sees
it as float32 (``np.asarray(qt)`` dequantizes).
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple, Union

import numpy as np

from tpcore import _C
from tpcore.utils.args import int_arg
from tpcore.utils.dtypes import (QUANT_FORMATS, block_bytes, block_size, is_quantized, quant_format, row_bytes,
                                 row_header)

__all__ = ["QUANT_FORMATS", "QuantTensor", "block_size", "row_bytes", "is_quantized", "quantize", "dequantize"]


def quantize(x: Any, fmt: str) -> np.ndarray:
    """Rows of x quantized: uint8 raw rows (rows, row_bytes(fmt, cols)).

    Parameters
    ----------
    x : array_like, shape (rows, cols)
        Finite floats; cols a multiple of the format's block.
    fmt : str
        The format.

    Raises
    ------
    ValueError
        Non-finite values, cols not whole blocks, not 2-D.
    """
    fmt = quant_format(fmt, "quantize")
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if a.ndim != 2:
        raise ValueError(f"quantize: x must be 2-D (rows, cols), got shape {a.shape}")
    if a.size and not np.isfinite(a).all():
        raise ValueError("quantize: x has non-finite values (NaN or inf); quantized formats cannot hold them")
    return _C.quant_quantize(a, fmt)


def dequantize(raw: Any, fmt: str, cols: int) -> np.ndarray:
    """Raw rows of a format as float32 (rows, cols), bit for bit as llama.cpp's gguf package.

    Parameters
    ----------
    raw : numpy.ndarray of uint8, shape (rows, row_bytes(fmt, cols))
        The rows' bytes.
    fmt : str
        The format.
    cols : int
        Elements per row.

    Raises
    ------
    TypeError, ValueError
        raw not a 2-D uint8 array of matching row bytes.
    """
    fmt = quant_format(fmt, "dequantize")
    r = np.ascontiguousarray(raw)
    return _C.quant_dequantize(r, fmt, int_arg(cols, "dequantize", "cols", lo=0))


def _index_rows(idx: Any, n: int) -> Union[slice, np.ndarray]:
    if isinstance(idx, slice):
        return idx
    a = np.asarray(idx)
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise IndexError(f"QuantTensor: rows must be selected by a slice or a 1-D integer array, got {idx!r}")
    if a.size and (a.min() < -n or a.max() >= n):
        raise IndexError(f"QuantTensor: a row index is out of range for {n} rows")
    return a


class QuantTensor:
    """A full 2-D weight (rows, cols) in a quantized format: raw rows of blocks.

    Parameters
    ----------
    fmt : str
        "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k" or "int8".
    shape : (int, int)
        Logical (rows, cols); cols whole blocks.
    raw : numpy.ndarray of uint8, shape (rows, row_bytes(fmt, cols))
        The bytes (a memory-mapped array is read only where indexed).

    Raises
    ------
    TypeError, ValueError
        A raw array that does not hold shape in fmt.

    Notes
    -----
    ``qt[rows]`` and ``qt[:, a:b]`` (a, b on block boundaries; not for int8) give QuantTensors
    of those raw blocks without converting; other indexing and ``np.asarray(qt)`` dequantize.
    """

    __array_priority__ = 10.0

    def __init__(self, fmt: str, shape: Sequence[int], raw: Any) -> None:
        self.fmt = quant_format(fmt, "QuantTensor")
        if len(tuple(shape)) != 2:
            raise ValueError(f"QuantTensor: shape must be (rows, cols), got {shape!r}")
        rows, cols = (int_arg(s, "QuantTensor", "shape[i]") for s in shape)
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
            raise TypeError(f"QuantTensor: raw must be a 2-D uint8 array of rows, got "
                            f"{getattr(raw, 'dtype', type(raw).__name__)} {getattr(raw, 'shape', '')}")
        if rows < 0 or raw.shape != (rows, row_bytes(self.fmt, cols)):
            raise ValueError(f"QuantTensor: raw has shape {raw.shape}, but {rows} rows of {cols} {self.fmt} elements "
                             f"take ({rows}, {row_bytes(self.fmt, cols) if cols >= 0 else '?'})")
        self.shape: Tuple[int, int] = (rows, cols)
        self.raw = raw

    ndim = 2
    dtype = np.dtype(np.float32)  # what it reads as

    @property
    def nbytes(self) -> int:
        """Bytes of the raw rows."""
        return int(self.raw.nbytes)

    def __repr__(self) -> str:
        return f"QuantTensor({self.fmt!r}, shape={self.shape})"

    def __len__(self) -> int:
        return self.shape[0]

    def dequantize(self) -> np.ndarray:
        """The whole tensor as float32 (rows, cols)."""
        return dequantize(self.raw, self.fmt, self.shape[1])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.dequantize()
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, idx: Any) -> Any:
        rows_idx, cols_idx = (idx if isinstance(idx, tuple) and len(idx) == 2 else (idx, slice(None)))
        if isinstance(idx, tuple) and len(idx) > 2:
            raise IndexError("QuantTensor: at most 2 indices")
        r = _index_rows(rows_idx, self.shape[0])
        raw = self.raw[r]
        nrows = raw.shape[0]
        if cols_idx == slice(None):
            return QuantTensor(self.fmt, (nrows, self.shape[1]), np.ascontiguousarray(raw))
        if not isinstance(cols_idx, slice) or cols_idx.step not in (None, 1):
            return np.asarray(QuantTensor(self.fmt, (nrows, self.shape[1]), np.ascontiguousarray(raw)))[:, cols_idx]
        a, b, _ = cols_idx.indices(self.shape[1])
        b = max(a, b)
        blk, nb, hdr = block_size(self.fmt), block_bytes(self.fmt), row_header(self.fmt)
        if hdr or a % blk or b % blk:  # int8 (one scale per row) or mid-block: dequantize the rows
            return dequantize(np.ascontiguousarray(raw), self.fmt, self.shape[1])[:, a:b]
        sub = np.ascontiguousarray(raw[:, a // blk * nb:b // blk * nb])
        return QuantTensor(self.fmt, (nrows, b - a), sub)

    @staticmethod
    def vstack(parts: Sequence["QuantTensor"]) -> "QuantTensor":
        """Rows of several QuantTensors of one format and width, one after another.

        Parameters
        ----------
        parts : sequence of QuantTensor
            Of one format and one width (cols).

        Raises
        ------
        ValueError
            Formats or widths differ.
        """
        fmts = {p.fmt for p in parts}
        widths = {p.shape[1] for p in parts}
        if len(fmts) != 1 or len(widths) != 1:
            raise ValueError(f"QuantTensor.vstack: parts must share a format and a width, got {sorted(fmts)} and "
                             f"{sorted(widths)}")
        raw = np.concatenate([np.asarray(p.raw) for p in parts])
        return QuantTensor(parts[0].fmt, (raw.shape[0], widths.pop()), raw)


def as_format(t: Any, fmt: str, who: str) -> np.ndarray:
    """t (a QuantTensor, or float values, 2-D) as raw rows of fmt: the raw bytes themselves when
    t is a QuantTensor of fmt, else its values (dequantized if need be) quantized to fmt."""
    if isinstance(t, QuantTensor) and t.fmt == fmt:
        return np.ascontiguousarray(t.raw)
    vals = np.asarray(t, dtype=np.float32)
    if vals.ndim != 2:
        raise ValueError(f"{who}: a {fmt} weight needs 2-D values, got shape {vals.shape}")
    if vals.size and not np.isfinite(vals).all():
        raise ValueError(f"{who}: the weight has non-finite values (NaN or inf), which {fmt} cannot hold")
    return quantize(vals, fmt)

