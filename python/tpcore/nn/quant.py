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

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

from tpcore import _C
from tpcore.utils.args import int_arg

__all__ = ["QUANT_FORMATS", "QuantTensor", "block_size", "row_bytes", "quantize", "dequantize"]

# name -> (elements per block, bytes per block, bytes of a per-row header)
_FORMATS = {"q8_0": (32, 34, 0), "q4_0": (32, 18, 0), "q4_1": (32, 20, 0), "q4_k": (256, 144, 0),
            "q5_k": (256, 176, 0), "q6_k": (256, 210, 0), "int8": (1, 1, 4)}
QUANT_FORMATS = tuple(_FORMATS)


def _fmt(fmt: Any, who: str) -> str:
    if not isinstance(fmt, str):
        raise TypeError(f"{who}: fmt must be a str (one of {', '.join(QUANT_FORMATS)}), got {type(fmt).__name__}")
    name = fmt.lower()
    if name not in _FORMATS:
        raise ValueError(f"{who}: unknown quantized format {fmt!r}; expected one of {', '.join(QUANT_FORMATS)}")
    return name


def block_size(fmt: str) -> int:
    """Elements per block of a format (1 for int8 rows and for float formats).

    Parameters
    ----------
    fmt : str
        "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "int8", or a float dtype name.

    Raises
    ------
    TypeError, ValueError
        fmt not a known name.
    """
    if isinstance(fmt, str) and fmt in ("float32", "bfloat16", "float16"):
        return 1
    return _FORMATS[_fmt(fmt, "block_size")][0]


def row_bytes(fmt: str, cols: int) -> int:
    """Bytes of one row of `cols` elements in format fmt.

    Parameters
    ----------
    fmt : str
        A quantized format name.
    cols : int
        Elements of the row, a multiple of `block_size(fmt)`.

    Raises
    ------
    ValueError
        cols negative or not whole blocks; an unknown format.
    """
    blk, nb, hdr = _FORMATS[_fmt(fmt, "row_bytes")]
    cols = int_arg(cols, "row_bytes", "cols")
    if cols < 0 or cols % blk:
        raise ValueError(f"row_bytes: {cols} elements are not whole blocks of {blk} ({fmt})")
    return hdr + cols // blk * nb


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
    fmt = _fmt(fmt, "quantize")
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
    fmt = _fmt(fmt, "dequantize")
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
        self.fmt = _fmt(fmt, "QuantTensor")
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
        blk, nb, hdr = _FORMATS[self.fmt]
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


def is_quantized(dtype: Optional[str]) -> bool:
    """Whether a layer dtype name is a quantized format."""
    return dtype in _FORMATS
