"""The public nn.Modules of tpcore.torch, each over the tpcore layer of the same name:
ColumnParallelLinear, RowParallelLinear, ParallelMLP, VocabParallelEmbedding,
VocabParallelCrossEntropy (and vocab_parallel_cross_entropy), TransformerBlock and
ParallelAttention."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, cast

import numpy as np
import torch

from tpcore.nn import config as _config
from tpcore.nn import linear as _linear
from tpcore.nn import mlp as _mlp
from tpcore.nn import transformer as _transformer
from tpcore.nn import vocab as _vocab
from tpcore.distributed.comm import Comm
from tpcore.torch.base import _Holder, _TPModule, _comm_arg
from tpcore.torch.functions import _XentApply
from tpcore.torch.tensors import _check_tensor, _dev_text, _float_input, _host, _trainable_dtype, _tracing, _wrap



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
    activation : {"gelu", "gelu_tanh", "silu", "relu", "swiglu", "geglu"}, default "gelu"
        "swiglu", "geglu": fc1.weight is [gate; up] of shape (2 ffn_hidden, hidden) in the full form.
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
        g = 2 if self.layer.activation in _config.GATED else 1
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
