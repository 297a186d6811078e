"""The model's own arrays outside the layers: where they live, and the replicated norms.

`on_device` puts a host array where the model's d_ kernels run (a GPU, or the CPU device
path) and `_array_device` says where an array's bytes are; `_Norm` is the LayerNorm / RMSNorm
that `TransformerLM` keeps replicated on every rank (the embedding norm of BERT, the final
norm of the pre-norm decoders): float32 parameters, the C kernels, gradients on demand.
"""
from __future__ import annotations

import numpy as np

from tpcore import _C
from tpcore.utils.arrays import DeviceArray, asarray_device

__all__ = ["on_device"]


def _normal(seed: int, tag: int, shape, std: float) -> np.ndarray:
    """Random float32 N(0, std) weights, the same for a (seed, tag) at any world size."""
    return (np.random.default_rng([seed, tag]).standard_normal(shape) * std).astype(np.float32)


def on_device(a, dev):
    """A host array as a DeviceArray on dev (a device string), or a plain NumPy array (dev None)."""
    return a if dev is None else asarray_device(a, device=dev)


def _array_device(a) -> str:
    """Where an array's bytes live: "cpu" (NumPy, a DeviceArray of the CPU) or "cuda:N"."""
    if isinstance(a, DeviceArray):
        dev = a.device
        return "cpu" if dev.startswith("cpu") else dev
    return "cpu"


class _Norm:
    """A replicated LayerNorm/RMSNorm (C kernels): NumPy arrays on the CPU; on a GPU its
    parameters are DeviceArrays there and it runs the d_ kernels (no host round trip)."""

    def __init__(self, kind: str, C: int, eps: float, dev=None):
        self.kind, self.eps, self.dev = kind, float(eps), dev
        self.weight = on_device(np.ones(C, np.float32), dev)
        self.bias = on_device(np.zeros(C, np.float32), dev) if kind == "layernorm" else None
        self.grad_weight = self.grad_bias = None  # on demand (_alloc_grads): none for inference
        self._ctx = None

    def _alloc_grads(self):
        """The gradients, zeroed, unless they exist."""
        if self.grad_weight is None:
            C = self.weight.shape[0]
            self.grad_weight = on_device(np.zeros(C, np.float32), self.dev)
            self.grad_bias = None if self.bias is None else on_device(np.zeros(C, np.float32), self.dev)

    def _weights(self):
        return [self.weight] + ([] if self.bias is None else [self.bias])

    def parameters(self):
        self._alloc_grads()
        return [(self.weight, self.grad_weight)] + ([] if self.bias is None else [(self.bias, self.grad_bias)])

    def forward(self, x2):
        y, mu, rs = _C.norm_forward(self.kind, x2, self.weight, self.bias, self.eps)
        self._ctx = (x2, mu, rs)
        return y

    def backward(self, dy2):
        x2, mu, rs = self._ctx
        self._alloc_grads()
        if self.dev is None:
            dy2 = np.ascontiguousarray(dy2, np.float32)
        return _C.norm_backward(self.kind, dy2, x2, self.weight, mu, rs, self.grad_weight, self.grad_bias)
