"""Comm.all_to_all: rows dispatched to the ranks and combined back (MoE expert parallelism).

Kept beside comm.py (which binds it as `Comm.all_to_all`) so that each file stays readable;
it uses the axis helpers of _axes.py (as comm.py does) and the C binding `_C.Comm.all_to_all` (csrc/python/comm_a2a.c,
over `tp_all_to_all`).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional, Sequence

import numpy as np

from tpcore.distributed._axes import _empty, _from_axis0, _norm_axis, _out_array, _shape, _to_axis0, _unmoved
from tpcore.utils.args import is_int, shown
from tpcore.utils.arrays import comm_array, is_device_result
from tpcore.utils.dtypes import TENSOR_DTYPES


def _counts(comm: Any, sizes: Any, arg: str) -> list:
    """sizes as a list of `comm.size` ints >= 0, or a TypeError / ValueError naming arg."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"all_to_all: {arg} must be a sequence of ints, got {shown(sizes)}")
    sizes = list(sizes)
    if not all(is_int(s) for s in sizes):
        raise TypeError(f"all_to_all: {arg} must be a sequence of ints, got {sizes!r}")
    sizes = [operator.index(s) for s in sizes]
    if len(sizes) != comm.size:
        raise ValueError(f"all_to_all: {arg} has {len(sizes)} entries, expected one per rank ({comm.size})")
    bad = [s for s in sizes if s < 0]
    if bad:
        raise ValueError(f"all_to_all: {arg} must be >= 0, got {sizes}")
    return sizes


class _General(Exception):
    """The fast path declines: the general path checks (and names) everything."""


_TAKEN: set = set()  # the NumPy dtypes of TENSOR_DTYPES (filled on first use)


def _taken(dt: np.dtype) -> bool:
    if not _TAKEN:
        for name in TENSOR_DTYPES:
            try:
                _TAKEN.add(np.dtype(name))
            except TypeError:  # bfloat16 without ml_dtypes
                pass
    return dt in _TAKEN


def _fast(comm: Any, x: np.ndarray, send: list, recv: Optional[list], out: Optional[np.ndarray]) -> np.ndarray:
    """The common case (NumPy x and out, axis 0, lists of ints).  Anything unusual raises _General
    before a collective runs; with recv given the C binding's own TypeError / ValueError (nothing
    has moved yet) does too, so that the general path names the problem in rows."""
    n, rows, exchanged = comm._size, x.shape[0], False
    if len(send) != n or not all(type(s) is int and s >= 0 for s in send) or sum(send) != rows:
        raise _General
    if recv is None:
        if out is not None or not x.flags.c_contiguous or not _taken(x.dtype):
            raise _General
        got = np.zeros(n, dtype=np.int64)
        ones = [1] * n
        comm._c.all_to_all(np.array(send, dtype=np.int64), got, ones, ones)
        recv, exchanged = got.tolist(), True
    elif len(recv) != n or not all(type(s) is int and s >= 0 for s in recv):
        raise _General
    shape = (sum(recv),) + x.shape[1:]
    if out is None:  # (after the exchange, an allocation that fails aborts the peers' call too)
        out = comm._made("all_to_all", "output", shape, x, lambda: np.empty(shape, dtype=x.dtype))
    elif out.shape != shape:
        raise _General
    inner = x.size // rows if rows else math.prod(x.shape[1:])
    sc, rc = (send, recv) if inner == 1 else ([s * inner for s in send], [r * inner for r in recv])
    try:
        return comm._c.all_to_all(x, out, sc, rc)
    except (TypeError, ValueError):
        if exchanged:  # the peers are past the exchange too: the call's error as it is
            raise
        raise _General from None


