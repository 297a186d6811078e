"""The array helpers of the collectives that work along an axis (Comm.all_gather,
Comm.reduce_scatter in comm.py; Comm.all_to_all in alltoall.py): the axis checked, moved
first and back, outputs made and checked."""
from __future__ import annotations

import math

import numpy as np

from tpcore import _C
from tpcore.utils.args import is_int, shown
from tpcore.utils.arrays import DeviceArray, comm_array


def _norm_axis(axis, ndim, name):
    if not is_int(axis):
        raise TypeError(f"{name}: axis must be an int, got {shown(axis)}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: axis {axis} is out of range for an array of {ndim} dimensions")
    return int(axis) % ndim


def _unmoved(shape, ax):
    """The shape of np.moveaxis(array of shape, 0, ax)."""
    return tuple(shape[1:ax + 1]) + (shape[0],) + tuple(shape[ax + 1:])


def _dt(a) -> str:
    """The dtype's name (a DeviceArray's dtype is its name already)."""
    return a.dtype if isinstance(a, DeviceArray) else a.dtype.name


def _writable(a) -> bool:
    return not a.readonly if isinstance(a, DeviceArray) else a.flags.writeable


def _shape(a) -> tuple:
    return tuple(a.shape)


def _empty(shape, a, device_result):
    """A new array of shape and a's dtype: NumPy for NumPy; else on a's device, a
    DeviceArray when device_result (x lives on a device or is a DeviceArray), else
    (a host tensor of another library, as before) a NumPy view of host memory."""
    if isinstance(a, np.ndarray):
        return np.empty(shape, dtype=a.dtype)
    r = DeviceArray(shape, a.dtype, a.device)
    return r if device_result else r.to_numpy()


def _to_axis0(a, ax):
    """a with axis ax moved first, C-contiguous (a itself for ax 0).  A DeviceArray's
    transpose goes through host memory (tpcore has no device transpose); when the axes
    before ax all have length 1 it is a view (the same bytes)."""
    if ax == 0:
        return a
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(np.moveaxis(a, ax, 0))
    shape = _shape(a)
    if math.prod(shape[:ax]) == 1:
        return a.reshape((shape[ax],) + shape[:ax] + shape[ax + 1:])
    return _C.asarray(np.ascontiguousarray(np.moveaxis(a.to_numpy(), ax, 0)), device=a.device)


def _from_axis0(res, ax, o, out, device_result):
    """The result of a gather or scatter along axis ax != 0 (res: axis 0 first) into o
    (returns out), or as a new array on res's device."""
    h = res if isinstance(res, np.ndarray) else res.to_numpy()
    r = np.moveaxis(h, 0, ax)
    if o is not None:
        o[...] = r
        return out
    r = np.ascontiguousarray(r)
    return _C.asarray(r, device=res.device) if device_result and isinstance(res, DeviceArray) else r


def _out_array(out, a, shape, name):
    """out= of a gather or scatter, checked before the collective runs (a copy along another
    axis must not fail, or silently cast, after the data moved): shape, dtype, writable."""
    o = comm_array(out, "out", name, writable=True)
    if _shape(o) != shape:
        raise ValueError(f"{name}: out has shape {_shape(o)}, expected {shape}")
    if _dt(o) != _dt(a):
        raise TypeError(f"{name}: out has dtype {o.dtype} but x has dtype {a.dtype}; they must match")
    if not _writable(o):
        raise ValueError(f"{name}: out is read-only but the operation writes into it")
    return o
