"""Tensor-parallel layers (Megatron semantics) over the C core.

Weight convention is PyTorch's nn.Linear: W has shape (out_features,
in_features) and y = x @ W.T + b, for x of shape (..., in_features).

ColumnParallelLinear splits W along out: rank r holds rows [offset, offset +
local) of W and b; its output is its columns of y, or all of y with
gather_output=True.  Backward all-reduces the input gradient.
RowParallelLinear splits W along in: rank r holds columns [offset, offset +
local); the partial outputs are all-reduced and the bias is added once after
the reduce.  With input_is_parallel=True, x arrives as this rank's columns
(the output of a ColumnParallelLinear without gather); otherwise the rank cuts
its columns from the full x and backward all-gathers the input gradient.

All math and communication run in C (BLAS GEMMs, GIL released).  Parameters
live in C memory; .weight, .bias, .grad_weight, .grad_bias are NumPy views of
it (no copies).  Gradients are allocated on demand (the first backward, or
grad_weight / grad_bias / parameters() / zero_grad()): a layer used only for
inference never holds them.  Layers built with the same seed hold the same
logical weights at every world size and partition.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple, overload

import numpy as np

from tpcore import _C
from tpcore.utils.args import bool_arg, int_arg, seed_arg
from tpcore.utils.arrays import DeviceArray, asarray, check_on_device, device_string, from_dlpack, resolve_device
from tpcore.utils.dtypes import block_size, is_quantized, weight_format
from tpcore.distributed.comm import Comm
from tpcore.nn.common import (_back, as_float32, check_grad, dev_back, dev_f32, host_tensor, kept_output,
                              layer_memory, zero)
from tpcore.nn.partition import _even_blocks, _plan_sizes, check_partition, partition_sizes
from tpcore.nn.quant import QuantTensor
from tpcore.nn.weights import _host, _load_bias, _shard_float, _shard_host, is_lazy, load_weight


class _ParallelLinear:
    _kind = ""

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True,
                 gather_output: bool = False, input_is_parallel: bool = True, partition: Any = None,
                 dtype: Any = "float32", seed: int = 0, gated: bool = False, device: Optional[str] = None,
                 plan: Any = None) -> None:
        if not isinstance(comm, Comm):
            raise TypeError(f"{type(self).__name__}: comm must be a tpcore.Comm, got {type(comm).__name__}")
        self.dtype = weight_format(dtype, type(self).__name__)
        seed = seed_arg(seed, type(self).__name__)
        in_features = int_arg(in_features, type(self).__name__, "in_features", lo=1)
        out_features = int_arg(out_features, type(self).__name__, "out_features", lo=1)
        for name, v in (("bias", bias), ("gather_output", gather_output), ("input_is_parallel", input_is_parallel),
                        ("gated", gated)):
            bool_arg(v, type(self).__name__, name)
        split = out_features if self._kind == "column" else in_features
        partition = _plan_sizes(plan, comm, split, type(self).__name__, partition)
        sizes = partition_sizes(partition, split, comm.size,
                                "out_features" if self._kind == "column" else "in_features",
                                f"{type(self).__name__}: partition")
        blk = block_size(self.dtype)
        if sizes is None and self._kind == "row" and blk > 1 and split % blk == 0:
            sizes = [s for _, s in _even_blocks(split, comm.size, blk)]  # whole blocks per rank
        self.device = resolve_device(device, type(self).__name__)
        self.comm = comm
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.gated = bool(gated)
        kw = {} if self.device[0] == "cpu" else {"device": device_string(self.device)}
        self._c = _C.ParallelLinear(comm._c, self._kind, self.in_features, self.out_features, bool(bias),
                                    bool(gather_output), bool(input_is_parallel), sizes, seed, self.gated,
                                    weight_dtype=self.dtype, **kw)
        shard = self._c.shard
        self.offset, self.local = shard["offset"], shard["local"]
        self._x_cols, self._y_cols = shard["x_cols"], shard["y_cols"]
        self.partition = check_partition(comm, self.offset, self.local, split, type(self).__name__)

    @classmethod
    def _adopt(cls, cobj: Any, comm: Comm, in_features: int, out_features: int, gated: bool,
               device: Tuple[str, int] = ("cpu", 0)) -> Any:
        """A Python face for a C layer owned by another object (an MLP's fc1/fc2)."""
        self = cls.__new__(cls)
        self.device = device
        self.comm, self.in_features, self.out_features = comm, in_features, out_features
        self.gated, self._c = gated, cobj
        self.dtype = cobj.weight_dtype
        shard = cobj.shard
        self.offset, self.local = shard["offset"], shard["local"]
        self._x_cols, self._y_cols = shard["x_cols"], shard["y_cols"]
        split = out_features if cls._kind == "column" else in_features
        self.partition = check_partition(comm, self.offset, self.local, split, cls.__name__)
        return self

    # parameters: views of C memory
    @property
    def weight(self) -> np.ndarray:
        """This rank's shard of W: a view of C memory (writes go to the layer).

        ColumnParallelLinear: (local, in_features), (2 local, in_features) when gated
        ([gate rows; up rows]); RowParallelLinear: (out_features, local).  dtype: the
        layer's dtype.  A DeviceArray on a GPU layer."""
        return self._c.weight

    @property
    def bias(self) -> Optional[np.ndarray]:
        """This rank's bias (column: its local (or 2 local) entries; row: the full
        (out_features,)), float32; None without bias."""
        return self._c.bias

    @property
    def grad_weight(self) -> np.ndarray:
        """The gradient of `weight` accumulated by `backward` (float32, weight's shape); None for
        a quantized weight (frozen).  Gradients are allocated on demand: reading this (or
        `parameters`, `zero_grad`, the first `backward`) allocates them, zeroed; a layer used
        only forward holds none."""
        self._c.alloc_grads()
        return self._c.grad_weight

    def weight_float(self) -> np.ndarray:
        """This rank's shard of W as float32 (a copy; quantized rows dequantized)."""
        return _shard_float(self.weight, self.dtype, self._w_cols())

    def _w_cols(self) -> int:
        return self.in_features if self._kind == "column" else self.local

    @property
    def grad_bias(self) -> Optional[np.ndarray]:
        """The gradient of `bias` accumulated by `backward`; None without bias (allocated on
        demand, as `grad_weight`)."""
        self._c.alloc_grads()
        return self._c.grad_bias

    def parameters(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """This rank's (parameter, gradient) pairs, for the optimizers of `tpcore.optim`.

        The gradients are allocated (zeroed) here if no backward has yet.

        Returns
        -------
        list of (numpy.ndarray, numpy.ndarray)
            (weight, grad_weight) unless the weight is quantized (frozen), then (bias,
            grad_bias) when the layer has a bias.
        """
        self._c.alloc_grads()
        c = self._c
        pairs = [] if is_quantized(self.dtype) else [(c.weight, c.grad_weight)]
        if c.bias is not None:
            pairs.append((c.bias, c.grad_bias))
        return pairs

    def zero_grad(self) -> None:
        """Set grad_weight and grad_bias to zero (backward accumulates into them); allocates
        them if no backward has yet."""
        self._c.alloc_grads()
        for g in (self._c.grad_weight, self._c.grad_bias):
            if g is not None:
                zero(g)

    def _rows(self, x, name, cols):
        """x as float32 rows (M, cols), its leading shape, and the dtype to give the
        result back in (None for float32; float16/bfloat16 inputs get outputs of
        their own dtype, computed in float32)."""
        who = type(self).__name__
        src = x if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__") else host_tensor(x, name, who)
        x32 = as_float32(src, name, who)
        if x32.ndim < 1 or x32.shape[-1] != cols:
            raise ValueError(f"{who}: {name} must have shape (..., {cols}), got {x32.shape}")
        lead = x32.shape[:-1]
        if isinstance(src, DeviceArray):  # a bfloat16 tensor of another library: the result a bfloat16 DeviceArray
            return x32.reshape(math.prod(lead), cols), lead, "bfloat16"
        return x32.reshape(math.prod(lead), cols), lead, (None if src.dtype == np.float32 else src.dtype)

    def _device_rows(self, x, name, cols, who=None):
        """A GPU layer's input: any DLPack tensor on its device, viewed as (M, cols)."""
        who = who or type(self).__name__
        check_on_device(x, name, who, self.device)
        xa = from_dlpack(x)
        if xa.ndim < 1 or xa.shape[-1] != cols:
            raise ValueError(f"{who}: {name} must have shape (..., {cols}), got {xa.shape}")
        lead = xa.shape[:-1]
        return xa.reshape((math.prod(lead), cols)), lead

    @overload
    def forward(self, x: np.ndarray) -> np.ndarray: ...
    @overload
    def forward(self, x: Any) -> Any: ...
    def forward(self, x: Any) -> Any:
        """y = x @ W.T + b for this rank's part (also ``layer(x)``).

        Parameters
        ----------
        x : array_like, shape (..., x_cols)
            float32, bfloat16 or float16 (computed in float32; the output has x's dtype).
            x_cols: in_features, or this rank's `local` columns for a RowParallelLinear
            with input_is_parallel.  On a GPU layer: any DLPack tensor on its device.

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (..., y_cols)
            y_cols: this rank's `local` output columns (column-parallel without
            gather_output; (2 local) [gate | up] when gated) or out_features.  A
            DeviceArray on a GPU layer.

        Raises
        ------
        TypeError
            x is not a float array (or not on the layer's device).
        ValueError
            x's last dimension is not x_cols.
        CommError, CommTimeout
            The collective failed (a peer failed or disagreed, a timeout).

        Notes
        -----
        Collectives: ColumnParallelLinear: an all-gather of the outputs with
        gather_output, else none.  RowParallelLinear: an all-reduce of the partial outputs.
        """
        if self.device[0] != "cpu":  # 16-bit activations: converted on the GPU, the result back in theirs
            x2, lead = self._device_rows(x, "x", self._x_cols)
            x2, dt = dev_f32(x2)
            kept_output(self, None)
            y = self._c.forward(x2)
            kept_output(self, lead + (self._y_cols,))
            return dev_back(y, dt).reshape(lead + (self._y_cols,))
        x2, lead, dt = self._rows(x, "x", self._x_cols)
        kept_output(self, None)  # (a forward that fails in C keeps nothing: the C layer names it)
        y = self._c.forward(x2)
        kept_output(self, lead + (self._y_cols,))
        return _back(y.reshape(lead + (self._y_cols,)), dt)

    __call__ = forward

    @overload
    def backward(self, dy: np.ndarray) -> np.ndarray: ...
    @overload
    def backward(self, dy: Any) -> Any: ...
    def backward(self, dy: Any) -> Any:
        """The input gradient for the last forward; accumulates grad_weight / grad_bias.

        Parameters
        ----------
        dy : array_like, shape (..., y_cols)
            The gradient of forward's output: exactly its shape, a float dtype.

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (..., x_cols)
            The gradient of forward's input.

        Raises
        ------
        TypeError, ValueError
            As for `forward` (dy's dtype and layout); a ValueError naming both shapes when
            dy's shape is not the last forward's output's.
        RuntimeError
            No forward ran before.
        CommError, CommTimeout
            The collective failed.

        Notes
        -----
        Collectives: ColumnParallelLinear: an all-reduce of the input gradient (x is
        replicated); RowParallelLinear: none with input_is_parallel, else an all-gather of
        the input gradient.
        """
        if self.device[0] != "cpu":
            dy2, lead = self._device_rows(dy, "dy", self._y_cols)
            check_grad(self, lead + (self._y_cols,))
            dy2, dt = dev_f32(dy2)
            return dev_back(self._c.backward(dy2), dt).reshape(lead + (self._x_cols,))
        dy2, lead, dt = self._rows(dy, "dy", self._y_cols)
        check_grad(self, lead + (self._y_cols,))
        return _back(self._c.backward(dy2).reshape(lead + (self._x_cols,)), dt)

    def memory(self) -> Dict[str, Any]:
        """The bytes this rank's shard holds now, by kind.

        Returns
        -------
        dict
            "device" ("cpu" or "cuda:N": where the bytes live) and ints of bytes:
            "params" (the weight in its storage format and the bias), "grads" (gradient
            buffers that exist), "optimizer" (0: optimizers keep their own state),
            "kv_cache" and "kv_cache_used" (0), "workspace" (the saved input and scratch,
            grown to the largest batch seen), "comm" (collective buffers) and "total" (the
            sum of all but kv_cache_used).  Each tensor counts as the allocation it takes
            (rounded up to 64 bytes).
        """
        return layer_memory(self._c.memory())

    def __repr__(self) -> str:
        dt = "" if self.dtype == "float32" else f", dtype={self.dtype}"
        return (f"{type(self).__name__}({self.in_features}, {self.out_features}{dt}, rank {self.comm.rank} holds "
                f"{self.offset}:{self.offset + self.local})")


class ColumnParallelLinear(_ParallelLinear):
    """y = x @ W.T + b with W (out_features, in_features) split along out_features.

    Rank r holds rows [offset, offset + local) of W and of b (Megatron's column-parallel
    linear; W as PyTorch's nn.Linear).  x is replicated: every rank passes the full x.

    Parameters
    ----------
    in_features : int
        Columns of x and of the full W, >= 1.
    out_features : int
        Rows of the full W (columns of y), >= 1.
    comm : Comm
        The ranks that share the layer.
    bias : bool, default True
        Whether y has a bias b of shape (out_features,).
    gather_output : bool, default False
        False: forward returns this rank's `local` output columns (feed them to a
        RowParallelLinear with input_is_parallel=True, no communication between the two).
        True: forward all-gathers every rank's columns and returns all of y
        (..., out_features); backward then takes the full dy and uses its own columns.
    partition : list of int or list of (int, int), optional
        How out_features is split: one size per rank, or `tpcore.partition`'s (offset,
        size) pairs (offsets the running sums).  Default None: even (the first
        out_features % size ranks get one more row).  Uneven splits serve mismatched
        devices; a rank may hold 0 rows.
    dtype : str or dtype, default "float32"
        Storage of the weight: "float32", "bfloat16" or "float16" (or their NumPy /
        ml_dtypes / torch dtypes).  16-bit weights halve the bytes read per step; the
        arithmetic, activations, bias and gradients stay float32.
    seed : int, default 0
        The weights' random stream, an integer in [0, 2**64): W and b ~ U(-1/sqrt(in),
        1/sqrt(in)) drawn per element of the *full* tensor from (seed, tensor, index), so
        layers built with the same seed hold the same logical weights at every world size
        and partition (a 1-rank layer is the reference of an N-rank one).  `load_full`
        replaces them.
    device : str, optional
        "cpu" (default None) or "cuda" / "cuda:N": the parameters live on that GPU
        (DeviceArrays), and forward / backward take tensors on it.
    plan : Plan, optional
        A `tpcore.plan_partition` plan whose split of this dimension is used instead of
        partition (not both).
    gated : bool, default False
        For SwiGLU: the full weight is [W_gate; W_up] of shape (2 out_features,
        in_features) (bias (2 out_features,)); a rank holds its gate rows and its up rows
        and outputs [gate_r | up_r] (2 local columns) from one GEMM, for the activation
        that follows on this rank's columns.  Not with gather_output (ValueError).

    Attributes
    ----------
    offset, local : int
        This rank's rows of W: [offset, offset + local).
    partition : list of (int, int)
        Every rank's (offset, local).
    weight, bias, grad_weight, grad_bias
        This rank's shards (see the properties).

    Raises
    ------
    TypeError
        comm is not a Comm; a size, flag, seed, dtype or partition of the wrong type.
    ValueError
        A size < 1, a seed out of range, an unsupported dtype, gated with gather_output,
        a partition that does not add up to out_features or has the wrong length, or
        ranks that disagree on it.

    Notes
    -----
    Collectives: forward: an all-gather with gather_output, else none; backward: an
    all-reduce of the input gradient.  Construction runs a small all-gather that checks
    the ranks' partitions agree.  All math and communication run in C, GIL released.

    Examples
    --------
    >>> fc1 = tpcore.ColumnParallelLinear(512, 2048, comm)             # doctest: +SKIP
    >>> fc2 = tpcore.RowParallelLinear(2048, 512, comm)                # doctest: +SKIP
    >>> y = fc2(fc1(x))        # one all-reduce in forward              # doctest: +SKIP
    """

    _kind = "column"

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True,
                 gather_output: bool = False, partition: Any = None, dtype: Any = "float32", seed: int = 0,
                 gated: bool = False, device: Optional[str] = None, plan: Any = None) -> None:
        super().__init__(in_features, out_features, comm, bias=bias, gather_output=gather_output,
                         partition=partition, dtype=dtype, seed=seed, gated=gated, device=device, plan=plan)

    def _rows_of_full(self):
        lo, hi = self.offset, self.offset + self.local
        if not self.gated:
            return np.arange(lo, hi)
        return np.concatenate([np.arange(lo, hi), self.out_features + np.arange(lo, hi)])

    def load_full(self, W: Any, b: Any = None) -> None:
        """Keep this rank's rows of the full weight and bias (every rank passes them whole).

        Parameters
        ----------
        W : array_like, shape (out_features, in_features)
            (2 out_features, in_features) [W_gate; W_up] when gated; a float dtype,
            converted to the layer's dtype.
        b : array_like, shape (out_features,) or (2 out_features,), optional
            Required when the layer has a bias, refused when it has none.

        Raises
        ------
        ValueError
            A wrong shape, or b given / missing against the layer's bias.
        TypeError
            W or b is not a float array.

        Notes
        -----
        No collective.
        """
        W = W if isinstance(W, QuantTensor) or is_lazy(W) else asarray(W, "W", f"{type(self).__name__}.load_full")
        rows = (2 if self.gated else 1) * self.out_features
        if tuple(W.shape) != (rows, self.in_features):
            raise ValueError(f"load_full: W must have shape {(rows, self.in_features)}, got {tuple(W.shape)}")
        idx = self._rows_of_full()
        load_weight(self.weight, self.dtype, W, idx, None, "load_full")
        if b is not None or self.bias is not None:
            _load_bias(self, b, idx, rows)

    def gather_full(self) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """The full (W, b), rebuilt from every rank's shard.

        Returns
        -------
        W : numpy.ndarray, shape (out_features, in_features)
            (2 out_features, in_features) [W_gate; W_up] when gated; the layer's dtype.
        b : numpy.ndarray or None
            The full bias, or None.

        Notes
        -----
        Collective: all-gathers of W and b over comm (every rank gets the result).
        """
        g = 2 if self.gated else 1
        sizes = [g * s for _, s in self.partition]
        W = self.comm.all_gather(_shard_host(self.weight, self.dtype, self.in_features), sizes=sizes)
        b = None if self.bias is None else self.comm.all_gather(_host(self.bias), sizes=sizes)
        if self.gated:  # rank-major [gate_r; up_r] blocks -> [all gates; all ups]
            order = np.concatenate([np.arange(g * o, g * o + s) for o, s in self.partition] +
                                   [np.arange(g * o + s, g * o + 2 * s) for o, s in self.partition])
            W = W[order]
            b = None if b is None else b[order]
        return W, b


class RowParallelLinear(_ParallelLinear):
    """y = x @ W.T + b with W (out_features, in_features) split along in_features.

    Rank r holds columns [offset, offset + local) of W and the full b; the partial
    outputs x_r @ W_r.T are all-reduced and b is added once after the reduce, so every
    rank returns the full y (..., out_features).

    Parameters
    ----------
    in_features : int
        Columns of x and of the full W, >= 1.
    out_features : int
        Rows of the full W (columns of y), >= 1.
    comm : Comm
        The ranks that share the layer.
    bias : bool, default True
        Whether y has a bias b of shape (out_features,).
    input_is_parallel : bool, default True
        True: x arrives as this rank's `local` columns (..., local), the output of a
        ColumnParallelLinear without gather_output; backward returns the gradient of those
        columns (no communication).  False: every rank passes the full x (...,
        in_features) and cuts its own columns; backward all-gathers the input gradient so
        every rank gets the full one.
    partition : list of int or list of (int, int), optional
        How in_features is split (one size per rank or `tpcore.partition`'s pairs); must
        match the preceding ColumnParallelLinear's.  Default None: even.
    dtype : str or dtype, default "float32"
        Storage of the weight: "float32", "bfloat16" or "float16" (or their NumPy /
        ml_dtypes / torch dtypes).  16-bit weights halve the bytes read per step; the
        arithmetic, activations, bias and gradients stay float32.
    seed : int, default 0
        The weights' random stream, an integer in [0, 2**64): W and b ~ U(-1/sqrt(in),
        1/sqrt(in)) drawn per element of the *full* tensor from (seed, tensor, index), so
        layers built with the same seed hold the same logical weights at every world size
        and partition (a 1-rank layer is the reference of an N-rank one).  `load_full`
        replaces them.
    device : str, optional
        "cpu" (default None) or "cuda" / "cuda:N": the parameters live on that GPU
        (DeviceArrays), and forward / backward take tensors on it.
    plan : Plan, optional
        A `tpcore.plan_partition` plan whose split of this dimension is used instead of
        partition (not both).

    Attributes
    ----------
    offset, local : int
        This rank's columns of W: [offset, offset + local).
    partition : list of (int, int)
        Every rank's (offset, local).

    Raises
    ------
    TypeError, ValueError
        As for `ColumnParallelLinear` (partition must add up to in_features).

    Notes
    -----
    Collectives: forward: one all-reduce of the outputs; backward: none with
    input_is_parallel, else an all-gather of the input gradient.
    """

    _kind = "row"

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True,
                 input_is_parallel: bool = True, partition: Any = None, dtype: Any = "float32", seed: int = 0,
                 device: Optional[str] = None, plan: Any = None) -> None:
        super().__init__(in_features, out_features, comm, bias=bias, input_is_parallel=input_is_parallel,
                         partition=partition, dtype=dtype, seed=seed, device=device, plan=plan)

    def load_full(self, W: Any, b: Any = None) -> None:
        """Keep this rank's columns of the full W, and the full b.

        Parameters
        ----------
        W : array_like, shape (out_features, in_features)
            A float dtype, converted to the layer's dtype.
        b : array_like, shape (out_features,), optional
            Required when the layer has a bias, refused when it has none.

        Raises
        ------
        ValueError, TypeError
            As for `ColumnParallelLinear.load_full`.

        Notes
        -----
        No collective.
        """
        W = W if isinstance(W, QuantTensor) or is_lazy(W) else asarray(W, "W", f"{type(self).__name__}.load_full")
        if tuple(W.shape) != (self.out_features, self.in_features):
            raise ValueError(f"load_full: W must have shape {(self.out_features, self.in_features)}, got "
                             f"{tuple(W.shape)}")
        load_weight(self.weight, self.dtype, W, slice(None), slice(self.offset, self.offset + self.local), "load_full")
        if b is not None or self.bias is not None:
            _load_bias(self, b, slice(0, self.out_features), self.out_features)

    def gather_full(self) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """The full (W, b), rebuilt from every rank's shard.

        Returns
        -------
        W : numpy.ndarray, shape (out_features, in_features)
        b : numpy.ndarray, shape (out_features,), or None

        Notes
        -----
        Collective: an all-gather of W's columns over comm.
        """
        sizes = [s for _, s in self.partition]
        W = self.comm.all_gather(_shard_host(self.weight, self.dtype, self.local), axis=1, sizes=sizes)
        b = None if self.bias is None else _host(self.bias).copy()
        return W, b
