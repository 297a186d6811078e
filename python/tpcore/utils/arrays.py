"""Array import: the one place where tpcore's Python face turns what a caller passed
(a NumPy array, a tensor of another library through DLPack, a list) into the NumPy
array the C core reads.  Every entry point that takes arrays comes here: the
collectives (comm.py), the layers, TransformerBlock, the models and the loading of
parameters (load_full, load_state_dict_full).

- A NumPy array passes as it is.
- An object with __dlpack__ (a PyTorch, JAX, CuPy ... tensor) has its device read
  first (__dlpack_device__): host memory (CPU, and the pinned or managed host memory
  of CUDA and ROCm) is imported through NumPy's DLPack import, without a copy; a
  tensor on another device is a TypeError naming the operation, the argument and the
  device, and saying what this build supports (tpcore.build_info()["devices"]),
  instead of a failure deep in NumPy or in the producer.
- Anything else: `as_array` refuses it (the collectives and layers take arrays
  only); `asarray` hands it to np.asarray (lists of numbers, memory-mapped and lazy
  checkpoint tensors).

`int_array` checks an argument of integers (token ids, positions, slots) the same way.

This module imports nothing of tpcore but the extension and `tpcore.utils.args` (the
argument checks)."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from tpcore import _C
from tpcore.utils.args import is_int, shown

# DLPack's DLDeviceType codes (dlpack.h) and the names tpcore gives them in messages
DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi",
                  10: "rocm", 11: "rocm_host", 12: "ext_dev", 13: "cuda_managed", 14: "oneapi", 15: "webgpu",
                  16: "hexagon", 17: "maia"}
# what a message calls a tensor of that device ("a CUDA tensor") and the support a build would need
_KINDS = {2: "CUDA", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm", 12: "extension-device",
          14: "oneAPI", 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}
# memory the CPU reads and writes directly: NumPy imports it, tpcore's host code uses it
HOST_DEVICES = frozenset((1, 3, 11, 13))


def build_devices() -> Tuple[str, ...]:
    """The devices this build of the C core has ("cpu" always)."""
    devs = _C.build_info().get("devices") or ("cpu",)
    return tuple(str(d) for d in devs)


def dlpack_device(x, name: str, op: str) -> Optional[Tuple[int, int]]:
    """(device_type, device_id) of a DLPack producer, or None when it does not say
    (no __dlpack_device__, or one that fails: the import below reports the producer's
    own error).  A malformed answer is a TypeError."""
    get = getattr(x, "__dlpack_device__", None)
    if get is None:
        return None
    try:
        dev = tuple(get())
    except Exception:  # noqa: BLE001 - a producer's own failure: np.from_dlpack reports it
        return None
    if len(dev) != 2 or not all(is_int(d) for d in dev):
        raise TypeError(f"{op}: {name}.__dlpack_device__() must return a (device_type, device_id) pair of "
                        f"integers, got {shown(dev)}")
    return int(dev[0]), int(dev[1])


def device_text(dev: Tuple[int, int]) -> str:
    """'cuda:0' for (2, 0); 'dlpack-device-42:0' for a code DLPack does not define."""
    return f"{DLPACK_DEVICES.get(dev[0], f'dlpack-device-{dev[0]}')}:{dev[1]}"


def check_host(x, name: str, op: str) -> None:
    """A TypeError unless x lives in host memory (x without __dlpack__ is host data)."""
    if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
        return
    dev = dlpack_device(x, name, op)
    if dev is None or dev[0] in HOST_DEVICES:
        return
    kind = _KINDS.get(dev[0], DLPACK_DEVICES.get(dev[0], f"DLPack device type {dev[0]}"))
    short = DLPACK_DEVICES.get(dev[0], "")
    devices = build_devices()
    if short in devices:  # a build with that device: the Python layers still take host arrays
        raise TypeError(f"{op}: {name} is a {kind} tensor (DLPack device {device_text(dev)}) but this {op} is on "
                        f"the CPU (cpu:0); copy it to the host first, or make the layer with device='"
                        f"{device_text(dev)}' where it takes one")
    raise TypeError(f"{op}: {name} is a {kind} tensor (DLPack device {device_text(dev)}); this build of tpcore "
                    f"has no {kind} support (tpcore.build_info() lists the devices: {', '.join(devices)})")


def _from_dlpack(x, name: str, op: str) -> np.ndarray:
    check_host(x, name, op)
    try:
        return np.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError, ValueError, AttributeError) as e:
        raise TypeError(f"{op}: {name} could not be imported through DLPack: {type(e).__name__}: {e}") from e


def as_array(x, name: str, op: str) -> np.ndarray:
    """x as a NumPy array sharing its memory: a NumPy array as it is, a host tensor with
    __dlpack__ through DLPack (no copy).  A tensor on another device, or anything that is
    not an array, is a TypeError naming op and the argument."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        return _from_dlpack(x, name, op)
    raise TypeError(f"{op}: {name} must be a NumPy array or a CPU tensor with __dlpack__, "
                    f"got {type(x).__name__}")


