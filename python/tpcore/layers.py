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
from typing import Any, Dict, List, Optional, Sequence, Tuple, overload

import numpy as np

from . import _C
from ._args import bool_arg, int_arg, is_int, seed_arg, shown
from ._array import DeviceArray, as_array, asarray, check_on_device, device_string, from_dlpack, resolve_device
from .comm import Comm
from .quant import QUANT_FORMATS, QuantTensor, as_format, block_size, dequantize, is_quantized


def partition(n: int, world: int, weights: Optional[Sequence[float]] = None, align: int = 1) -> List[Tuple[int, int]]:
    """(offset, size) of each rank's slice of a dimension of length n.

    Parameters
    ----------
    n : int
        The dimension's length, >= 0; a multiple of align.
    world : int
        The number of ranks, >= 1.
    weights : sequence of float, optional
        One finite non-negative number per rank with a positive sum (e.g. measured device
        speeds or memory): slices proportional to them, for mismatched devices.  Default
        None: even (the first n % world ranks get one more unit).
    align : int, default 1
        Every slice is a whole number of align units (heads, GEMM-friendly multiples).

    Returns
    -------
    list of (int, int)
        (offset, size) per rank, in rank order; the sizes add up to n.  Pass it (or the
        sizes) as a layer's partition.

    Raises
    ------
    TypeError
        n, world or align not an int; weights not a sequence of numbers.
    ValueError
        n not a multiple of align, a bound out of range, or weights of the wrong length,
        negative, not finite or summing to 0.

    Notes
    -----
    No collective: a pure function (the C core's tp_partition), the same on every rank.
    """
    n = int_arg(n, "partition", "n", lo=0, hi=2**63 - 1)
    world = int_arg(world, "partition", "world", lo=1, hi=2**20)
    align = int_arg(align, "partition", "align", lo=1, hi=2**63 - 1)
    if n % align:
        raise ValueError(f"partition: n={n} is not a multiple of align={align}")
    if weights is not None:
        if isinstance(weights, (str, bytes)) or not hasattr(weights, "__iter__") or \
                not all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
                        for x in weights):
            raise TypeError(f"partition: weights must be a sequence of {world} numbers, got {shown(weights)}")
        w = [float(x) for x in weights]
        if len(w) != world or any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
            raise ValueError(f"partition: weights must be {world} finite non-negative numbers with a positive sum, "
                             f"got {list(weights)}")
    # the split itself is the C core's (tp_partition, include/tpcore/partition.h): one
    # implementation for the layers in C and for this function
    sizes = _C.partition(n, world, None if weights is None else w, align)
    out, off = [], 0
    for s in sizes:
        out.append((off, s))
        off += s
    return out


def check_partition(comm: Comm, offset: int, local: int, dim: int, who: str):
    """Every rank's (offset, size), gathered; raises on every rank (they all see the
    same data) unless the slices tile [0, dim) in rank order: ranks that were given
    different partitions would otherwise compute wrong results without an error."""
    part = comm.all_gather(np.array([[offset, local]], dtype=np.int64)).tolist()
    expect = 0
    for r, (o, s) in enumerate(part):
        if o != expect or s < 0:
            raise ValueError(f"{who}: the ranks disagree on the partition: rank {r} holds [{o}, {o + s}) but the "
                             f"slices before it end at {expect} (gathered: {part}); pass the same partition everywhere")
        expect = o + s
    if expect != dim:
        raise ValueError(f"{who}: the ranks' slices cover {expect} of {dim} (gathered: {part})")
    return part


def _even_blocks(n: int, world: int, blk: int) -> List[Tuple[int, int]]:
    """The even split of n in whole blocks of blk (a quantized row-parallel weight's default)."""
    return partition(n, world, align=blk)


def _is_half(dt: np.dtype) -> bool:
    return dt == np.float16 or dt.name == "bfloat16"


PARAM_DTYPES = ("float32", "bfloat16", "float16")
# quantized weight formats (tpcore.quant): frozen weights kept in llama.cpp's block formats
WEIGHT_DTYPES = PARAM_DTYPES + QUANT_FORMATS


