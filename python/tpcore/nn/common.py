"""What the layers' Python faces share around the C layers: their inputs as the float32
rows the C layers take (host arrays, foreign tensors through DLPack, GPU tensors converted
on their device) and their outputs back in the input's dtype, zeroing a buffer where it
lives, the ``memory()`` dict of a layer (`MEMORY_KEYS`, `layer_memory`), and the one check of
a backward's gradient against the last forward's output (`kept_output`, `check_grad`)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from tpcore import _C
from tpcore.utils.arrays import DeviceArray, as_array
from tpcore.utils.dtypes import HALF_FORMATS


def _is_half(dt: np.dtype) -> bool:
    return dt.name in HALF_FORMATS


def host_tensor(x, name: str, who: str):
    """A host tensor with __dlpack__ as a NumPy view (no copy); a bfloat16 one, which NumPy's
    DLPack import refuses (PyTorch, JAX), through tpcore's own consumer as a CPU
    tpcore.DeviceArray view instead (as_float32 converts it; no ml_dtypes needed)."""
    try:
        return as_array(x, name, who)
    except TypeError:
        try:
            xa = _C.from_dlpack(x, op=who, name=name)
        except ValueError:  # tpcore's consumer took the dtype but not the layout: its error says why (strides)
            raise
        except Exception:  # noqa: BLE001 - not a bfloat16 tensor: NumPy's error stands
            xa = None
        if xa is None or xa.dtype != "bfloat16" or xa.device != "cpu:0":
            raise
        return xa


def as_float32(x, name: str, who: str) -> np.ndarray:
    """x as the float32 C-contiguous array the C layers take: a NumPy array or any CPU
    tensor with __dlpack__ (PyTorch, JAX, ...; imported without a copy); float32 as is
    (it must be C-contiguous), float16 / bfloat16 converted (compute is float32)."""
    if not isinstance(x, np.ndarray):
        if not isinstance(x, DeviceArray) and not hasattr(x, "__dlpack__"):
            raise TypeError(f"{who}: {name} must be a NumPy array or a CPU tensor with __dlpack__, "
                            f"got {type(x).__name__}")
        x = x if isinstance(x, DeviceArray) else host_tensor(x, name, who)
        if isinstance(x, DeviceArray):  # a CPU bfloat16 tensor: converted in C
            x32 = DeviceArray(tuple(x.shape), "float32")
            _C.convert(x, None, x32)
            return x32.numpy()
    if x.dtype == np.float32:
        if not x.flags.c_contiguous:
            raise ValueError(f"{who}: {name} must be C-contiguous; pass np.ascontiguousarray({name})")
        return x
    if _is_half(x.dtype):
        return np.ascontiguousarray(x, dtype=np.float32)
    raise TypeError(f"{who}: {name} has dtype {x.dtype}; expected float32 (float16 and bfloat16 are converted)")


def zero(a) -> None:
    """a[...] = 0 where a lives (a DeviceArray: a fill on its device, no host buffer)."""
    if isinstance(a, DeviceArray):
        _C.fill(a, 0.0)
    else:
        a[...] = 0


def dev_f32(xa):
    """A GPU layer's input (a DeviceArray) as float32 on its device: a bfloat16 / float16 one
    converted there (tpcore._C.convert), with the dtype to give the result back in (None:
    float32 as it came; another dtype goes on to the C layer, which names it)."""
    if xa.dtype not in HALF_FORMATS:
        return xa, None
    x32 = DeviceArray(xa.shape, "float32", device=xa.device)
    _C.convert(xa, None, x32)
    return x32, xa.dtype


def dev_back(y, dt):
    """A GPU layer's float32 result in the input's 16-bit dtype (dt None: as it is)."""
    if dt is None:
        return y
    out = DeviceArray(y.shape, dt, device=y.device)
    _C.convert(y, None, out)
    return out


def _back(y: np.ndarray, dt) -> np.ndarray:
    if isinstance(dt, str):  # "bfloat16" for a foreign tensor: a CPU DeviceArray (torch.from_dlpack reads it)
        return dev_back(_C.asarray(np.ascontiguousarray(y)), dt)
    return y if dt is None else y.astype(dt)


MEMORY_KEYS = ("params", "grads", "optimizer", "kv_cache", "kv_cache_used", "workspace", "comm")
"""The byte counts of a layer's or a model's ``memory()`` (with "device" and "total")."""


def layer_memory(c: Dict[str, Any], **extra: int) -> Dict[str, Any]:
    """A C layer's ``memory()`` dict in the package's keys (`MEMORY_KEYS`, "device",
    "total"), plus the bytes of host arrays the Python layer keeps (extra: key -> bytes)."""
    out: Dict[str, Any] = {"device": c["device"], "params": c["params"], "grads": c["grads"], "optimizer": 0,
                           "kv_cache": c["cache"], "kv_cache_used": c["cache_used"], "workspace": c["workspace"],
                           "comm": c["comm"]}
    for k, v in extra.items():
        out[k] += int(v)
    out["total"] = sum(out[k] for k in MEMORY_KEYS if k != "kv_cache_used")  # used is part of kv_cache
    return out


def kept_output(layer: Any, shape: Optional[Tuple[int, ...]]) -> None:
    """Records the shape of the output of layer's last forward that a backward may follow (None:
    nothing kept, e.g. an inference forward), for `check_grad`."""
    layer._out_shape = None if shape is None else tuple(int(n) for n in shape)


def check_grad(layer: Any, shape: Tuple[int, ...], name: str = "dy") -> None:
    """A backward's gradient, of shape (converted to what the C layer takes: its dtype and layout
    checked), must have the exact shape of the last forward's output (`kept_output`); a
    ValueError naming both otherwise.  The C layers see rows only: a gradient of another shape with as many rows
    (batch and sequence swapped, (T, B, C) for (B, T, C)) would be read as the forward's rows
    and give a wrong gradient silently.  No forward kept: left to the C layer, which says so."""
    want = getattr(layer, "_out_shape", None)
    got = tuple(int(n) for n in shape)
    if want is not None and got != want:
        raise ValueError(f"{type(layer).__name__}.backward: {name} has shape {got} but the last forward's output "
                         f"has shape {want}; {name} must be the gradient of that output, of its shape")


def softcap(x: np.ndarray, cap: float, out: Optional[np.ndarray] = None) -> np.ndarray:
    """cap * tanh(x / cap) in float32, as transformers computes Gemma 2's soft-capping (into out
    when given, which may be x)."""
    c = np.float32(cap)
    y = np.divide(x, c, out=out, dtype=np.float32)
    np.tanh(y, out=y)
    y *= c
    return y
