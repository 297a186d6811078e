"""PyTorch modules over tpcore's C layers: ``import tpcore.torch``.

``ColumnParallelLinear``, ``RowParallelLinear``, ``ParallelMLP``, ``VocabParallelEmbedding``,
``VocabParallelCrossEntropy`` (and the function ``vocab_parallel_cross_entropy``),
``TransformerBlock`` and ``ParallelAttention`` are ``torch.nn.Module``s.  Each wraps the tpcore
layer of the same name (``module.layer``); its forward and backward are one call each into the C layer (GIL released)
through a ``torch.autograd.Function``.  PyTorch is optional: ``import tpcore`` never imports it,
and this module raises ImportError saying how to install it when it is missing.

Memory.  Parameters are ``nn.Parameter``s viewing the C layer's weight and bias buffers (this
rank's shard): a torch optimizer updating them in place (SGD, Adam, AdamW ...) updates the C
layer; replacing one's ``.data`` or assigning another Parameter (weight tying) would part it from
the C layer, and the next forward raises RuntimeError.  Activations cross without copies: a
float32 C-contiguous CPU tensor is handed to C as a NumPy view of its memory, and the C result
comes back as a tensor over the NumPy array (``torch.from_numpy``).  A float16 / bfloat16 input is converted to float32 (the C layers compute
in float32) and the output given back in the input's dtype; a non-contiguous one is made
contiguous (a copy).  Gradients reach ``param.grad`` with torch's semantics (a second backward
adds; ``requires_grad=False`` parameters get none); the C layer's own gradient buffers are
scratch (zeroed before each backward, copied out after).

State.  A C layer keeps what its backward needs from its last forward.  Each module counts its
forwards; the autograd node of a forward saves its inputs (``save_for_backward``) and, when the
layer has run another forward since (a module called twice before backward, activation
recomputation, ``retain_graph``), replays its own forward before the backward.  Every rank makes
the same decision in the same program order, so the collectives stay matched.  Inputs modified in
place before backward are detected by torch (saved-tensor version check), as for nn.Linear.

Collectives.  Forward and backward run the layer's collectives: call the modules on every rank of
the communicator, in the same order (torch's autograd engine runs the backward in a deterministic
order for the same graph).

State dicts.  ``module.state_dict()`` returns the FULL, unsharded tensors (a collective: call it on
every rank; every rank gets them), with the names of the equivalent single-process torch module
(``weight``/``bias`` as nn.Linear and nn.Embedding; ``fc1.*``/``fc2.*`` for the MLP; the block's
names are TransformerBlock.load_full's, e.g. ``attn.q.weight``).  ``load_state_dict`` takes full
tensors and keeps this rank's slice of them, so a state dict saved at one world size or partition
loads at another.  Both work nested in any model.  ``sharded_state_dict(model)`` and
``load_sharded_state_dict(model, sd)`` give and take only this rank's shards (no communication),
plus a ``<prefix>_tp_shard`` int64 tensor per module recording the world size, rank and partition:
a shard loads only into a module of the same layout (else a clear error; use the full form to
reshard).

Devices.  ``device=None``/``"cpu"`` (default) or ``"cuda"``/``"cuda:N"`` (a tpcore build with CUDA):
the parameters are then torch CUDA tensors viewing the C layer's device memory (through DLPack),
and inputs must be CUDA tensors on that device.  A tensor on another device than the module is a
TypeError naming the module, the argument and both devices.
"""
from __future__ import annotations

try:
    import torch
except ImportError as _e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("tpcore.torch needs PyTorch, an optional dependency of tpcore that is not installed here: "
                      "pip install 'torch>=2.1' (or pip install 'tpcore[test]'); the rest of tpcore works without "
                      "it") from _e
if not hasattr(torch, "autograd"):  # python/tpcore itself on sys.path: "import torch" found this file
    raise ImportError(f"tpcore.torch: 'import torch' found {getattr(torch, '__file__', '?')}, not PyTorch; the folder "
                      f"python/tpcore must not be on sys.path (run from another directory, or use python -m)")

import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, cast

import numpy as np

from tpcore.nn import config as _config
from tpcore.nn import linear as _linear
from tpcore.nn import mlp as _mlp
from tpcore.nn import transformer as _transformer
from tpcore.nn import vocab as _vocab
from tpcore.utils.arrays import DeviceArray
from tpcore.utils.dtypes import weight_format
from tpcore.distributed.comm import Comm

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "VocabParallelEmbedding",
           "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy", "TransformerBlock", "ParallelAttention",
           "sharded_state_dict", "load_sharded_state_dict"]

_SHARD_KEY = "_tp_shard"
_SHARD_FORMAT = 1


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


class _Holder(torch.nn.Module):
    """A container of some of a parent module's parameters (fc1 and fc2 of an MLP, norm1 or
    attn.qkv of a block), so that named_parameters() reads as in torch.  The parent saves and
    loads them: the holder itself adds nothing to a state dict and has no forward."""

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        pass

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        pass