def asarray(x, name: str, op: str, dtype=None) -> np.ndarray:
    """as_array for arguments that may also be lists or other array-likes (np.asarray):
    a DLPack tensor still has its device checked first; a host one with __array__ is read
    through it as before (a bfloat16 JAX array, which NumPy's DLPack import refuses),
    one without through DLPack (no copy)."""
    if not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):
        if hasattr(x, "__array__"):
            check_host(x, name, op)
        else:
            x = _from_dlpack(x, name, op)
    return np.asarray(x) if dtype is None else np.asarray(x, dtype=dtype)


# ---------------------------------------------------------------- device arrays
# tpcore.DeviceArray (csrc/python/devarray.c) holds memory of one device and is
# tpcore's DLPack producer; _C.from_dlpack is its C consumer (csrc/python/dlpack.c).

DeviceArray = _C.DeviceArray


def cuda_available() -> bool:
    """tpcore.cuda_available(): whether tensors can live on a CUDA GPU in this process."""
    from tpcore.utils import cuda
    return cuda.available()


def resolve_device(device, who: str) -> Tuple[str, int]:
    """('cpu', 0) for None or 'cpu'; ('cuda', N) for 'cuda:N', and for 'cuda' the rank's
    GPU (device 0 when CUDA_VISIBLE_DEVICES names one GPU, as tpcore.launch --gpus
    sets it, else LOCAL_RANK).  A device this process lacks is an error naming `who`."""
    if device is None:
        return "cpu", 0
    if not isinstance(device, str):
        raise TypeError(f"{who}: device must be a string such as 'cpu', 'cuda' or 'cuda:1', got "
                        f"{type(device).__name__}")
    try:
        kind, idx = _C.parse_device(device)
    except (ValueError, RuntimeError, TypeError) as e:
        msg = str(e).replace("parse_device: ", "", 1)
        raise type(e)(f"{who}: {msg}") from None
    return str(kind), int(idx)


def device_string(dev: Tuple[str, int]) -> str:
    return f"{dev[0]}:{dev[1]}"


