"""The Python face of a communicator.

`Comm` wraps the C communicator (`tpcore._C.Comm`) with NumPy conveniences:
arrays of any shape, `axis=` for gather and scatter, new output arrays, DLPack
inputs.  NumPy arrays and tpcore.DeviceArrays go to the C communicator as they
are; any other tensor with __dlpack__ (a CUDA tensor, a CPU tensor that is not
NumPy) as a DeviceArray view of its memory (_array.comm_array: no copy).  Device
memory a backend cannot take (a CUDA buffer over shm), and host memory the NCCL
backend cannot, are staged by the C dispatcher (csrc/comm/staged.c), the one
staging path.  All data movement and arithmetic happen in C with the GIL released.

Semantics follow NCCL / torch.distributed: every rank calls the same
collectives in the same order with matching shapes and dtypes; a mismatch
raises `tpcore.CommError` on every rank, naming both sides.
"""
from __future__ import annotations

import math
import operator
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, TypeVar, Union, overload

import numpy as np

from tpcore import _C
from tpcore.distributed._axes import (_empty, _from_axis0, _norm_axis, _out_array, _shape, _to_axis0, _unmoved,
                                     _writable)
from tpcore.distributed.alltoall import all_to_all as _all_to_all
from tpcore.utils.args import is_int, real_arg, shown
from tpcore.utils.arrays import as_array  # noqa: F401  (also tpcore.distributed.comm.as_array, as before)
from tpcore.utils.arrays import DeviceArray, comm_array, is_device_result
from tpcore.utils.dtypes import TENSOR_DTYPES

CommError = _C.CommError
CommTimeout = _C.CommTimeout

_A = TypeVar("_A")  # an array the call writes into and returns (NumPy, DeviceArray, a DLPack tensor)

_OPS = ("sum", "prod", "min", "max", "avg")  # and "mean", avg's alias (torch / NumPy users' word)


def _check_op(op, name):
    """The C core's check (csrc/python/comm.c parse_op), made before any data moves."""
    if not isinstance(op, str):
        raise TypeError(f"{name}: op must be a string ('sum', 'prod', 'min', 'max', 'avg' or 'mean'), got {shown(op)}")
    if op not in _OPS and op != "mean":
        raise ValueError(f"{name}: op must be one of 'sum', 'prod', 'min', 'max', 'avg' or 'mean' (avg's alias), "
                         f"got {op!r}")