def _tracing() -> bool:
    """Whether torch.jit.trace is recording."""
    return bool(torch.jit.is_tracing())  # type: ignore[attr-defined,no-untyped-call]


# ------------------------------------------------------------------ the autograd node
def _first_order(mod: Any) -> None:
    """Refuse a backward with create_graph=True: the C backward is not differentiable, so its
    results would silently carry no second-order terms."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{mod._who}: double backward (create_graph=True, e.g. a gradient penalty) is not "
                           f"supported: the C layer's backward is not itself differentiable")


class _Apply(torch.autograd.Function):
    """y = mod's C forward of inputs; backward: the C backward (its collectives), the input
    gradient and a copy of each parameter's gradient.  The parameters are inputs so torch
    routes their gradients and checks that they were not changed in place before backward."""

    @staticmethod
    def forward(ctx: Any, mod: Any, n_in: int, *args: Any) -> torch.Tensor:
        inputs, params = args[:n_in], args[n_in:]
        y = mod._c_forward(*inputs)
        ctx.mod, ctx.n_in, ctx.gen = mod, n_in, mod._tp_gen
        ctx.save_for_backward(*inputs, *params)
        return cast(torch.Tensor, y)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        mod = ctx.mod
        _first_order(mod)
        saved = ctx.saved_tensors  # torch raises here if one was modified in place since forward
        inputs, params = saved[:ctx.n_in], saved[ctx.n_in:]
        if mod._tp_gen != ctx.gen:  # another forward (or a backward) ran since: replay this one
            mod._c_forward(*inputs)
        mod.layer.zero_grad()
        dx = mod._c_backward(dy)
        mod._tp_gen += 1  # a backward may reuse the kept activations: the next one replays
        grads = []
        for i, (p, g) in enumerate(zip(params, mod._tp_grads())):
            grads.append(_wrap(g).clone().to(p.dtype) if ctx.needs_input_grad[2 + ctx.n_in + i] else None)
        in_grads = [None] * ctx.n_in
        if dx is not None and ctx.needs_input_grad[2]:
            in_grads[0] = dx
        return (None, None, *in_grads, *grads)


# ------------------------------------------------------------------ the base module
class _TPModule(torch.nn.Module):
    """What every module here shares: parameters over C memory, the forward counter, the
    full and sharded state dicts, and the refusal of .to() conversions that would part the
    parameters from the C layer."""

    _who = ""

    def _tp_init(self, layer: Any, device: Tuple[str, int]) -> None:
        self.layer = layer
        self.device_ = device
        self._tp_gen = 0
        self._tp_sharded = False
        self._tp_views: List[Tuple[torch.nn.Module, str, int]] = []  # (owner, name, C address): _check_views

    def _adopt_param(self, owner: torch.nn.Module, name: str, view: Any) -> torch.nn.Parameter:
        """An nn.Parameter over the C buffer `view` (no copy), registered as owner.name."""
        t = _wrap(view)
        p = torch.nn.Parameter(t, requires_grad=True)
        assert p.data_ptr() == t.data_ptr()
        owner.register_parameter(name, p)
        self._tp_views.append((owner, name, p.data_ptr()))
        return p

    def _check_views(self) -> None:
        """A RuntimeError unless every parameter still views its C buffer: one whose .data was
        replaced (param.data = ..., torch.nn.utils.vector_to_parameters) or a Parameter assigned
        in its place would be trained as a copy the C layer never sees."""
        for owner, name, ptr in self._tp_views:
            p = owner._parameters.get(name)
            if p is None or p.data_ptr() != ptr:
                where = next(k for k, mod in self.named_modules() if mod is owner)
                full = f"{where}.{name}" if where else name
                raise RuntimeError(f"{self._who}: parameter {full} no longer views the C layer's memory (its .data "
                                   f"was replaced, e.g. by torch.nn.utils.vector_to_parameters or `param.data = ...`, "
                                   f"or another Parameter was assigned), so the C layer would not see it; write "
                                   f"values in place instead (with torch.no_grad(): param.copy_(...)) or use "
                                   f"load_state_dict")

    # the order of the parameters handed to _Apply, and their C gradient buffers
    def _tp_params(self) -> List[torch.nn.Parameter]:
        raise NotImplementedError

    def _tp_grads(self) -> List[Any]:
        raise NotImplementedError

    def _c_forward(self, *args: Any, **kw: Any) -> torch.Tensor:
        """The C layer's forward of the inputs (counted: _tp_gen)."""
        raise NotImplementedError

    def _run(self, *inputs: torch.Tensor) -> torch.Tensor:
        """inputs through the C layer: with autograd when a gradient is wanted (or under
        torch.jit.trace, which records the Function as a call; a direct result would be recorded
        as a constant), else directly."""
        self._check_views()
        params = self._tp_params()
        if _tracing() or torch.is_grad_enabled() and (
                any(t.requires_grad for t in inputs if t.is_floating_point()) or any(p.requires_grad for p in params)):
            y = _Apply.apply(self, len(inputs), *inputs, *params)  # type: ignore[no-untyped-call]
            return cast(torch.Tensor, y)
        return self._c_forward(*inputs, need_backward=False)

    def _apply(self, fn: Any, recurse: bool = True) -> "_TPModule":
        """Refuse .to(dtype/device), .half(), .cuda(), share_memory() ... that would replace the
        parameters by copies or move their storage: they must stay views of the C layer's
        memory.  fn is tried on a one-element stand-in of each parameter, never on the
        parameter itself, because an in-place fn (share_memory_) would already have moved it."""
        for name, p in self.named_parameters():
            probe = torch.empty((1,), dtype=p.dtype, device=p.device)
            ptr = probe.data_ptr()
            q = fn(probe)
            if q.data_ptr() != ptr or probe.data_ptr() != ptr or q.dtype != p.dtype or q.device != p.device:
                raise TypeError(f"{self._who}: its parameters live in the C layer's memory ({p.dtype} on "
                                f"{_dev_text(p)}) and cannot be moved or converted ({name} would become {q.dtype} "
                                f"on {_dev_text(q)} in other memory); build the module with device=... and "
                                f"dtype=... instead")
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        """pickle, copy.copy and copy.deepcopy: refused by name (the C layer, its communicator
        and the parameters over its memory cannot travel or be duplicated)."""
        raise TypeError(f"{self._who} cannot be pickled or copied: its parameters are views of a C layer bound to "
                        f"this process's communicator; save model.state_dict() (full tensors, loads at any world "
                        f"size) or tpcore.torch.sharded_state_dict(model), and build a new module to load it into")

    def __prepare_scriptable__(self) -> Any:
        """torch.jit.script calls this first: refused by name (forward calls into C)."""
        raise TypeError(f"{self._who}: torch.jit.script cannot compile a forward that calls a C layer; use "
                        f"torch.compile or torch.jit.trace (which records the call), or run it eagerly")

    # ---- state dicts
    def _tp_full(self) -> Dict[str, np.ndarray]:
        raise NotImplementedError

    def _tp_full_shapes(self) -> Dict[str, Tuple[int, ...]]:
        raise NotImplementedError

    def _tp_load_full(self, tensors: Dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def _tp_local(self) -> Dict[str, torch.nn.Parameter]:
        return dict(self.named_parameters())

    def _tp_layout(self) -> List[int]:
        """The partition as integers (a sharded state dict records it)."""
        raise NotImplementedError

    def _tp_meta(self) -> torch.Tensor:
        comm = self.layer.comm
        return torch.tensor([_SHARD_FORMAT, comm.size, comm.rank] + [int(v) for v in self._tp_layout()],
                            dtype=torch.int64)

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        if self._tp_sharded:
            for k, p in self._tp_local().items():
                destination[prefix + k] = p if keep_vars else p.detach()
            destination[prefix + _SHARD_KEY] = self._tp_meta()
            return
        for k, a in self._tp_full().items():  # a collective: every rank gets the full tensors
            destination[prefix + k] = _full_tensor(a)

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if self._tp_sharded:
            self._load_sharded(mine, prefix, missing_keys, unexpected_keys, error_msgs)
        else:
            self._load_full_sd(mine, prefix, missing_keys, unexpected_keys, error_msgs)

    def _load_full_sd(self, mine: Dict[str, Any], prefix: str, missing_keys: List[str], unexpected_keys: List[str],
                      error_msgs: List[str]) -> None:
        shapes = self._tp_full_shapes()
        missing = [k for k in shapes if k not in mine]
        unexpected = [k for k in mine if k not in shapes]
        missing_keys.extend(prefix + k for k in missing)
        unexpected_keys.extend(prefix + k for k in unexpected)
        if _SHARD_KEY in mine:
            error_msgs.append(f"{prefix}{_SHARD_KEY}: this is a sharded state dict (tpcore.torch.sharded_state_dict); "
                              f"load it with tpcore.torch.load_sharded_state_dict")
            return
        tensors, bad = {}, False
        for k, shape in shapes.items():
            if k not in mine:
                continue
            v = mine[k]
            vshape = tuple(v.shape) if hasattr(v, "shape") else None
            if vshape != tuple(shape):
                error_msgs.append(f"size mismatch for {prefix}{k}: copying a param with shape {vshape} from "
                                  f"checkpoint, the full (unsharded) shape in {self._who} is {tuple(shape)}")
                bad = True
                continue
            try:
                tensors[k] = _to_numpy(v, prefix + k, f"{self._who}.load_state_dict")
            except TypeError as e:
                error_msgs.append(str(e))
                bad = True
        if bad or not tensors:
            return
        if missing:  # strict=False: keep the current values of what is missing (gathered: every rank does it)
            full = self._tp_full()
            tensors = {k: tensors.get(k, full[k]) for k in shapes}
        self._tp_load_full(tensors)
        # C wrote the parameters behind torch's back: bump their versions, so that a backward of
        # a forward from before the load is refused (as after nn.Linear's load_state_dict)
        for p in self._tp_local().values():
            torch.autograd.graph.increment_version(p)

    def _load_sharded(self, mine: Dict[str, Any], prefix: str, missing_keys: List[str], unexpected_keys: List[str],
                      error_msgs: List[str]) -> None:
        local = self._tp_local()
        want = list(local) + [_SHARD_KEY]
        missing_keys.extend(prefix + k for k in want if k not in mine)
        unexpected_keys.extend(prefix + k for k in mine if k not in want)
        meta = mine.get(_SHARD_KEY)
        if meta is None:
            if any(k in mine for k in local):
                error_msgs.append(f"{prefix}{_SHARD_KEY} is missing: a sharded state dict records each module's "
                                  f"world size, rank and partition (full state dicts load with load_state_dict)")
            return
        have = self._tp_meta()
        meta = torch.as_tensor(meta).to(torch.int64).reshape(-1).cpu()
        if meta.numel() < 3 or not torch.equal(meta, have):
            def show(m: torch.Tensor) -> str:
                v = m.tolist()
                return f"format {v[0]}, world size {v[1]}, rank {v[2]}, partition {v[3:]}" if len(v) >= 3 else str(v)
            error_msgs.append(f"{prefix}{_SHARD_KEY}: the shard was saved with {show(meta)} but {self._who} here has "
                              f"{show(have)}; a sharded state dict loads only into the same world size, rank and "
                              f"partition (use the full state_dict()/load_state_dict() to reshard)")
            return
        with torch.no_grad():
            for k, p in local.items():
                if k not in mine:
                    continue
                v = torch.as_tensor(mine[k])
                if tuple(v.shape) != tuple(p.shape):
                    error_msgs.append(f"size mismatch for {prefix}{k}: copying a shard with shape {tuple(v.shape)}, "
                                      f"this rank's shard in {self._who} has shape {tuple(p.shape)}")
                    continue
                p.copy_(v)

    # ---- facts about the split
    @property
    def comm(self) -> Comm:
        return cast(Comm, self.layer.comm)

    def extra_repr(self) -> str:
        return repr(self.layer)


def _comm_arg(comm: Any, who: str) -> None:
    if not isinstance(comm, Comm):
        raise TypeError(f"{who}: comm must be a tpcore.Comm, got {type(comm).__name__}")


# ------------------------------------------------------------------ linear layers
class _Linear(_TPModule):
    """What the column- and row-parallel modules share (they differ only in the layer made)."""

    def _make(self, layer: Any, device: Tuple[str, int]) -> None:
        self._tp_init(layer, device)
        self.weight = self._adopt_param(self, "weight", layer.weight)
        if layer.bias is not None:
            self.bias = self._adopt_param(self, "bias", layer.bias)
        else:
            self.register_parameter("bias", None)

    def _tp_params(self) -> List[torch.nn.Parameter]:
        return [self.weight] + ([] if self.bias is None else [self.bias])

    def _tp_grads(self) -> List[Any]:
        return [self.layer.grad_weight] + ([] if self.bias is None else [self.layer.grad_bias])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y for x (..., in_features), or (..., this rank's in columns) for a row-parallel
        layer with input_is_parallel; float32 (bfloat16 / float16 given back in their dtype)."""
        x32, dt = _float_input(x, "x", self._who, self.device_)
        y = self._run(x32)
        return y if dt is None else y.to(dt)

    def _c_forward(self, x: torch.Tensor, need_backward: bool = True) -> torch.Tensor:
        self._tp_gen += 1
        return _wrap(self.layer.forward(_host(x)))

    def _c_backward(self, dy: torch.Tensor) -> Optional[torch.Tensor]:
        d, _ = _float_input(dy, "dy", f"{self._who} backward", self.device_)
        return _wrap(self.layer.backward(_host(d)))

    def _tp_full(self) -> Dict[str, np.ndarray]:
        W, b = self.layer.gather_full()
        return {"weight": W} if b is None else {"weight": W, "bias": b}

    def _tp_full_shapes(self) -> Dict[str, Tuple[int, ...]]:
        rows = (2 if self.layer.gated else 1) * self.layer.out_features
        s: Dict[str, Tuple[int, ...]] = {"weight": (rows, self.layer.in_features)}
        if self.bias is not None:
            s["bias"] = (rows,) if isinstance(self, ColumnParallelLinear) else (self.layer.out_features,)
        return s

    def _tp_load_full(self, t: Dict[str, np.ndarray]) -> None:
        self.layer.load_full(t["weight"], t.get("bias"))

    def _tp_layout(self) -> List[int]:
        return [s for _, s in self.layer.partition]

    @property
    def partition(self) -> List[Tuple[int, int]]:
        """Each rank's (offset, size) of the split dimension."""
        return cast(List[Tuple[int, int]], self.layer.partition)


class ColumnParallelLinear(_Linear):
    """y = x @ W.T + b with W (out_features, in_features) split along out_features.

    Parameters
    ----------
    in_features, out_features : int
    comm : tpcore.Comm
    bias : bool, default True
    gather_output : bool, default False
        False: the output is this rank's columns (..., local); True: all of y (one all-gather).
    partition, dtype, seed, gated, device, plan
        As tpcore.ColumnParallelLinear.

    ``weight`` / ``bias`` are this rank's rows (views of C memory); ``state_dict()`` gives the
    full (out, in) weight (collective).  Backward all-reduces the input gradient.
    """

    _who = "tpcore.torch.ColumnParallelLinear"

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True,
                 gather_output: bool = False, partition: Any = None, dtype: Any = "float32", seed: int = 0,
                 gated: bool = False, device: Optional[str] = None, plan: Any = None) -> None:
        super().__init__()
        _comm_arg(comm, self._who)
        _trainable_dtype(dtype, self._who)
        make: Any = _linear.ColumnParallelLinear
        layer = make(in_features, out_features, comm, bias=bias, gather_output=gather_output, partition=partition,
                     dtype=dtype, seed=seed, gated=gated, device=device, plan=plan)
        self._make(layer, layer.device)


class RowParallelLinear(_Linear):
    """y = x @ W.T + b with W (out_features, in_features) split along in_features.

    Parameters
    ----------
    in_features, out_features : int
    comm : tpcore.Comm
    bias : bool, default True
        The full bias, added once after the all-reduce of the partial outputs.
    input_is_parallel : bool, default True
        True: x is this rank's columns (the output of a ColumnParallelLinear without gather);
        False: x is the full input and backward all-gathers the input gradient.
    partition, dtype, seed, device, plan
        As tpcore.RowParallelLinear.
    """

    _who = "tpcore.torch.RowParallelLinear"

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True,
                 input_is_parallel: bool = True, partition: Any = None, dtype: Any = "float32", seed: int = 0,
                 device: Optional[str] = None, plan: Any = None) -> None:
        super().__init__()
        _comm_arg(comm, self._who)
        _trainable_dtype(dtype, self._who)
        make: Any = _linear.RowParallelLinear
        layer = make(in_features, out_features, comm, bias=bias, input_is_parallel=input_is_parallel,
                     partition=partition, dtype=dtype, seed=seed, device=device, plan=plan)
        self._make(layer, layer.device)


