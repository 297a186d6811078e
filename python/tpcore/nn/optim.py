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

Parameters on a GPU (tpcore.DeviceArray pairs, what a device="cuda" layer or model
gives) are stepped there, their state and masters allocated there (the ``d_*`` kernels
of tpcore._C): nothing goes through the host.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from tpcore import _C
from tpcore.utils.args import real_arg, shown
from tpcore.utils.arrays import DeviceArray, check_host
from tpcore.utils.dtypes import FLOAT_FORMATS, HALF_FORMATS

if TYPE_CHECKING:
    from tpcore.distributed.comm import Comm

_LOWP = HALF_FORMATS  # 16-bit parameters: updated through a float32 master copy


def _dtype_name(a) -> str:
    return a.dtype if isinstance(a, DeviceArray) else a.dtype.name


def _device_pair(p, who, i):
    """A (param, grad) pair of DeviceArrays checked: one device, float32 grad of param's shape."""
    param, grad = p
    if not (isinstance(param, DeviceArray) and isinstance(grad, DeviceArray)):
        raise TypeError(f"{who}: param {i} is a {type(param).__name__} with a {type(grad).__name__} grad; a pair is "
                        f"two tpcore.DeviceArrays on one device or two NumPy arrays")
    if param.device != grad.device:
        raise ValueError(f"{who}: param {i} is on {param.device} but its grad on {grad.device}")
    if _dtype_name(param) not in FLOAT_FORMATS or grad.dtype != "float32" or grad.shape != param.shape:
        raise ValueError(f"{who}: param must be float32, bfloat16 or float16 with a float32 grad of its shape, got "
                         f"{param.dtype} {param.shape} and {grad.dtype} {grad.shape}")
    if param.readonly:
        raise ValueError(f"{who}: param {i} (shape {param.shape}) is read-only")
    return param, grad


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
        if isinstance(p, (tuple, list)) and len(p) == 2 and any(isinstance(a, DeviceArray) for a in p):
            out.append(_device_pair(p, who, len(out)))
            continue
        if isinstance(p, (tuple, list)) and len(p) == 2:
            for a, what in zip(p, ("param", "grad")):
                check_host(a, what, who)  # a tensor on a device: say so, not "not a NumPy array"
        if not (isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(a, np.ndarray) for a in p)):
            raise TypeError(f"{who}: params must be (param, grad) NumPy array pairs or modules, got {shown(p)}")
        param, grad = p
        if param.dtype.name not in FLOAT_FORMATS or grad.dtype != np.float32 or \
                grad.shape != param.shape:
            raise ValueError(f"{who}: param must be float32, bfloat16 or float16 with a float32 grad of its shape, "
                             f"got {param.dtype} {param.shape} and {grad.dtype} {grad.shape}")
        if not (param.flags.c_contiguous and grad.flags.c_contiguous and param.flags.writeable):
            raise ValueError(f"{who}: param {len(out)} (shape {param.shape}) and its grad must be C-contiguous and "
                             f"the param writable")
        out.append((param, grad))
    seen = {}
    for i, (param, _) in enumerate(out):
        at = param.data_ptr if isinstance(param, DeviceArray) else param.__array_interface__["data"][0]
        if param.size and at in seen:
            raise ValueError(f"{who}: params {seen[at]} and {i} are the same array; each parameter may be listed "
                             f"once (it would be updated twice per step)")
        seen[at] = i
    if not out:
        raise ValueError(f"{who}: params is empty; there is nothing to optimize")
    return out


def _zeros_like(g):
    """Float32 state shaped like the gradient g, on its device."""
    return DeviceArray(g.shape, "float32", device=g.device) if isinstance(g, DeviceArray) else np.zeros_like(g)


def _masters(params):
    """The float32 master copy of each 16-bit parameter (None for a float32 one), on its device."""
    out = []
    for p, g in params:
        if _dtype_name(p) == "float32":
            out.append(None)
        elif isinstance(p, DeviceArray):
            w = _zeros_like(g)
            _C.convert(p, None, w)
            out.append(w)
        else:
            out.append(np.ascontiguousarray(p, dtype=np.float32))
    return out


def _write_back(p, w):
    """The 16-bit parameter p = its master w rounded to nearest even."""
    if isinstance(p, DeviceArray):
        _C.convert(w, None, p)
    else:
        p[...] = w


