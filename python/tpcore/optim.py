"""Optimizers over parameter shards: each rank updates the shard it holds, in C.

    opt = tpcore.optim.AdamW(model.parameters(), lr=1e-3)
    ...; model.backward(dy); opt.step(); model.zero_grad()

`params` is a list of (param, grad) NumPy array pairs (layers' .parameters()
give views of their C memory), or objects with .parameters().  Replicated
parameters (a row-parallel bias) get the same gradient on every rank and so
stay identical.  Formulas: torch.optim.AdamW and torch.optim.SGD.

Mixed precision: a bfloat16 / float16 parameter (a layer built with
dtype="bfloat16") comes with a float32 gradient; the optimizer keeps a float32
master copy of it (taken at construction) and float32 state, steps the master
and writes it back rounded to nearest even (Megatron's and apex's O2 scheme:
the 16-bit weights never accumulate the small updates themselves).
"""
from __future__ import annotations

import numpy as np

from . import _C
from ._args import real_arg, shown
from ._array import check_host


def _pairs(params, who):
    """(param, grad) pairs from a module, a list of modules and/or pairs; each param a writable
    C-contiguous float32 array with a grad of its shape, none listed twice."""
    if hasattr(params, "parameters"):
        params = [params]
    if isinstance(params, (str, bytes, dict, np.ndarray)) or not hasattr(params, "__iter__"):
        raise TypeError(f"{who}: params must be a module (with .parameters()) or a list of modules and "
                        f"(param, grad) NumPy array pairs, got {shown(params)}")
    out = []
    for p in params:
        if hasattr(p, "parameters"):
            out.extend(_pairs(p.parameters(), who))
            continue
        if isinstance(p, (tuple, list)) and len(p) == 2:
            for a, what in zip(p, ("param", "grad")):
                check_host(a, what, who)  # a tensor on a device: say so, not "not a NumPy array"
        if not (isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(a, np.ndarray) for a in p)):
            raise TypeError(f"{who}: params must be (param, grad) NumPy array pairs or modules, got {shown(p)}")
        param, grad = p
        if param.dtype.name not in ("float32", "bfloat16", "float16") or grad.dtype != np.float32 or \
                grad.shape != param.shape:
            raise ValueError(f"{who}: param must be float32, bfloat16 or float16 with a float32 grad of its shape, "
                             f"got {param.dtype} {param.shape} and {grad.dtype} {grad.shape}")
        if not (param.flags.c_contiguous and grad.flags.c_contiguous and param.flags.writeable):
            raise ValueError(f"{who}: param {len(out)} (shape {param.shape}) and its grad must be C-contiguous and "
                             f"the param writable")
        out.append((param, grad))
    seen = {}
    for i, (param, _) in enumerate(out):
        at = param.__array_interface__["data"][0]
        if param.size and at in seen:
            raise ValueError(f"{who}: params {seen[at]} and {i} are the same array; each parameter may be listed "
                             f"once (it would be updated twice per step)")
        seen[at] = i
    if not out:
        raise ValueError(f"{who}: params is empty; there is nothing to optimize")
    return out


def _masters(params):
    """The float32 master copy of each 16-bit parameter (None for a float32 one)."""
    return [None if p.dtype == np.float32 else np.ascontiguousarray(p, dtype=np.float32) for p, _ in params]


class AdamW:
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        lr = real_arg(lr, "AdamW", "lr", lo=0, lo_open=True)
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise TypeError(f"AdamW: betas must be a pair of numbers in [0, 1), got {shown(betas)}")
        betas = tuple(real_arg(b, "AdamW", f"betas[{i}]", lo=0, hi=1, hi_open=True) for i, b in enumerate(betas))
        eps = real_arg(eps, "AdamW", "eps", lo=0, lo_open=True)
        weight_decay = real_arg(weight_decay, "AdamW", "weight_decay", lo=0)
        self.params = _pairs(params, "AdamW")
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.master = _masters(self.params)
        self.state = [(np.zeros_like(g), np.zeros_like(g)) for _, g in self.params]
        self.t = 0

    def step(self) -> None:
        self.t += 1
        for (p, g), (m, v), w in zip(self.params, self.state, self.master):
            _C.adamw_step(p if w is None else w, g, m, v, self.lr, self.betas[0], self.betas[1], self.eps,
                          self.weight_decay, self.t)
            if w is not None:
                p[...] = w  # rounded to nearest even


class SGD:
    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.0, weight_decay: float = 0.0):
        lr = real_arg(lr, "SGD", "lr", lo=0, lo_open=True)
        momentum = real_arg(momentum, "SGD", "momentum", lo=0)
        weight_decay = real_arg(weight_decay, "SGD", "weight_decay", lo=0)
        self.params = _pairs(params, "SGD")
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.master = _masters(self.params)
        self.bufs = [np.zeros_like(g) if momentum else None for _, g in self.params]
        self.t = 0

    def step(self) -> None:
        self.t += 1
        for (p, g), buf, w in zip(self.params, self.bufs, self.master):
            _C.sgd_step(p if w is None else w, g, buf, self.lr, self.momentum, self.weight_decay, self.t == 1)
            if w is not None:
                p[...] = w
