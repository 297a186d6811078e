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
