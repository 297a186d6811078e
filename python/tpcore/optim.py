"""Optimizers over parameter shards: each rank updates the shard it holds, in C.

    opt = tpcore.optim.AdamW(model.parameters(), lr=1e-3)
    ...; model.backward(dy); opt.step(); model.zero_grad()

`params` is a list of (param, grad) NumPy float32 array pairs (layers'
.parameters() give views of their C memory), or objects with .parameters().
Replicated parameters (a row-parallel bias) get the same gradient on every
rank and so stay identical.  Formulas: torch.optim.AdamW and torch.optim.SGD.
"""
from __future__ import annotations

import numpy as np

from . import _C


def _pairs(params):
    out = []
    for p in params:
        if hasattr(p, "parameters"):
            out.extend(_pairs(p.parameters()))
        else:
            param, grad = p
            if not (isinstance(param, np.ndarray) and isinstance(grad, np.ndarray)):
                raise TypeError("optimizer: params must be (param, grad) NumPy array pairs or modules")
            if param.dtype != np.float32 or grad.shape != param.shape:
                raise ValueError(f"optimizer: param must be float32 with a grad of its shape, got "
                                 f"{param.dtype} {param.shape} and {grad.shape}")
            out.append((param, grad))
    return out


class AdamW:
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0 or weight_decay < 0:
            raise ValueError(f"AdamW: need lr > 0, 0 <= betas < 1, eps > 0, weight_decay >= 0; got lr={lr}, "
                             f"betas={betas}, eps={eps}, weight_decay={weight_decay}")
        self.params = _pairs(params)
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), tuple(map(float, betas)), float(eps), float(weight_decay)
        self.state = [(np.zeros_like(p), np.zeros_like(p)) for p, _ in self.params]
        self.t = 0

    def step(self) -> None:
        self.t += 1
        for (p, g), (m, v) in zip(self.params, self.state):
            _C.adamw_step(p, g, m, v, self.lr, self.betas[0], self.betas[1], self.eps, self.weight_decay, self.t)


class SGD:
    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.0, weight_decay: float = 0.0):
        if not lr > 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: need lr > 0, momentum >= 0, weight_decay >= 0; got {lr}, {momentum}, {weight_decay}")
        self.params = _pairs(params)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.bufs = [np.zeros_like(p) if momentum else None for p, _ in self.params]
        self.t = 0

    def step(self) -> None:
        self.t += 1
        for (p, g), buf in zip(self.params, self.bufs):
            _C.sgd_step(p, g, buf, self.lr, self.momentum, self.weight_decay, self.t == 1)