def check_param_dtype(dtype, who: str, quantized: bool = True) -> str:
    """The weight storage dtype a layer was given, by name: "float32" (default), "bfloat16" or
    "float16" (a string, a NumPy / ml_dtypes dtype or a torch dtype), or (quantized) one of
    tpcore.quant's formats ("int8", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k").
    Low-precision weights keep float32 arithmetic, activations, biases and gradients (see the
    module doc); quantized ones are frozen."""
    if dtype is None:
        return "float32"
    allowed = WEIGHT_DTYPES if quantized else PARAM_DTYPES
    if isinstance(dtype, str) and dtype.lower() in QUANT_FORMATS:
        if not quantized:
            raise ValueError(f"{who}: dtype {dtype} (a quantized format) is not supported here; expected one of "
                             f"{', '.join(PARAM_DTYPES)}")
        return dtype.lower()
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if name is None:
        text = str(dtype)  # torch.bfloat16 -> "torch.bfloat16"
        name = text.rsplit(".", 1)[-1] if text.startswith("torch.") else None
    if name is None:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            raise TypeError(f"{who}: dtype must be one of {', '.join(allowed)}, got {shown(dtype)}") from None
    if name not in PARAM_DTYPES:
        raise ValueError(f"{who}: dtype {name} is not supported for parameters; expected one of "
                         f"{', '.join(allowed)} (weights in that dtype, float32 arithmetic)")
    return name


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


def float_param(a, who: str) -> np.ndarray:
    """A full tensor handed to load_full: any float dtype (float16 / bfloat16 from
    checkpoints included); it is converted to float32 on assignment."""
    a = np.asarray(a)
    if a.dtype.kind != "f" and not _is_half(a.dtype):
        raise TypeError(f"{who}: expected a floating-point array, got {a.dtype}")
    return a


def _sizes(part, dim, world, what, who="partition"):
    """Each rank's size from a partition given as sizes or as tpcore.partition()'s (offset, size)
    pairs (whose offsets must then be the running sums of the sizes)."""
    if part is None:
        return None
    want = f"{who} must be a list of {world} sizes (one per rank) or tpcore.partition()'s (offset, size) pairs"
    if isinstance(part, (str, bytes, dict)) or not hasattr(part, "__iter__"):
        raise TypeError(f"{want}, got {shown(part)}")
    part = list(part)
    pairs = bool(part) and all(isinstance(p, (tuple, list)) for p in part)
    if pairs and not all(len(p) == 2 for p in part) or not pairs and any(isinstance(p, (tuple, list)) for p in part):
        raise TypeError(f"{want}, got {shown(part)}")
    flat = [x for p in part for x in p] if pairs else part
    if not all(is_int(x) for x in flat):
        raise TypeError(f"{want}, got {shown(part)}")
    sizes = [int(p[1]) for p in part] if pairs else [int(p) for p in part]
    if len(sizes) != world:
        raise ValueError(f"{who} has {len(sizes)} entries, expected one per rank ({world})")
    if any(s < 0 for s in sizes) or sum(sizes) != dim:
        raise ValueError(f"{who} {sizes} must be non-negative and sum to {what}={dim} (sums to {sum(sizes)})")
    if pairs:
        offsets = [int(p[0]) for p in part]
        expect = [sum(sizes[:r]) for r in range(world)]
        if offsets != expect:
            raise ValueError(f"{who}: the (offset, size) pairs {[tuple(p) for p in part]} do not tile [0, {dim}) in "
                             f"rank order (offsets {offsets}, expected {expect})")
    return sizes


def _plan_sizes(plan, comm: Comm, n: int, who: str, partition, prefer: str = "ffn"):
    """partition, or the split of the dimension of length n in plan (a tpcore.Plan; not both)."""
    if plan is None:
        return partition
    from .planner import plan_arg
    return plan_arg(plan, comm, who, partition=partition).sizes_for(n, who, prefer)


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
    if xa.dtype not in ("bfloat16", "float16"):
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