# ------------------------------------------------------------------ the MLP
class ParallelMLP(_TPModule):
    """fc2(act(fc1(x))) with fc1 column-parallel and fc2 row-parallel (Megatron): one
    all-reduce in forward, one in backward.  The whole step is one C call each way.

    Parameters
    ----------
    hidden, ffn_hidden : int
    comm : tpcore.Comm
    activation : {"gelu", "gelu_tanh", "silu", "relu", "swiglu"}, default "gelu"
        "swiglu": fc1.weight is [gate; up] of shape (2 ffn_hidden, hidden) in the full form.
    bias, partition, dtype, seed, device, plan
        As tpcore.ParallelMLP.

    Parameters ``fc1.weight``, ``fc1.bias``, ``fc2.weight``, ``fc2.bias`` (this rank's shards);
    the full state dict has nn.Linear's shapes under the same names.
    """

    _who = "tpcore.torch.ParallelMLP"

    def __init__(self, hidden: int, ffn_hidden: int, comm: Comm, activation: str = "gelu", bias: bool = True,
                 partition: Any = None, dtype: Any = "float32", seed: int = 0, device: Optional[str] = None,
                 plan: Any = None) -> None:
        super().__init__()
        _comm_arg(comm, self._who)
        _trainable_dtype(dtype, self._who)
        layer = _mlp.ParallelMLP(hidden, ffn_hidden, comm, activation=activation, bias=bias, partition=partition,
                                    dtype=dtype, seed=seed, device=device, plan=plan)
        self._tp_init(layer, layer.device)
        self.fc1, self.fc2 = _Holder(), _Holder()
        self._order = []
        for holder, lin in ((self.fc1, layer.fc1), (self.fc2, layer.fc2)):
            self._order.append((self._adopt_param(holder, "weight", lin.weight), lin, "grad_weight"))
            if lin.bias is not None:
                self._order.append((self._adopt_param(holder, "bias", lin.bias), lin, "grad_bias"))

    def _tp_params(self) -> List[torch.nn.Parameter]:
        return [p for p, _, _ in self._order]

    def _tp_grads(self) -> List[Any]:
        return [getattr(lin, g) for _, lin, g in self._order]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y (..., hidden) for x (..., hidden), replicated on every rank."""
        x32, dt = _float_input(x, "x", self._who, self.device_)
        y = self._run(x32)
        return y if dt is None else y.to(dt)

    _c_forward = _Linear._c_forward
    _c_backward = _Linear._c_backward

    def _tp_full(self) -> Dict[str, np.ndarray]:
        out = {}
        for name, lin in (("fc1", self.layer.fc1), ("fc2", self.layer.fc2)):
            W, b = lin.gather_full()
            out[f"{name}.weight"] = W
            if b is not None:
                out[f"{name}.bias"] = b
        return out

    def _tp_full_shapes(self) -> Dict[str, Tuple[int, ...]]:
        H, F = self.layer.hidden, self.layer.fc1.out_features
        g = 2 if self.layer.activation == "swiglu" else 1
        s: Dict[str, Tuple[int, ...]] = {"fc1.weight": (g * F, H), "fc2.weight": (H, F)}
        if self.layer.fc1.bias is not None:
            s.update({"fc1.bias": (g * F,), "fc2.bias": (H,)})
        return {k: s[k] for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias") if k in s}

    def _tp_load_full(self, t: Dict[str, np.ndarray]) -> None:
        self.layer.fc1.load_full(t["fc1.weight"], t.get("fc1.bias"))
        self.layer.fc2.load_full(t["fc2.weight"], t.get("fc2.bias"))

    def _tp_layout(self) -> List[int]:
        return [s for _, s in self.layer.fc1.partition]


# ------------------------------------------------------------------ vocabulary-parallel
class VocabParallelEmbedding(_TPModule):
    """Embedding table (num_embeddings, embedding_dim) split along the vocabulary; the
    output (..., embedding_dim) is replicated on every rank (one all-reduce in forward).

    Parameters
    ----------
    num_embeddings, embedding_dim : int
    comm : tpcore.Comm
    partition, seed, dtype, device, plan
        As tpcore.VocabParallelEmbedding.

    forward(tokens): an integer tensor of ids in [0, num_embeddings) (int64 is passed without a
    copy).  ``weight`` is this rank's rows; the full state dict has nn.Embedding's ``weight``.
    """

    _who = "tpcore.torch.VocabParallelEmbedding"

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Comm, partition: Any = None, seed: int = 0,
                 dtype: Any = "float32", device: Optional[str] = None, plan: Any = None) -> None:
        super().__init__()
        _comm_arg(comm, self._who)
        _trainable_dtype(dtype, self._who)
        layer = _vocab.VocabParallelEmbedding(num_embeddings, embedding_dim, comm, partition=partition, seed=seed,
                                              dtype=dtype, device=device, plan=plan)
        self._tp_init(layer, layer.device)
        self.weight = self._adopt_param(self, "weight", layer.weight)

    def _tp_params(self) -> List[torch.nn.Parameter]:
        return [self.weight]

    def _tp_grads(self) -> List[Any]:
        return [self.layer.grad_weight]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows (..., embedding_dim) float32 of the full table for integer tokens (...).

        Raises TypeError for a non-integer or misplaced tensor, ValueError for an id outside
        [0, num_embeddings)."""
        _check_tensor(tokens, "tokens", self._who, self.device_)
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"{self._who}: tokens must be an integer tensor, got {tokens.dtype}")
        return self._run(tokens.to(torch.int64).contiguous())

    def _c_forward(self, tokens: torch.Tensor, need_backward: bool = True) -> torch.Tensor:
        self._tp_gen += 1
        return _wrap(self.layer.forward(_host(tokens)))

    def _c_backward(self, dy: torch.Tensor) -> Optional[torch.Tensor]:
        d, _ = _float_input(dy, "dy", f"{self._who} backward", self.device_)
        self.layer.backward(_host(d))
        return None

    def _tp_full(self) -> Dict[str, np.ndarray]:
        return {"weight": self.layer.gather_full()}

    def _tp_full_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {"weight": (self.layer.num_embeddings, self.layer.embedding_dim)}

    def _tp_load_full(self, t: Dict[str, np.ndarray]) -> None:
        self.layer.load_full(t["weight"])

    def _tp_layout(self) -> List[int]:
        return [s for _, s in self.layer.partition]

    @property
    def partition(self) -> List[Tuple[int, int]]:
        return cast(List[Tuple[int, int]], self.layer.partition)