def all_to_all(self: Any, x: Any, send_sizes: Sequence[int], recv_sizes: Optional[Sequence[int]] = None,
               axis: int = 0, out: Any = None) -> Any:
    """Send block p of x to rank p; return the blocks the ranks sent this one, in rank order.

    x is split along axis into ``len(send_sizes)`` consecutive blocks, block p holding
    ``send_sizes[p]`` rows; rank p receives it.  The result holds the blocks received,
    rank 0's first: ``recv_sizes[p]`` rows from rank p.  The pattern of a mixture of
    experts' dispatch (tokens to the ranks that hold their experts) and combine (back).

    Parameters
    ----------
    x : array
        At least 1-D; the same shape except along axis and the same dtype on every rank;
        numpy.ndarray, DeviceArray or a DLPack tensor, of any dtype the other collectives take.
    send_sizes : sequence of int
        One entry per rank, each >= 0, adding up to x's length along axis.
    recv_sizes : sequence of int, optional
        One entry per rank: the rows rank p sends this one (its send_sizes[this rank]).
        None (default): learned first with a small all_to_all of the sizes (one more
        collective).
    axis : int, default 0
        The axis to split and concatenate along (negative counts from the end).
    out : array, optional
        Where to write the result: x's shape with sum(recv_sizes) along axis, x's dtype.

    Returns
    -------
    numpy.ndarray or DeviceArray
        out, or a new array: NumPy for NumPy and other host tensors, a DeviceArray for a
        DeviceArray or a device tensor.

    Raises
    ------
    TypeError
        x / out not an array tpcore takes, axis not an int, the sizes not sequences of
        ints, out's dtype differs.
    ValueError
        x 0-d, axis out of range, sizes of the wrong length or negative, send_sizes not
        adding up to x's length along axis, out's shape wrong or out read-only.
    CommError
        The ranks' sizes disagree (rank p's send_sizes[q] is not rank q's recv_sizes[p]):
        every rank raises, naming both ranks (shm and mpi; nccl cannot compare them and
        fails or times out).  Otherwise as for `all_reduce`.
    CommTimeout
        As for `all_reduce`.

    Notes
    -----
    Collective: one all-to-all over this communicator (two when recv_sizes is None);
    axis != 0 moves the axis first, a copy.

    Examples
    --------
    >>> # rank r holds 2 rows for every rank
    >>> got = comm.all_to_all(x, [2] * comm.size)  # rows 2r, 2r+1 of every rank's x
    """
    if type(x) is np.ndarray and type(axis) is int and axis == 0 and x.ndim and type(send_sizes) is list and \
            (recv_sizes is None or type(recv_sizes) is list) and (out is None or type(out) is np.ndarray):
        try:
            return _fast(self, x, send_sizes, recv_sizes, out)
        except _General:
            pass  # the general path says what is wrong
    a = comm_array(x, "x", "all_to_all")
    dres = is_device_result(x)
    if a.ndim == 0:
        raise ValueError("all_to_all: x must have at least one dimension")
    ax = _norm_axis(axis, a.ndim, "all_to_all")
    send = _counts(self, send_sizes, "send_sizes")
    n = _shape(a)[ax]
    if sum(send) != n:
        raise ValueError(f"all_to_all: send_sizes add up to {sum(send)} but x has length {n} along axis {ax}")
    if recv_sizes is None:
        got = np.zeros(self.size, dtype=np.int64)
        self._c.all_to_all(np.asarray(send, dtype=np.int64), got, [1] * self.size, [1] * self.size)
        recv = [int(v) for v in got]
    else:
        recv = _counts(self, recv_sizes, "recv_sizes")
    moved = self._made("all_to_all", "copy of x with axis 0 first", _shape(a), a, lambda: _to_axis0(a, ax))
    inner = math.prod(_shape(moved)[1:])
    oshape = (sum(recv),) + _shape(moved)[1:]
    o = None if out is None else _out_array(out, a, _unmoved(oshape, ax), "all_to_all")
    res = o if ax == 0 and o is not None else self._made("all_to_all", "output", oshape, a,
                                                         lambda: _empty(oshape, a, dres))
    self._c.all_to_all(moved, res, [s * inner for s in send], [r * inner for r in recv])
    if ax == 0:
        return out if out is not None else res
    return _from_axis0(res, ax, o, out, dres)