class _ParallelLinear:
    _kind = ""

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True,
                 gather_output: bool = False, input_is_parallel: bool = True, partition: Any = None,
                 dtype: Any = "float32", seed: int = 0, gated: bool = False, device: Optional[str] = None,
                 plan: Any = None) -> None:
        if not isinstance(comm, Comm):
            raise TypeError(f"{type(self).__name__}: comm must be a tpcore.Comm, got {type(comm).__name__}")
        self.dtype = check_param_dtype(dtype, type(self).__name__)
        seed = seed_arg(seed, type(self).__name__)
        in_features = int_arg(in_features, type(self).__name__, "in_features", lo=1)
        out_features = int_arg(out_features, type(self).__name__, "out_features", lo=1)
        for name, v in (("bias", bias), ("gather_output", gather_output), ("input_is_parallel", input_is_parallel),
                        ("gated", gated)):
            bool_arg(v, type(self).__name__, name)
        split = out_features if self._kind == "column" else in_features
        partition = _plan_sizes(plan, comm, split, type(self).__name__, partition)
        sizes = _sizes(partition, split, comm.size, "out_features" if self._kind == "column" else "in_features",
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
        self.comm, self.in_features, self.out_features, self.gated, self._c = comm, in_features, out_features, gated, cobj
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
            return dev_back(self._c.forward(x2), dt).reshape(lead + (self._y_cols,))
        x2, lead, dt = self._rows(x, "x", self._x_cols)
        return _back(self._c.forward(x2).reshape(lead + (self._y_cols,)), dt)

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
            The gradient of forward's output (its shape and a float dtype).

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (..., x_cols)
            The gradient of forward's input.

        Raises
        ------
        TypeError, ValueError
            As for `forward` (dy's dtype and shape).
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
            dy2, dt = dev_f32(dy2)
            return dev_back(self._c.backward(dy2), dt).reshape(lead + (self._x_cols,))
        dy2, lead, dt = self._rows(dy, "dy", self._y_cols)
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


def _host(a) -> np.ndarray:
    """A parameter as a host array (a GPU layer's parameters are DeviceArrays: copied)."""
    return a.to_numpy() if isinstance(a, DeviceArray) else np.ascontiguousarray(a)


def _shard_host(w, dtype: str, cols: int) -> np.ndarray:
    """A weight shard on the host for gathering: its own dtype, float32 when quantized (raw
    rows of different ranks cannot be joined along the columns)."""
    return _shard_float(w, dtype, cols) if is_quantized(dtype) else _host(w)


def _shard_float(w, dtype: str, cols: int) -> np.ndarray:
    """A weight shard as float32 on the host (quantized rows dequantized)."""
    h = _host(w)
    if is_quantized(dtype):
        return dequantize(h, dtype, cols) if h.shape[0] else np.zeros((0, cols), np.float32)
    return np.asarray(h, np.float32)


def _put_weight(dst, dtype: str, src, who: str) -> None:
    """dst (a layer's weight shard, or rows of it) = src: float values converted, or for a
    quantized dst its raw rows (a QuantTensor of the same format copied as it is, anything
    else quantized from its float values)."""
    if is_quantized(dtype):
        if src.shape[0]:  # (a shard of no rows: nothing to copy; a DeviceArray cannot take itself)
            dst[...] = as_format(src, dtype, who)
        return
    dst[...] = float_param(src, who)


def is_lazy(x) -> bool:
    """A checkpoint's tensor read on indexing (tpcore._stream.FileTensor, hf.View, ...):
    load_full streams its slices (load_weight) instead of reading it whole."""
    return hasattr(x, "_read_into") and hasattr(x, "shape")


def load_weight(dst, dtype: str, src, rows, cols, who: str, at: int = 0) -> None:
    """dst (a weight shard: a host array, a DeviceArray, or rows of them) = src[rows, cols]
    (cols None: src[rows]), streamed through the load's staging buffer (tpcore._stream.fill):
    float values converted chunk by chunk, a quantized dst's raw rows copied (a QuantTensor
    source of its format) or quantized by whole rows.  A GPU dst is filled on the host
    chunk by chunk, each chunk copied to its rows of the device (from row `at`)."""
    from ._stream import fill
    if isinstance(src, QuantTensor) or not hasattr(src, "shape") or len(tuple(src.shape)) != 2:
        if at or (isinstance(dst, DeviceArray) and tuple(dst.shape)[:1] != (np.arange(src.shape[0])[rows].size,)):
            raise ValueError(f"{who}: rows of a device weight are filled from a 2-D checkpoint tensor only")
        _put_weight(dst, dtype, src[rows] if cols is None else src[rows, cols], who)
        return
    if is_quantized(dtype) and not (dst.shape[0] if hasattr(dst, "shape") else 1):
        return  # (a shard of no rows: nothing to copy)
    fill(dst, src, rows, cols, dtype, who, _put_weight, at=at)


def _load_bias(layer, b, sel, n):
    if layer.bias is None:
        raise ValueError("load_full: this layer has no bias, but b was given")
    if b is None:
        raise ValueError("load_full: this layer has a bias; pass b")
    b = b if is_lazy(b) else asarray(b, "b", f"{type(layer).__name__}.load_full")
    if b.shape != (n,):
        raise ValueError(f"load_full: b must have shape {(n,)}, got {b.shape}")
    layer.bias[...] = float_param(b[sel], "load_full")


ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "swiglu")


class ParallelMLP:
    """Transformer MLP y = fc2(act(fc1(x))) split over ranks (Megatron).

    fc1 is column-parallel (without gather), the activation runs on this rank's columns,
    fc2 is row-parallel with input_is_parallel.  activation="swiglu" makes fc1 gated:
    [gate; up] of shape (2 ffn_hidden, hidden), both projections of a rank in one GEMM,
    and y = fc2(silu(gate) * up).  The whole step is one C call each way
    (csrc/layers/mlp.c), with its workspaces reused across steps; `fc1` and `fc2` are
    views of its layers (weights, grads, load_full, gather_full).

    Parameters
    ----------
    hidden : int
        The model width (x's and y's last dimension), >= 1.
    ffn_hidden : int
        The inner width, split over the ranks, >= 1.
    comm : Comm
        The ranks that share the MLP.
    activation : {"gelu", "gelu_tanh", "silu", "relu", "swiglu"}, default "gelu"
        "gelu" is the exact (erf) GELU, "gelu_tanh" its tanh approximation (GPT-2).
    bias : bool, default True
        Biases on fc1 and fc2.
    partition : list of int or list of (int, int), optional
        How ffn_hidden is split (one size per rank or `tpcore.partition`'s pairs).
        Default None: even.
    dtype : str or dtype, default "float32"
        Weight storage: "float32", "bfloat16" or "float16" (float32 arithmetic).
    seed : int, default 0
        As `ColumnParallelLinear`'s: the same logical weights at every world size.
    device : str, optional
        "cpu" (default) or "cuda[:N]".
    plan : Plan, optional
        A `tpcore.plan_partition` plan whose MLP columns split ffn_hidden (instead of
        partition).

    Attributes
    ----------
    fc1 : ColumnParallelLinear
        (hidden -> ffn_hidden; gated for swiglu).
    fc2 : RowParallelLinear
        (ffn_hidden -> hidden, input_is_parallel).

    Raises
    ------
    TypeError
        comm not a Comm, activation not a string, an argument of the wrong type.
    ValueError
        An unknown activation or dtype, a size < 1, a partition that does not add up.

    Notes
    -----
    Collectives: exactly one all-reduce in forward (after fc2) and one in backward (fc1's
    input gradient).
    """

    def __init__(self, hidden: int, ffn_hidden: int, comm: Comm, activation: str = "gelu", bias: bool = True,
                 partition: Any = None, dtype: Any = "float32", seed: int = 0, device: Optional[str] = None,
                 plan: Any = None) -> None:
        self.device = resolve_device(device, "ParallelMLP")
        if not isinstance(activation, str) or activation not in ACTIVATIONS:
            raise (ValueError if isinstance(activation, str) else TypeError)(
                f"ParallelMLP: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {shown(activation)}")
        if not isinstance(comm, Comm):
            raise TypeError(f"ParallelMLP: comm must be a tpcore.Comm, got {type(comm).__name__}")
        self.dtype = check_param_dtype(dtype, "ParallelMLP")
        bool_arg(bias, "ParallelMLP", "bias")
        seed = seed_arg(seed, "ParallelMLP")
        hidden = int_arg(hidden, "ParallelMLP", "hidden", lo=1)
        ffn_hidden = int_arg(ffn_hidden, "ParallelMLP", "ffn_hidden", lo=1)
        partition = _plan_sizes(plan, comm, ffn_hidden, "ParallelMLP", partition)
        sizes = _sizes(partition, ffn_hidden, comm.size, "ffn_hidden", "ParallelMLP: partition")
        self.activation, self.comm, self.hidden = activation, comm, int(hidden)
        kw = {} if self.device[0] == "cpu" else {"device": device_string(self.device)}
        self._c = _C.ParallelMLP(comm._c, int(hidden), int(ffn_hidden), activation, bool(bias), sizes, seed,
                                 weight_dtype=self.dtype, **kw)
        self.fc1: ColumnParallelLinear = ColumnParallelLinear._adopt(self._c.fc1, comm, int(hidden), int(ffn_hidden),
                                                                     activation == "swiglu", self.device)
        self.fc2: RowParallelLinear = RowParallelLinear._adopt(self._c.fc2, comm, int(ffn_hidden), int(hidden), False,
                                                               self.device)

    def parameters(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """This rank's (parameter, gradient) pairs: fc1's, then fc2's (see
        `ColumnParallelLinear.parameters`)."""
        return self.fc1.parameters() + self.fc2.parameters()

    def zero_grad(self) -> None:
        """Set every gradient of fc1 and fc2 to zero."""
        self.fc1.zero_grad()
        self.fc2.zero_grad()

    def memory(self) -> Dict[str, Any]:
        """The bytes this rank's part holds now: fc1's and fc2's (see
        `ColumnParallelLinear.memory`) plus the activation workspace (fc1's output, the
        activation and their gradients for the largest batch seen).

        Returns
        -------
        dict
            The keys of `ColumnParallelLinear.memory`.
        """
        return layer_memory(self._c.memory())

    @overload
    def forward(self, x: np.ndarray) -> np.ndarray: ...
    @overload
    def forward(self, x: Any) -> Any: ...
    def forward(self, x: Any) -> Any:
        """y = fc2(act(fc1(x))) (also ``mlp(x)``).

        Parameters
        ----------
        x : array_like, shape (..., hidden)
            The full input on every rank; float32, bfloat16 or float16 (output in x's
            dtype).  On a GPU MLP: any DLPack tensor on its device.

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (..., hidden)
            The full output, the same on every rank.

        Raises
        ------
        TypeError, ValueError
            x of a wrong dtype, device or last dimension.
        CommError, CommTimeout
            The all-reduce failed.

        Notes
        -----
        Collective: one all-reduce over comm.
        """
        if self.device[0] != "cpu":
            x2, lead = self.fc1._device_rows(x, "x", self.hidden, "ParallelMLP")
            x2, dt = dev_f32(x2)
            return dev_back(self._c.forward(x2), dt).reshape(lead + (self.hidden,))
        x2, lead, dt = self.fc1._rows(x, "x", self.hidden)
        return _back(self._c.forward(x2).reshape(lead + (self.hidden,)), dt)

    __call__ = forward

    @overload
    def backward(self, dy: np.ndarray) -> np.ndarray: ...
    @overload
    def backward(self, dy: Any) -> Any: ...
    def backward(self, dy: Any) -> Any:
        """The input gradient for the last forward; accumulates every weight's gradient.

        Parameters
        ----------
        dy : array_like, shape (..., hidden)
            The gradient of forward's output (the same on every rank).

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (..., hidden)
            The gradient of x, the same on every rank.

        Notes
        -----
        Collective: one all-reduce over comm (fc1's input gradient).
        """
        if self.device[0] != "cpu":
            dy2, lead = self.fc2._device_rows(dy, "dy", self.hidden, "ParallelMLP")
            dy2, dt = dev_f32(dy2)
            return dev_back(self._c.backward(dy2), dt).reshape(lead + (self.hidden,))
        dy2, lead, dt = self.fc2._rows(dy, "dy", self.hidden)
        return _back(self._c.backward(dy2).reshape(lead + (self.hidden,)), dt)