class Comm:
    """A communicator over `size` ranks; this process is `rank`.

    Obtain one from `tpcore.init()`, inside `tpcore.spawn(fn, n)`, or from `Comm.split`;
    do not construct it yourself.  Usable as a context manager: leaving the block closes
    it, and an exception leaving it first aborts the communicator on every rank.

    Every rank calls the same collectives in the same order with matching shapes and
    dtypes (as NCCL and torch.distributed); a mismatch raises `CommError` on every rank,
    naming both sides.  Arrays: NumPy arrays, `tpcore.DeviceArray` s, or any tensor with
    ``__dlpack__`` (taken without a copy); C-contiguous; dtypes float32, float64, float16,
    bfloat16 (ml_dtypes), int8, uint8, int32, int64 (16-bit floats reduce in float32).

    Reduction ops (`all_reduce`, `reduce_scatter`, `reduce`): "sum", "prod", "min", "max",
    "avg" (the sum divided by the number of ranks; integers truncate toward zero) and
    "mean", an alias of "avg".  Any other string raises ValueError, a non-string TypeError.

    Parameters
    ----------
    ccomm : tpcore._C.Comm
        The C communicator (internal).
    local_rank, local_size : int, optional
        This rank's index among the ranks of its host and their number (default: rank and
        size).

    Attributes
    ----------
    rank, size, local_rank, local_size, backend, timeout, closed
        See the properties.
    """

    def __init__(self, ccomm: "_C.Comm", local_rank: Optional[int] = None,
                 local_size: Optional[int] = None) -> None:
        self._c = ccomm
        self._rank, self._size = ccomm.rank, ccomm.size  # fixed for a communicator's life
        self._local_rank = ccomm.rank if local_rank is None else local_rank
        self._local_size = ccomm.size if local_size is None else local_size

    # -- properties -------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank, 0 <= rank < size."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of ranks of the communicator."""
        return self._size

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks on its host (its GPU under --gpus)."""
        return self._local_rank

    @property
    def local_size(self) -> int:
        """The number of ranks of the communicator on this host."""
        return self._local_size

    @property
    def backend(self) -> str:
        """The backend chosen by `tpcore.init`: "shm", "nccl" or "mpi"."""
        return self._c.backend

    @property
    def timeout(self) -> float:
        """Seconds any one wait may take before `CommTimeout` (settable; > 0, inf: none).

        Raises
        ------
        TypeError, ValueError
            On assignment of a value that is not a number > 0.
        """
        return self._c.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._c.timeout = real_arg(seconds, "Comm", "timeout", lo=0, lo_open=True, finite=False)

    @property
    def closed(self) -> bool:
        """Whether `close` was called (every later call raises CommError)."""
        return self._c.closed

    def __repr__(self) -> str:
        if self._c.closed:
            return "<tpcore.Comm closed>"
        return f"<tpcore.Comm rank {self.rank} of {self.size}, backend {self.backend!r}>"

    # -- collectives ------------------------------------------------------
    def all_reduce(self, x: _A, op: str = "sum", out: Optional[_A] = None) -> _A:
        """Reduce x over all ranks; every rank gets the result.

        Parameters
        ----------
        x : array
            Any shape, the same shape and dtype on every rank; numpy.ndarray, DeviceArray or a DLPack tensor.
        op : {"sum", "prod", "min", "max", "avg", "mean"}, default "sum"
            The reduction; "mean" is an alias of "avg" (sum / size).
        out : array, optional
            Where to write the result, x's shape and dtype (default None: in place on x).

        Returns
        -------
        array
            x (in place) or out.  Bit-identical on every rank (rank-order reduction).

        Raises
        ------
        TypeError
            x or out is not an array tpcore takes (dtype, layout), op is not a string.
        ValueError
            op is not one of the above, out's shape differs, or x is read-only.
        CommError
            Ranks disagree (another collective, count or dtype), a peer failed or aborted,
            or the communicator is closed.
        CommTimeout
            A peer did not arrive within `timeout`.

        Notes
        -----
        Collective: one all-reduce over this communicator.
        """
        if out is None and type(x) is np.ndarray:  # the common case, kept short
            self._c.all_reduce(x, x, op)
            return x
        a = comm_array(x, "x", "all_reduce")
        o = a if out is None else comm_array(out, "out", "all_reduce", writable=True)
        if _shape(o) != _shape(a):
            raise ValueError(f"all_reduce: out has shape {_shape(o)} but x has shape {_shape(a)}")
        self._c.all_reduce(a, o, op)
        return x if out is None else out

    @overload
    def all_gather(self, x: np.ndarray, axis: int = 0, sizes: Optional[Sequence[int]] = None,
                   out: Any = None) -> np.ndarray: ...
    @overload
    def all_gather(self, x: DeviceArray, axis: int = 0, sizes: Optional[Sequence[int]] = None,
                   out: Any = None) -> DeviceArray: ...
    @overload
    def all_gather(self, x: Any, axis: int = 0, sizes: Optional[Sequence[int]] = None, out: Any = None) -> Any: ...
    def all_gather(self, x: Any, axis: int = 0, sizes: Optional[Sequence[int]] = None, out: Any = None) -> Any:
        """The ranks' x concatenated along axis, in rank order.

        Parameters
        ----------
        x : array
            This rank's block; the same shape on every rank except along axis (when sizes
            says so) and the same dtype; numpy.ndarray, DeviceArray or a DLPack tensor.  A 0-d x counts as shape (1,).
        axis : int, default 0
            The axis to concatenate along (negative counts from the end).
        sizes : sequence of int, optional
            Each rank's length along axis, when they differ (default None: all equal).
        out : array, optional
            Where to write the result: x's shape with sum(sizes) along axis, x's dtype.

        Returns
        -------
        numpy.ndarray or DeviceArray
            out, or a new array: NumPy for NumPy and other host tensors, a DeviceArray for a
            DeviceArray or a device tensor.

        Raises
        ------
        TypeError
            x / out not an array tpcore takes, axis not an int, sizes not a sequence of ints,
            out's dtype differs.
        ValueError
            axis out of range, sizes of the wrong length, negative or not matching x,
            out's shape wrong or out read-only.
        CommError, CommTimeout
            As for `all_reduce`.

        Notes
        -----
        Collective: one all-gather over this communicator (axis != 0 moves the axis first,
        a copy).
        """
        if type(x) is np.ndarray and type(axis) is int and axis == 0 and sizes is None and x.ndim:  # common
            if out is None:
                return self._c.all_gather(x, None)
            if type(out) is np.ndarray and out.shape == (x.shape[0] * self._size,) + x.shape[1:]:
                return self._c.all_gather(x, out)
        a = comm_array(x, "x", "all_gather")
        dres = is_device_result(x)
        if a.ndim == 0:
            a = a.reshape((1,))
        ax = _norm_axis(axis, a.ndim, "all_gather")
        sizes = self._sizes(sizes, _shape(a)[ax], "all_gather", "x")
        total = sum(sizes)
        moved = self._made("all_gather", "copy of x with axis 0 first", _shape(a), a, lambda: _to_axis0(a, ax))
        inner = math.prod(_shape(moved)[1:])
        gshape = (total,) + _shape(moved)[1:]
        o = None if out is None else _out_array(out, a, _unmoved(gshape, ax), "all_gather")
        res = o if ax == 0 and o is not None else self._made("all_gather", "output", gshape, a,
                                                             lambda: _empty(gshape, a, dres))
        counts = [s * inner for s in sizes]
        self._c.all_gather(moved, res, counts)
        if ax == 0:
            return out if out is not None else res
        return _from_axis0(res, ax, o, out, dres)

    @overload
    def reduce_scatter(self, x: np.ndarray, op: str = "sum", axis: int = 0, sizes: Optional[Sequence[int]] = None,
                       out: Any = None) -> np.ndarray: ...
    @overload
    def reduce_scatter(self, x: DeviceArray, op: str = "sum", axis: int = 0, sizes: Optional[Sequence[int]] = None,
                       out: Any = None) -> DeviceArray: ...
    @overload
    def reduce_scatter(self, x: Any, op: str = "sum", axis: int = 0, sizes: Optional[Sequence[int]] = None,
                       out: Any = None) -> Any: ...
    def reduce_scatter(self, x: Any, op: str = "sum", axis: int = 0, sizes: Optional[Sequence[int]] = None,
                       out: Any = None) -> Any:
        """Reduce x over ranks and return this rank's block of the result along axis.

        Parameters
        ----------
        x : array
            The same shape and dtype on every rank, at least 1-D; numpy.ndarray, DeviceArray or a DLPack tensor.
        op : {"sum", "prod", "min", "max", "avg", "mean"}, default "sum"
            The reduction; "mean" is an alias of "avg".
        axis : int, default 0
            The axis to split along.
        sizes : sequence of int, optional
            Each rank's block length along axis, adding up to x's length there (default
            None: x's length must split evenly over the ranks).
        out : array, optional
            Where to write this rank's block (x's shape with sizes[rank] along axis).

        Returns
        -------
        numpy.ndarray or DeviceArray
            out, or a new array (NumPy for host inputs, a DeviceArray for device ones).

        Raises
        ------
        TypeError
            As for `all_gather`; op not a string.
        ValueError
            op unknown, x 0-d, the length not splitting evenly without sizes, sizes not
            adding up, out's shape wrong.
        CommError, CommTimeout
            As for `all_reduce`.

        Notes
        -----
        Collective: one reduce-scatter over this communicator.
        """
        if type(x) is np.ndarray and type(axis) is int and axis == 0 and sizes is None and x.ndim and \
                x.shape[0] % self._size == 0:
            if out is None:  # the common case
                return self._c.reduce_scatter(x, None, op)
            if type(out) is np.ndarray and out.shape == (x.shape[0] // self._size,) + x.shape[1:]:
                return self._c.reduce_scatter(x, out, op)
        a = comm_array(x, "x", "reduce_scatter")
        dres = is_device_result(x)
        _check_op(op, "reduce_scatter")
        if a.ndim == 0:
            raise ValueError("reduce_scatter: x must have at least one dimension")
        ax = _norm_axis(axis, a.ndim, "reduce_scatter")
        n = _shape(a)[ax]
        if sizes is None:
            if n % self.size:
                raise ValueError(f"reduce_scatter: x has length {n} along axis {ax}, which does not split "
                                 f"evenly over {self.size} ranks; pass sizes=")
            sizes = [n // self.size] * self.size
        else:
            sizes = self._sizes(sizes, None, "reduce_scatter", None)
            if sum(sizes) != n:
                raise ValueError(f"reduce_scatter: sizes add up to {sum(sizes)} but x has length {n} "
                                 f"along axis {ax}")
        moved = self._made("reduce_scatter", "copy of x with axis 0 first", _shape(a), a, lambda: _to_axis0(a, ax))
        inner = math.prod(_shape(moved)[1:])
        oshape = (sizes[self.rank],) + _shape(moved)[1:]
        o = None if out is None else _out_array(out, a, _unmoved(oshape, ax), "reduce_scatter")
        res = o if ax == 0 and o is not None else self._made("reduce_scatter", "output", oshape, a,
                                                             lambda: _empty(oshape, a, dres))
        self._c.reduce_scatter(moved, res, op, [s * inner for s in sizes])
        if ax == 0:
            return out if out is not None else res
        return _from_axis0(res, ax, o, out, dres)

    all_to_all = _all_to_all  # (x, send_sizes, recv_sizes=None, axis=0, out=None): alltoall.py

    def broadcast(self, x: _A, root: int = 0, out: Optional[_A] = None) -> _A:
        """Root's x to every rank.

        Parameters
        ----------
        x : array
            The same shape and dtype on every rank; root's is sent, the others' are
            overwritten unless out is given; numpy.ndarray, DeviceArray or a DLPack tensor.
        root : int, default 0
            The sending rank, 0 <= root < size.
        out : array, optional
            Where to write the result (default None: in place on x).

        Returns
        -------
        array
            x or out.

        Raises
        ------
        TypeError
            x / out not an array tpcore takes, root not an int.
        ValueError
            root out of range, out's shape differs, x read-only.
        CommError, CommTimeout
            As for `all_reduce`.

        Notes
        -----
        Collective: one broadcast over this communicator.
        """
        if out is None and type(x) is np.ndarray and type(root) is int and 0 <= root < self._size:
            self._c.broadcast(x, x, root)  # the common case
            return x
        a = comm_array(x, "x", "broadcast")
        self._check_rank(root, "broadcast", "root")
        o = a if out is None else comm_array(out, "out", "broadcast", writable=True)
        if _shape(o) != _shape(a):
            raise ValueError(f"broadcast: out has shape {_shape(o)} but x has shape {_shape(a)}")
        self._c.broadcast(a, o, root)
        return x if out is None else out

    def reduce(self, x: _A, root: int = 0, op: str = "sum", out: Optional[_A] = None) -> _A:
        """Reduce x over ranks onto root.

        Parameters
        ----------
        x : array
            The same shape and dtype on every rank; numpy.ndarray, DeviceArray or a DLPack tensor.
        root : int, default 0
            The rank that receives the result.
        op : {"sum", "prod", "min", "max", "avg", "mean"}, default "sum"
            The reduction; "mean" is an alias of "avg".
        out : array, optional
            Where root writes the result (default None: in place on root's x; the other
            ranks' x is left as it was).

        Returns
        -------
        array
            x or out (the result on root only).

        Raises
        ------
        TypeError, ValueError
            As for `all_reduce` and `broadcast` (op, root, out).
        CommError, CommTimeout
            As for `all_reduce`.

        Notes
        -----
        Collective: one reduce over this communicator.
        """
        a = comm_array(x, "x", "reduce")
        self._check_rank(root, "reduce", "root")
        o = a if out is None else comm_array(out, "out", "reduce", writable=True)
        if _shape(o) != _shape(a):
            raise ValueError(f"reduce: out has shape {_shape(o)} but x has shape {_shape(a)}")
        self._c.reduce(a, o, op, root)
        return x if out is None else out

    def send(self, x: Any, peer: int) -> None:
        """Send x to peer (point to point, matched by peer's `recv`).

        Returns once the data is copied out, at most a few chunks ahead of the receiver;
        use `sendrecv` for rings and exchanges.

        Parameters
        ----------
        x : array
            ARRAY; peer's recv has the same element count and dtype.
        peer : int
            The receiving rank, 0 <= peer < size.

        Raises
        ------
        TypeError
            x not an array tpcore takes, peer not an int.
        ValueError
            peer out of range.
        CommError, CommTimeout
            Count / dtype mismatch with the receiver, a peer failure, a timeout.
        """
        self._check_rank(peer, "send", "peer")
        self._c.send(comm_array(x, "x", "send"), peer)

    def recv(self, x: _A, peer: int) -> _A:
        """Receive into x from peer (point to point, matched by peer's `send`).

        Parameters
        ----------
        x : array
            Writable, the sender's element count and dtype; numpy.ndarray, DeviceArray or a DLPack tensor.
        peer : int
            The sending rank.

        Returns
        -------
        array
            x, filled.

        Raises
        ------
        TypeError, ValueError
            As for `send`; x read-only.
        CommError, CommTimeout
            As for `send`.
        """
        self._check_rank(peer, "recv", "peer")
        a = comm_array(x, "x", "recv", writable=True)
        if not _writable(a):
            raise ValueError("recv: x is read-only, but recv writes the received data into it")
        self._c.recv(a, peer)
        return x

    def sendrecv(self, x: Any, dst: int, out: _A, src: int) -> _A:
        """Send x to dst and receive out from src at the same time (no deadlock in rings).

        Parameters
        ----------
        x : array
            What to send; numpy.ndarray, DeviceArray or a DLPack tensor.
        dst : int
            The rank to send to.
        out : array
            Writable, where to receive src's data (its count and dtype).
        src : int
            The rank to receive from.

        Returns
        -------
        array
            out, filled.

        Raises
        ------
        TypeError, ValueError
            As for `send` and `recv` (dst, src, out).
        CommError, CommTimeout
            As for `send`.
        """
        self._check_rank(dst, "sendrecv", "dst")
        self._check_rank(src, "sendrecv", "src")
        self._c.sendrecv(comm_array(x, "x", "sendrecv"), dst, comm_array(out, "out", "sendrecv", writable=True), src)
        return out

    def barrier(self) -> None:
        """Wait until every rank has called barrier.

        Raises
        ------
        CommError, CommTimeout
            A peer failed, or did not arrive within `timeout`.

        Notes
        -----
        Collective.
        """
        self._c.barrier()

    def split(self, color: Optional[int], key: Optional[int] = None) -> Optional["Comm"]:
        """A new communicator of the ranks that pass the same color (MPI_Comm_split).

        Parameters
        ----------
        color : int or None
            0 <= color < 2**31: the group to join; None (or -1): take no part.
        key : int, optional
            Orders the new ranks by (key, old rank); a 32-bit int (default: this rank).

        Returns
        -------
        Comm or None
            The new communicator (same backend and timeout), None for color None.

        Raises
        ------
        ValueError
            color or key not an int in range.
        CommError, CommTimeout
            As for `barrier`.

        Notes
        -----
        Collective over this communicator (an all-gather of the colors and keys).
        """
        if color is None:
            color = -1
        if not is_int(color) or not -1 <= color < 2**31:
            raise ValueError(f"split: color must be an int in 0..2**31-1, or None, got {shown(color)}")
        key = self.rank if key is None else key
        if not is_int(key) or not -2**31 <= key < 2**31:
            raise ValueError(f"split: key must be a 32-bit int, got {shown(key)}")
        sub = self._c.split(int(color), int(key))
        return None if sub is None else Comm(sub)

    def alloc(self, shape: Union[int, Sequence[int]], dtype: Any = "float32") -> np.ndarray:
        """A zero-filled array in memory shared with the peers (registered).

        As NCCL's user-buffer registration: collectives whose arrays lie at the same place
        in the same allocation on every rank read and write peers' memory in place.

        Parameters
        ----------
        shape : int or sequence of int
            The same on every rank; no negative dimension.
        dtype : str or numpy.dtype, default "float32"
            A numeric NumPy dtype, the same on every rank.

        Returns
        -------
        numpy.ndarray
            A C-contiguous zero-filled array of shape and dtype.

        Raises
        ------
        TypeError
            dtype not a numeric NumPy dtype, shape not an int or ints.
        ValueError
            A negative dimension, or more than 2**62 bytes.
        CommError, CommTimeout
            Ranks asked for different sizes, a peer failed, a timeout.

        Notes
        -----
        Collective.
        """
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"alloc: dtype must be a NumPy dtype (e.g. 'float32'), got {shown(dtype)}") from None
        if dt.hasobject or dt.itemsize == 0:
            raise TypeError(f"alloc: dtype {dt} cannot live in shared memory; use a numeric dtype")
        if is_int(shape):
            shape = (shape,)
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__") or \
                not all(is_int(d) for d in shape):
            raise TypeError(f"alloc: shape must be an int or a sequence of ints, got {shown(shape)}")
        shape = tuple(int(d) for d in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"alloc: shape {shape} has a negative dimension")
        n = math.prod(shape)
        if n * dt.itemsize >= 2 ** 62:
            raise ValueError(f"alloc: shape {shape} of {dt} is {n * dt.itemsize} bytes, too large")
        buf = self._c.alloc(n * dt.itemsize)
        return np.frombuffer(buf, dtype=dt, count=n).reshape(shape)

    def stats(self) -> dict[str, Any]:
        """This rank's communication counters since init (not collective).

        Returns
        -------
        dict
            Calls, payload bytes, registered-path calls and seconds spent in communication;
            "regions": the same per region ("attention", "mlp", "embedding", "head" as the
            layers tag their collectives, "other" for the rest), whose seconds add up to
            the total.
        """
        return self._c.stats()

    def history(self) -> list[dict[str, Any]]:
        """This rank's last calls on the communicator, oldest first (not collective).

        Returns
        -------
        list of dict
            TPCORE_HISTORY calls (default 64; 0 keeps none), each with seq (the
            collective's number, the same on every rank; None for send / recv), op, redop,
            dtype, count, root, peer, src, site ("file.py:LINE" of the caller outside
            tpcore), region, start (time.monotonic() clock), seconds (None while running),
            status ("ok", "in progress", or the error's kind).
        """
        return self._c.history()

    @contextmanager
    def _region(self, name: Optional[str]) -> Iterator["Comm"]:
        """Tags the collectives of the block with region `name` in stats() and
        history() (the layers tag theirs: "attention", "mlp", "embedding", "head")."""
        prev = self._c.set_region(name)
        try:
            yield self
        finally:
            if not self._c.closed:
                self._c.set_region(prev)

    def abort(self, reason: str = "") -> None:
        """Fail the communicator on every rank.

        Their pending and future calls raise `CommError` naming this rank and reason.

        Parameters
        ----------
        reason : str, default ""
            Shown in the peers' errors.
        """
        self._c.abort(str(reason))

    def close(self) -> None:
        """Release this rank's resources (not collective; idempotent).

        Peers still waiting on this rank fail with `CommError`.
        """
        self._c.close()

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        if et is not None and not self._c.closed:
            self._c.abort(f"{et.__name__}: {ev}")
        self.close()

    # -- helpers ------------------------------------------------------------
    def _made(self, op, what, shape, a, make):
        """make(): an array of shape and a's dtype that this rank needs for the collective op it
        is about to call.  Its bytes are counted exactly (Python ints) before; one that cannot
        be made (more than an array can hold, or a MemoryError) is an error on every rank: the
        communicator is aborted naming op's number, this rank, the bytes and why (the peers
        that wait in the call, or will, get that CommError rather than a timeout or "rank R
        closed the communicator"), and raised here as a MemoryError or ValueError."""
        nbytes = math.prod(shape) * (a.itemsize if isinstance(a, np.ndarray) else TENSOR_DTYPES[a.dtype])
        try:
            if nbytes > sys.maxsize:
                raise ValueError(f"more than the {sys.maxsize} bytes an array can hold")
            return make()
        except (MemoryError, ValueError, OverflowError) as e:
            raise self._c.output_failed(op, what, str(nbytes), e) from e

    def _check_rank(self, r, op, what):
        if not is_int(r):
            raise TypeError(f"{op}: {what} must be an int, got {shown(r)}")
        if not 0 <= r < self.size:
            raise ValueError(f"{op}: invalid {what} {r} (world size {self.size})")

    def _sizes(self, sizes, mine, op, arg):
        if sizes is None:
            return [mine] * self.size
        if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
            raise TypeError(f"{op}: sizes must be a sequence of ints, got {shown(sizes)}")
        sizes = list(sizes)
        if not all(is_int(s) for s in sizes):
            raise TypeError(f"{op}: sizes must be a sequence of ints, got {sizes!r}")
        sizes = [operator.index(s) for s in sizes]
        if len(sizes) != self.size:
            raise ValueError(f"{op}: sizes has {len(sizes)} entries, expected one per rank ({self.size})")
        if any(s < 0 for s in sizes):
            raise ValueError(f"{op}: sizes must be >= 0, got {sizes}")
        if mine is not None and sizes[self.rank] != mine:
            raise ValueError(f"{op}: sizes[{self.rank}] is {sizes[self.rank]} but {arg} has length {mine} "
                             f"along the axis")
        return sizes