def _adam_args(who, lr, betas, eps, weight_decay):
    """AdamW's hyper-parameters checked: (lr > 0, (beta1, beta2) in [0, 1), eps > 0, weight_decay >= 0)."""
    lr = real_arg(lr, who, "lr", lo=0, lo_open=True)
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise TypeError(f"{who}: betas must be a pair of numbers in [0, 1), got {shown(betas)}")
    betas = tuple(real_arg(b, who, f"betas[{i}]", lo=0, hi=1, hi_open=True) for i, b in enumerate(betas))
    return lr, betas, real_arg(eps, who, "eps", lo=0, lo_open=True), real_arg(weight_decay, who, "weight_decay", lo=0)


class AdamW:
    """AdamW over this rank's parameter shards (torch.optim.AdamW's formula), stepped in C.

    Parameters
    ----------
    params : list of (param, grad) pairs, or objects with ``parameters()``
        NumPy arrays (or DeviceArrays on a GPU) from the layers' / models' parameters()
        (views of their C memory: the step writes into the layer).  A bfloat16 / float16
        parameter gets a float32 master copy (see the module doc).
    lr : float, default 1e-3
        Learning rate, > 0.
    betas : (float, float), default (0.9, 0.999)
        The moments' decay rates, each in [0, 1).
    eps : float, default 1e-8
        > 0.
    weight_decay : float, default 0.01
        Decoupled weight decay, >= 0.

    Raises
    ------
    TypeError
        params not pairs or modules, a hyper-parameter not a number, betas not a pair.
    ValueError
        A hyper-parameter out of range, a parameter not float32 / bfloat16 / float16 or
        its gradient not float32 of its shape, an array listed twice, or no parameters.

    Notes
    -----
    No collective: data-parallel replicas average their gradients first
    (`tpcore.average_gradients`), or use `ShardedAdamW`.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        lr, betas, eps, weight_decay = _adam_args("AdamW", lr, betas, eps, weight_decay)
        self.params = _pairs(params, "AdamW")
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.master = _masters(self.params)
        self.state = [(_zeros_like(g), _zeros_like(g)) for _, g in self.params]
        self.t = 0

    def _state_arrays(self) -> list:
        """The arrays of state this optimizer holds (moments, master copies)."""
        return [a for m, v in self.state for a in (m, v)] + [w for w in self.master if w is not None]

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: both moments of every parameter (float32,
        its gradient's shape) and the float32 master copy of each 16-bit parameter."""
        return int(sum(a.nbytes for a in self._state_arrays()))

    def step(self) -> None:
        """Update every parameter from its gradient (one AdamW step; no collective)."""
        self.t += 1
        for (p, g), (m, v), w in zip(self.params, self.state, self.master):
            _C.adamw_step(p if w is None else w, g, m, v, self.lr, self.betas[0], self.betas[1], self.eps,
                          self.weight_decay, self.t)
            if w is not None:
                _write_back(p, w)


