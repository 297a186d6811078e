"""A layer's weight storage on the host side: full tensors written into a rank's shard
(`put_weight`, float values converted or a quantized shard's raw rows), streamed from
checkpoint tensors read on indexing (`load_weight`, `is_lazy`), and shards read back as
host arrays (float32 for the quantized ones) for gathering."""
from __future__ import annotations

import numpy as np

from tpcore.utils.arrays import DeviceArray, asarray
from tpcore.utils.dtypes import is_quantized
from tpcore.nn.common import _is_half
from tpcore.nn.quant import QuantTensor, as_format, dequantize


def float_param(a, who: str) -> np.ndarray:
    """A full tensor handed to load_full: any float dtype (float16 / bfloat16 from
    checkpoints included); it is converted to float32 on assignment."""
    a = np.asarray(a)
    if a.dtype.kind != "f" and not _is_half(a.dtype):
        raise TypeError(f"{who}: expected a floating-point array, got {a.dtype}")
    return a


def _host(a) -> np.ndarray:
    """A parameter as a host array (a GPU layer's parameters are DeviceArrays: copied)."""
    return a.to_numpy() if isinstance(a, DeviceArray) else np.ascontiguousarray(a)


def _shard_host(w, dtype: str, cols: int) -> np.ndarray:
    """A weight shard on the host for gathering: its own dtype, float32 when quantized (raw
    rows of different ranks cannot be joined along the columns)."""
    return _shard_float(w, dtype, cols) if is_quantized(dtype) else _host(w)


def _shard_float(w, dtype: str, cols: int) -> np.ndarray:
    """A weight shard as float32 on the host (quantized rows dequantized)."""
    h = _host(w)
    if is_quantized(dtype):
        return dequantize(h, dtype, cols) if h.shape[0] else np.zeros((0, cols), np.float32)
    return np.asarray(h, np.float32)


def put_weight(dst, dtype: str, src, who: str) -> None:
    """dst (a layer's weight shard, or rows of it) = src: float values converted, or for a
    quantized dst its raw rows (a QuantTensor of the same format copied as it is, anything
    else quantized from its float values)."""
    if is_quantized(dtype):
        if src.shape[0]:  # (a shard of no rows: nothing to copy; a DeviceArray cannot take itself)
            dst[...] = as_format(src, dtype, who)
        return
    dst[...] = float_param(src, who)


def is_lazy(x) -> bool:
    """A checkpoint's tensor read on indexing (tpcore.io.stream.FileTensor, hf.View, ...):
    load_full streams its slices (load_weight) instead of reading it whole."""
    return hasattr(x, "_read_into") and hasattr(x, "shape")


def load_weight(dst, dtype: str, src, rows, cols, who: str, at: int = 0) -> None:
    """dst (a weight shard: a host array, a DeviceArray, or rows of them) = src[rows, cols]
    (cols None: src[rows]), streamed through the load's staging buffer (tpcore.io.stream.fill):
    float values converted chunk by chunk, a quantized dst's raw rows copied (a QuantTensor
    source of its format) or quantized by whole rows.  A GPU dst is filled on the host
    chunk by chunk, each chunk copied to its rows of the device (from row `at`)."""
    from tpcore.io.stream import fill
    if isinstance(src, QuantTensor) or not hasattr(src, "shape") or len(tuple(src.shape)) != 2:
        if at or (isinstance(dst, DeviceArray) and tuple(dst.shape)[:1] != (np.arange(src.shape[0])[rows].size,)):
            raise ValueError(f"{who}: rows of a device weight are filled from a 2-D checkpoint tensor only")
        put_weight(dst, dtype, src[rows] if cols is None else src[rows, cols], who)
        return
    if is_quantized(dtype) and not (dst.shape[0] if hasattr(dst, "shape") else 1):
        return  # (a shard of no rows: nothing to copy)
    fill(dst, src, rows, cols, dtype, who, put_weight, at=at)


def _load_bias(layer, b, sel, n):
    if layer.bias is None:
        raise ValueError("load_full: this layer has no bias, but b was given")
    if b is None:
        raise ValueError("load_full: this layer has a bias; pass b")
    b = b if is_lazy(b) else asarray(b, "b", f"{type(layer).__name__}.load_full")
    if b.shape != (n,):
        raise ValueError(f"load_full: b must have shape {(n,)}, got {b.shape}")
    layer.bias[...] = float_param(b[sel], "load_full")