def asarray_device(x: Any, device: Optional[str] = None, dtype: Any = None,
                   copy: Optional[bool] = None) -> "DeviceArray":
    """x as a tpcore.DeviceArray (``tpcore.asarray``).

    Parameters
    ----------
    x : DeviceArray, DLPack tensor, numpy.ndarray or array_like
        The data (a list is converted by NumPy first).
    device : str, optional
        "cpu", "cuda" or "cuda:N".  Default None: where x is (host data: the CPU).
    dtype : str or dtype, optional
        The result's dtype ("float32", "bfloat16", "int64", ...; a change goes through the
        host, a copy).  Default None: x's.
    copy : bool, optional
        None (default): reuse x's memory when it is already on that device with that
        dtype, else copy; True: always a new array; False: never copy.  Host data goes to
        a GPU by a copy.

    Returns
    -------
    DeviceArray

    Raises
    ------
    TypeError
        copy not None / True / False, or x of a dtype or kind tpcore does not take.
    ValueError
        copy=False but a copy is needed; an unknown device.
    """
    if copy not in (None, True, False):
        raise TypeError(f"asarray: copy must be None, True or False, got {copy!r}")
    if isinstance(x, DeviceArray) or (hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray)):
        if dtype is None:
            return _C.asarray(x, device=device, copy=copy)
        # a dtype change: through the host (a copy)
        if copy is False:
            raise ValueError("asarray: changing the dtype needs a copy, and copy=False was asked")
        x = x.to_numpy() if isinstance(x, DeviceArray) else _from_host_dlpack(x, "x", "asarray")
    src = x
    arr = np.asarray(src, dtype=_np_dtype(dtype) if dtype is not None else None)
    copied = not (isinstance(src, np.ndarray) and np.shares_memory(arr, src))
    if not arr.flags.c_contiguous:
        arr, copied = np.ascontiguousarray(arr), True
    if copied and copy is False:
        raise ValueError("asarray: x is not a C-contiguous array of that dtype in memory; converting it needs a "
                         "copy, and copy=False was asked")
    return _C.asarray(arr, device=device, copy=None if copied and copy else copy)


def _from_host_dlpack(x, name, op):
    try:
        return _C.from_dlpack(x, op=op, name=name).to_numpy()
    except TypeError:
        return _from_dlpack(x, name, op)


def _np_dtype(dtype):
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def from_dlpack(x: Any, writable: bool = False) -> "DeviceArray":
    """A tpcore.DeviceArray viewing x's memory (no copy).

    tpcore's own DLPack consumer (bfloat16 included, which NumPy's is not).

    Parameters
    ----------
    x : object with ``__dlpack__``
        Any DLPack producer (NumPy, PyTorch, JAX, CuPy, a DeviceArray) on a device of this
        build.
    writable : bool, default False
        Ask for a writable view (a read-only producer is then refused).

    Returns
    -------
    DeviceArray
        A view of x's memory, alive as long as the view.

    Raises
    ------
    TypeError
        x is not a DLPack producer, or its dtype, layout or device is not one tpcore
        takes (named in the message).
    """
    return _C.from_dlpack(x, writable=writable)


def device_of(x) -> Optional[Tuple[str, int]]:
    """('cuda', N) / ('cpu', 0) of a DLPack producer, None for plain host data."""
    if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack_device__"):
        return None
    dev = dlpack_device(x, "x", "device_of")
    if dev is None:
        return None
    if dev[0] in HOST_DEVICES:
        return "cpu", 0
    return DLPACK_DEVICES.get(dev[0], f"dlpack-device-{dev[0]}"), dev[1]


def check_on_device(x, name: str, who: str, device: Tuple[str, int]) -> None:
    """A TypeError naming the layer, the argument and both devices unless x lives on
    `device` (host data counts as the CPU)."""
    have = device_of(x) or ("cpu", 0)
    if have[0] == "cpu" and device[0] == "cpu":
        return
    if have != device:
        raise TypeError(f"{who}: {name} is on {device_string(have)} but the layer is on {device_string(device)}; "
                        f"move it first (tpcore.asarray({name}, device='{device_string(device)}'))")


# ------------------------------------------------------- collectives' arguments
# The collectives hand NumPy arrays and DeviceArrays (any device) to the C communicator
# as they are; the C dispatcher (csrc/comm/staged.c) stages device memory a backend
# cannot take (a CUDA buffer over shm) and host memory the NCCL backend cannot (through
# a device bounce buffer).  There is no Python-level staging.