class SGD:
    """SGD with momentum over this rank's parameter shards (torch.optim.SGD's formula), in C.

    Parameters
    ----------
    params : list of (param, grad) pairs, or objects with ``parameters()``
        NumPy arrays (or DeviceArrays on a GPU) from the layers' / models' parameters()
        (views of their C memory: the step writes into the layer).  A bfloat16 / float16
        parameter gets a float32 master copy (see the module doc).
    lr : float, default 1e-2
        Learning rate, > 0.
    momentum : float, default 0.0
        >= 0 (0: plain SGD, no buffer).
    weight_decay : float, default 0.0
        L2 penalty added to the gradient, >= 0.

    Raises
    ------
    TypeError, ValueError
        As `AdamW`.

    Notes
    -----
    No collective.
    """

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        lr = real_arg(lr, "SGD", "lr", lo=0, lo_open=True)
        momentum = real_arg(momentum, "SGD", "momentum", lo=0)
        weight_decay = real_arg(weight_decay, "SGD", "weight_decay", lo=0)
        self.params = _pairs(params, "SGD")
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.master = _masters(self.params)
        self.bufs = [_zeros_like(g) if momentum else None for _, g in self.params]
        self.t = 0

    def _state_arrays(self) -> list:
        """The arrays of state this optimizer holds (momentum buffers, master copies)."""
        return [b for b in self.bufs if b is not None] + [w for w in self.master if w is not None]

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: the momentum buffers (with momentum > 0)
        and the float32 master copy of each 16-bit parameter."""
        return int(sum(a.nbytes for a in self._state_arrays()))

    def step(self) -> None:
        """Update every parameter from its gradient (one SGD step; no collective)."""
        self.t += 1
        for (p, g), buf, w in zip(self.params, self.bufs, self.master):
            _C.sgd_step(p if w is None else w, g, buf, self.lr, self.momentum, self.weight_decay, self.t == 1)
            if w is not None:
                _write_back(p, w)


class ShardedAdamW:
    """AdamW with its state sharded over a data-parallel group (ZeRO stage 1, as DeepSpeed's and
    PyTorch's ZeroRedundancyOptimizer): the replicas' parameters are seen as one flat vector, cut
    into comm.size consecutive slices (tpcore.partition); each rank keeps the float32 master and
    the two moments of its slice only (3 x 4 bytes per parameter / the group's size, against 12
    for AdamW, 16-bit parameters' masters included).  step() does the data-parallel gradient
    averaging itself: the gradients are packed and reduce-scattered (op "avg") so that each rank
    gets its slice's mean, steps that slice, and the slices are all-gathered back into every
    replica's parameters (2 x the parameter bytes moved per step, as one all-reduce does; do not
    also call average_gradients).  The result equals AdamW after average_gradients.  Host
    (NumPy) parameters.

    Parameters
    ----------
    params : list of (param, grad) pairs, or objects with ``parameters()``
        NumPy arrays (or DeviceArrays on a GPU) from the layers' / models' parameters()
        (views of their C memory: the step writes into the layer).  A bfloat16 / float16
        parameter gets a float32 master copy (see the module doc).
    comm : Comm
        The data-parallel group; every rank passes the same parameters' shapes in the same
        order (checked at construction).
    lr, betas, eps, weight_decay
        As `AdamW`.

    Raises
    ------
    TypeError
        comm not a Comm, parameters on a device, or as `AdamW`.
    ValueError
        The ranks' parameter shapes differ (on every rank), or as `AdamW`.

    Notes
    -----
    Collectives: construction: an all-gather of the shapes; step(): a reduce-scatter
    (op "avg") of the gradients and an all-gather of the updated slices.
    """

    def __init__(self, params: Any, comm: "Comm", lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        from tpcore.distributed.comm import Comm
        from tpcore.nn.partition import partition
        from tpcore.distributed.agree import agree
        if not isinstance(comm, Comm):
            raise TypeError(f"ShardedAdamW: comm must be a tpcore.Comm (the data-parallel group), got {shown(comm)}")
        lr, betas, eps, weight_decay = _adam_args("ShardedAdamW", lr, betas, eps, weight_decay)
        self.params = _pairs(params, "ShardedAdamW")
        for p, _ in self.params:
            if isinstance(p, DeviceArray):
                raise TypeError("ShardedAdamW: parameters on a device are not supported in this version (host "
                                "NumPy parameters only); use AdamW with average_gradients")
        self.comm = comm
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        shapes = np.array([d for p, _ in self.params for d in (p.ndim, *p.shape)], np.int64)
        agree(comm, "ShardedAdamW", [("the parameters' shapes differ", (shapes,), None)])
        self.numel = int(sum(p.size for p, _ in self.params))
        self.slices = partition(self.numel, comm.size)
        lo, n = self.slices[comm.rank]
        self.lo, self.n = lo, n
        flat = self._flat_params()
        self.master = np.ascontiguousarray(flat[lo:lo + n])  # float32, this rank's slice
        self.state = [(np.zeros(n, np.float32), np.zeros(n, np.float32))]
        self.t = 0

    def _flat_params(self) -> np.ndarray:
        return np.concatenate([np.asarray(p, np.float32).reshape(-1) for p, _ in self.params]) if self.params \
            else np.zeros(0, np.float32)

    def _state_arrays(self) -> list:
        """The arrays of state this optimizer holds (its master slice and moments)."""
        return [self.master] + [a for m, v in self.state for a in (m, v)]

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (master slice and moments)."""
        return int(sum(a.nbytes for a in self._state_arrays()))

    def step(self) -> None:
        """Average the gradients over comm, step this rank's slice, share the result.

        Notes
        -----
        Collective: a reduce-scatter (op "avg") and an all-gather over comm.
        """
        self.t += 1
        comm, sizes = self.comm, [s for _, s in self.slices]
        flat_g = np.concatenate([g.reshape(-1) for _, g in self.params])
        g = comm.reduce_scatter(flat_g, op="avg", sizes=sizes) if comm.size > 1 else flat_g
        m, v = self.state[0]
        if self.n:
            _C.adamw_step(self.master, np.ascontiguousarray(g, np.float32), m, v, self.lr, self.betas[0],
                          self.betas[1], self.eps, self.weight_decay, self.t)
        full = comm.all_gather(self.master, sizes=sizes) if comm.size > 1 else self.master
        at = 0
        for p, _ in self.params:
            p.reshape(-1)[...] = full[at:at + p.size]  # (a 16-bit parameter: rounded to nearest even)
            at += p.size