class _XentApply(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, mod: Any, logits: torch.Tensor, targets: torch.Tensor,
                vocab_offset: Optional[int]) -> torch.Tensor:
        loss = mod._c_forward(logits, targets, vocab_offset)
        ctx.mod, ctx.gen, ctx.vocab_offset = mod, mod._tp_gen, vocab_offset
        ctx.save_for_backward(logits, targets)
        return cast(torch.Tensor, loss)

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        mod = ctx.mod
        _first_order(mod)
        logits, targets = ctx.saved_tensors
        if mod._tp_gen != ctx.gen:
            mod._c_forward(logits, targets, ctx.vocab_offset)
        if mod.reduction == "none":
            d = _host(dloss.to(torch.float32).contiguous())
        else:
            d = float(dloss.item())
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        g = mod.layer.backward(d, out=_host(out)) if logits.device.type == "cpu" else mod.layer.backward(d)
        mod._tp_gen += 1
        return None, (out if logits.device.type == "cpu" else _wrap(g)), None, None


class VocabParallelCrossEntropy(_TPModule):
    """Softmax cross-entropy over the full vocabulary from each rank's shard of the logits
    (the output of a ColumnParallelLinear LM head without gather_output).

    Parameters
    ----------
    comm : tpcore.Comm
    ignore_index : int, default -100
        Rows whose target is ignore_index have no loss and no gradient (as torch).
    reduction : {"mean", "sum", "none"}, default "mean"
        "mean" averages over the rows not ignored; "none" gives one loss per row.
    device : str, optional

    forward(logits_shard, targets, vocab_offset=None): logits_shard (..., V_r) float32 (this
    rank's vocabulary columns, in rank order unless vocab_offset is given), targets (...) integer
    ids of the FULL vocabulary.  Collectives: a max all-reduce and one all-reduce per forward
    (plus a small all-gather of the shard widths without vocab_offset); backward has none.
    The loss is float32 (computed in float64 and rounded), the same on every rank.
    """

    _who = "tpcore.torch.VocabParallelCrossEntropy"

    def __init__(self, comm: Comm, ignore_index: int = -100, reduction: str = "mean",
                 device: Optional[str] = None) -> None:
        super().__init__()
        _comm_arg(comm, self._who)
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"{self._who}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.reduction = reduction
        layer = _vocab.VocabParallelCrossEntropy(comm, ignore_index=ignore_index, device=device)
        self._tp_init(layer, layer.device)

    def _tp_params(self) -> List[torch.nn.Parameter]:
        return []

    def forward(self, logits_shard: torch.Tensor, targets: torch.Tensor,
                vocab_offset: Optional[int] = None) -> torch.Tensor:
        """The loss (a 0-d float32 tensor; per row for reduction="none") of logits_shard
        (..., V_r) float32 against targets (...) of the full vocabulary; differentiable in
        logits_shard (its backward runs no collective)."""
        _check_tensor(logits_shard, "logits_shard", self._who, self.device_)
        _check_tensor(targets, "targets", self._who, self.device_)
        if logits_shard.dtype != torch.float32:
            raise TypeError(f"{self._who}: logits_shard must be float32, got {logits_shard.dtype}")
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise TypeError(f"{self._who}: targets must be an integer tensor, got {targets.dtype}")
        logits, t = logits_shard.contiguous(), targets.to(torch.int64).contiguous()
        if _tracing() or torch.is_grad_enabled() and logits.requires_grad:  # see _TPModule._run
            return cast(torch.Tensor, _XentApply.apply(self, logits, t, vocab_offset))  # type: ignore[no-untyped-call]
        return self._c_forward(logits, t, vocab_offset)

    def _c_forward(self, logits: torch.Tensor, targets: torch.Tensor,
                   vocab_offset: Optional[int]) -> torch.Tensor:
        self._tp_gen += 1
        loss = self.layer.forward(_host(logits), _host(targets), vocab_offset, self.reduction)
        if self.reduction == "none":
            return _wrap(loss)
        return torch.tensor(loss, dtype=torch.float32, device=logits.device)

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        pass  # no parameters

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix))

    def extra_repr(self) -> str:
        return f"ignore_index={self.layer.ignore_index}, reduction={self.reduction!r}"


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, comm: Comm,
                                 vocab_offset: Optional[int] = None, reduction: str = "mean",
                                 ignore_index: int = -100) -> torch.Tensor:
    """The functional form of VocabParallelCrossEntropy (differentiable): a module made for the
    call (a small C object, kept by the autograd graph until its backward)."""
    _comm_arg(comm, "tpcore.torch.vocab_parallel_cross_entropy")
    if not isinstance(logits_shard, torch.Tensor):
        raise TypeError(f"tpcore.torch.vocab_parallel_cross_entropy: logits_shard must be a torch.Tensor, got "
                        f"{type(logits_shard).__name__}")
    dev = None if logits_shard.device.type == "cpu" else _dev_text(logits_shard)
    mod = VocabParallelCrossEntropy(comm, ignore_index=ignore_index, reduction=reduction, device=dev)
    return cast(torch.Tensor, mod(logits_shard, targets, vocab_offset))