def comm_array(x, name: str, op: str, writable: bool = False):
    """x as the C collectives take it: a NumPy array or a tpcore.DeviceArray as it is;
    any other tensor with __dlpack__ (a CUDA tensor, or a CPU tensor that is not NumPy)
    as a DeviceArray view of its memory (_C.from_dlpack: no copy, the producer's capsule
    held).  A tensor of a device this process cannot use is a clear error naming op and
    the argument; a producer whose export fails is a TypeError naming both."""
    if isinstance(x, (np.ndarray, DeviceArray)):
        return x
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"{op}: {name} must be a NumPy array, a tpcore.DeviceArray or a tensor with __dlpack__, "
                        f"got {type(x).__name__}")
    dev = dlpack_device(x, name, op)
    if dev is not None and dev[0] not in HOST_DEVICES and (dev[0] != 2 or "cuda" not in build_devices()):
        check_host(x, name, op)  # a device this build has no support for: refused by name
    try:
        return _C.from_dlpack(x, writable=writable, op=op, name=name)
    except Exception as e:
        msg = str(e)
        failed = f"{op}: {name} could not be exported through DLPack: "
        if msg.startswith(failed):  # the producer's own failure, worded as the collectives always did
            raise TypeError(f"{op}: {name} could not be imported through DLPack: {msg[len(failed):]}") from e
        if msg.startswith(f"{op}: "):  # tpcore's own check, already naming op and argument
            raise
        raise TypeError(f"{op}: {name} could not be imported through DLPack: {type(e).__name__}: {e}") from e


def is_device_result(x) -> bool:
    """A new output of a collective on x is a DeviceArray (x is one, or x is a tensor
    on a device); a NumPy array for NumPy and other host tensors, as before."""
    if isinstance(x, DeviceArray):
        return True
    if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack_device__"):
        return False
    dev = dlpack_device(x, "x", "collective")
    return dev is not None and dev[0] not in HOST_DEVICES


def int_array(a, who: str, name: str) -> np.ndarray:
    """An integer NumPy array (not bool, not float, not strings), as int64 (C-contiguous)."""
    if isinstance(a, (str, bytes)):
        raise TypeError(f"{who}: {name} must be integers, got {shown(a)}")
    if not isinstance(a, np.ndarray) and hasattr(a, "__dlpack__"):
        a = asarray(a, name, who)  # its device checked; a DLPack-only tensor imported without a copy
    try:
        t = np.asarray(a)
    except (ValueError, TypeError) as e:  # ragged nesting
        raise ValueError(f"{who}: {name} could not be read as an array of integers: {e}") from None
    if t.size == 0 and not isinstance(a, np.ndarray) and t.dtype == np.float64:
        t = t.astype(np.int64)  # [] or [[]]: NumPy's default dtype for an empty list is float64
    if t.dtype.kind == "f" and isinstance(a, (list, tuple)):
        o = np.array(a, dtype=object)  # e.g. [2**63, -1]: ints NumPy could only hold as floats
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in o.flat):
            t = o
    if t.dtype == object:  # Python ints (past int64 too), or anything else
        bad = [v for v in t.flat if isinstance(v, bool) or not isinstance(v, (int, np.integer))]
        if bad:
            raise TypeError(f"{who}: {name} must be integers, got {shown(bad[0])}")
        out = [int(v) for v in t.flat if not -2 ** 63 <= int(v) < 2 ** 63]
        if out:
            raise ValueError(f"{who}: {name} must be in the int64 range [-2**63, 2**63), got {out[0]}")
        return np.require(t, np.int64, "C")  # (ascontiguousarray would make a 0-d array 1-d)
    if t.dtype.kind not in "iu" or t.dtype == np.bool_:
        raise TypeError(f"{who}: {name} must be integers, got dtype {t.dtype}")
    if t.dtype == np.uint64 and t.size and int(t.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{who}: {name} holds {int(t.max())}, past the int64 range")
    return np.require(t, np.int64, "C")  # (ascontiguousarray would make a 0-d array 1-d)
