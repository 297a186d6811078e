"""How a tensor crosses between torch and a tpcore C layer: device and dtype checks, the
zero-copy views each way (NumPy for CPU tensors, DLPack for GPU ones), and the conversion of
state-dict tensors to host arrays."""
from __future__ import annotations

from typing import Any, Optional, Tuple, cast

import numpy as np
import torch

from tpcore.utils.arrays import DeviceArray
from tpcore.utils.dtypes import weight_format


# ------------------------------------------------------------------ tensor crossing
def _dev_text(t: torch.Tensor) -> str:
    d = t.device
    return f"{d.type}:{0 if d.index is None else d.index}"


def _check_tensor(x: Any, name: str, who: str, device: Tuple[str, int]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(x).__name__}")
    have = ("cpu", 0) if x.device.type == "cpu" else (x.device.type, 0 if x.device.index is None else x.device.index)
    if have != device:
        where = "the CPU (cpu:0)" if device[0] == "cpu" else f"{device[0]}:{device[1]}"
        raise TypeError(f"{who}: {name} is on {_dev_text(x)} but the module is on {where}; move it first "
                        f"({name}.to('{device[0]}:{device[1]}')) or build the module with device="
                        f"'{_dev_text(x)}'")


def _trainable_dtype(dtype: Any, who: str) -> None:
    """nn.Modules train their weights: a quantized format (frozen weights) is refused by name."""
    weight_format(dtype if not isinstance(dtype, dict) else "float32", who, quantized=False)
    if isinstance(dtype, dict):
        raise TypeError(f"{who}: dtype must be one dtype, got a dict")


def _float_input(x: Any, name: str, who: str, device: Tuple[str, int]) -> Tuple[torch.Tensor, Optional[torch.dtype]]:
    """x as float32 contiguous (the dtype to give the result back in, None for float32)."""
    _check_tensor(x, name, who, device)
    if x.dtype == torch.float32:
        return x.contiguous(), None
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.float().contiguous(), x.dtype
    raise TypeError(f"{who}: {name} has dtype {x.dtype}; expected torch.float32 (bfloat16 and float16 are "
                    f"computed in float32 and given back in their dtype)")


def _host(t: torch.Tensor) -> Any:
    """What the tpcore layer takes for tensor t: a NumPy view of a CPU tensor (no copy), the
    tensor itself on a GPU (the layer imports it through DLPack)."""
    return t.detach().numpy() if t.device.type == "cpu" else t.detach()


def _wrap(a: Any) -> torch.Tensor:
    """A C result as a torch tensor over the same memory: a NumPy array (torch.from_numpy) or a
    tpcore.DeviceArray (DLPack)."""
    if isinstance(a, DeviceArray):
        return torch.utils.dlpack.from_dlpack(a)
    if a.dtype.name == "bfloat16":  # an ml_dtypes array: torch reads it as its bits
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _full_tensor(a: Any) -> torch.Tensor:
    """A gathered full tensor (host NumPy, any float dtype) as a torch tensor."""
    return _wrap(np.ascontiguousarray(a))


def _to_numpy(t: Any, name: str, who: str) -> np.ndarray:
    """A tensor from a state dict as a host array load_full takes (float32 for 16-bit ones)."""
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if not t.is_floating_point():
        raise TypeError(f"{who}: {name} must be a floating-point tensor, got {t.dtype}")
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return cast(np.ndarray, t.contiguous().numpy())

def _tracing() -> bool:
    """Whether torch.jit.trace is recording."""
    return bool(torch.jit.is_tracing())  # type: ignore[attr-defined,no-untyped-call]