# ------------------------------------------------------------------ the Transformer block
class TransformerBlock(_TPModule):
    """One Transformer block (norms, attention with this rank's heads, the parallel MLP,
    residuals) split over the ranks of comm; see tpcore.TransformerBlock.

    Parameters
    ----------
    config : tpcore.Config
    comm : tpcore.Comm
    seed, head_partition, ffn_partition, device, dtype, plan
        As tpcore.TransformerBlock.

    forward(x, key_mask=None): x (B, T, hidden) float32, key_mask (B, T) of tokens to attend to
    (padding); y (B, T, hidden) replicated on every rank.  One all-reduce after attention and one
    after the MLP; backward mirrors them.  Parameters are this rank's shards under the C layer's
    names (``attn.qkv.weight``, ``mlp.fc1.weight``, ``norm1.weight`` ...); the full state dict uses
    tpcore.TransformerBlock.load_full's names (``attn.q.weight``, ``attn.k.weight`` ...).
    """

    _who = "tpcore.torch.TransformerBlock"
    _tp_cls: Any = _transformer.TransformerBlock

    def __init__(self, config: "_config.Config", comm: Comm, seed: int = 0, head_partition: Any = None,
                 ffn_partition: Any = None, device: Optional[str] = None, dtype: Any = "float32",
                 plan: Any = None) -> None:
        super().__init__()
        _comm_arg(comm, self._who)
        _trainable_dtype(dtype, self._who)
        make: Any = self._tp_cls
        layer = make(config, comm, seed=seed, head_partition=head_partition, ffn_partition=ffn_partition,
                     device=device, dtype=dtype, plan=plan)
        self._tp_init(layer, layer.device)
        self._order = []
        for name, (view, _) in layer._p.items():  # the weights only: the C gradients come with a backward
            *path, leaf = name.split(".")
            owner: torch.nn.Module = self
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, _Holder())
                owner = cast(torch.nn.Module, owner._modules[part])
            self._order.append((name, self._adopt_param(owner, leaf, view)))

    def _tp_params(self) -> List[torch.nn.Parameter]:
        return [p for _, p in self._order]

    def _tp_grads(self) -> List[Any]:
        grads = self.layer.named_parameters()  # (in a backward: allocated by now)
        return [grads[name][1] for name, _ in self._order]

    def _tp_local(self) -> Dict[str, torch.nn.Parameter]:
        return {name: p for name, p in self._order}

    def forward(self, x: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y (B, T, hidden) for x (B, T, hidden) (float32; bfloat16 / float16 given back in
        their dtype); key_mask (B, T) bools or 0/1 of the tokens to attend to (padding)."""
        x32, dt = _float_input(x, "x", self._who, self.device_)
        if key_mask is None:
            y = self._run(x32)
        else:
            if not isinstance(key_mask, torch.Tensor):
                raise TypeError(f"{self._who}: key_mask must be a torch.Tensor of shape (B, T), got "
                                f"{type(key_mask).__name__}")
            y = self._run(x32, key_mask.detach().cpu().contiguous())
        return y if dt is None else y.to(dt)

    def _c_forward(self, x: torch.Tensor, key_mask: Optional[torch.Tensor] = None,
                   need_backward: bool = True) -> torch.Tensor:
        self._tp_gen += 1
        m = None if key_mask is None else key_mask.numpy()
        return _wrap(self.layer.forward(_host(x), key_mask=m, need_backward=need_backward))

    def _c_backward(self, dy: torch.Tensor) -> Optional[torch.Tensor]:
        d, _ = _float_input(dy, "dy", f"{self._who} backward", self.device_)
        return _wrap(self.layer.backward(_host(d)))

    def _tp_full(self) -> Dict[str, np.ndarray]:
        return cast(Dict[str, np.ndarray], self.layer.gather_full())

    def _tp_full_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return cast(Dict[str, Tuple[int, ...]], self.layer.full_shapes())

    def _tp_load_full(self, t: Dict[str, np.ndarray]) -> None:
        self.layer.load_full(t)

    def _tp_layout(self) -> List[int]:
        L = self.layer
        return [s for _, s in L.head_partition] + [s for _, s in L.ffn_partition] + [L.k0, L.nk]


class ParallelAttention(TransformerBlock):
    """Attention alone, heads split over the ranks (see tpcore.ParallelAttention): the fused QKV
    projection (column-parallel), rotary positions when config.positions == "rope", causal or
    bidirectional attention with a padding mask, grouped-query heads and the row-parallel output
    projection; no norms, MLP or residual.  One all-reduce in forward, one in backward.
    Parameters ``attn.qkv.*`` and ``attn.out.*``; the full state dict has ``attn.q.weight``,
    ``attn.k.weight``, ``attn.v.weight``, ``attn.out.weight`` (and biases)."""

    _who = "tpcore.torch.ParallelAttention"
    _tp_cls = _transformer.ParallelAttention


# ------------------------------------------------------------------ sharded state dicts
@contextlib.contextmanager
def _sharded(module: torch.nn.Module) -> Iterator[None]:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"tpcore.torch: module must be a torch.nn.Module, got {type(module).__name__}")
    mods = [m for m in module.modules() if isinstance(m, _TPModule)]
    for m in mods:
        m._tp_sharded = True
    try:
        yield
    finally:
        for m in mods:
            m._tp_sharded = False


def sharded_state_dict(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """module.state_dict() with this rank's shards of every tpcore.torch module inside it
    (views of its parameters, no communication) and a ``<prefix>_tp_shard`` int64 tensor each
    recording [format, world size, rank, partition...].  Plain torch modules appear as usual."""
    with _sharded(module):
        return module.state_dict()


def load_sharded_state_dict(module: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """Load what sharded_state_dict gave, on the same rank of a module with the same world size
    and partitions (a RuntimeError naming both layouts otherwise).  Returns load_state_dict's
    (missing_keys, unexpected_keys)."""
    with _sharded(module):
        return module.load_state_dict(state_dict, strict=strict)
