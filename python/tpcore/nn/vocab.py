"""Vocabulary-parallel embedding and cross-entropy (Megatron).

VocabParallelEmbedding splits the table (num_embeddings x dim) along the
vocabulary: rank r holds rows [offset, offset + local).  A rank looks up the
tokens it owns, zeros the others, and one all-reduce completes every row.
Backward scatters the (replicated) output gradient into the rows the rank owns.

vocab_parallel_cross_entropy takes each rank's shard of the logits (the
output of a column-parallel LM head without gather) and computes the softmax
cross-entropy of the full vocabulary without any rank holding the full
logits: a max all-reduce, then one all-reduce of the packed (sum of exp,
target logit) per row (plus a small all-gather of the shard widths when
vocab_offset is not given).  Its backward gives this rank's shard of dlogits.
The vocabulary need not divide by the world size.

device="cuda" (or "cuda:N"; default the CPU): the table and the workspaces live on that GPU;
token ids, logits, targets and gradients are DLPack tensors there (tpcore.DeviceArray, PyTorch,
CuPy; token ids and targets int64), results are tpcore.DeviceArrays there, weight/grad_weight
DeviceArray views, and load_full copies host arrays to the GPU.  A tensor on another device is a
TypeError naming the layer, the argument and both devices.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from tpcore import _C
from tpcore.utils.args import int_arg, real_arg, seed_arg
from tpcore.utils.arrays import (DeviceArray, asarray, int_array, check_host, check_on_device, device_of,
                                 device_string, from_dlpack, resolve_device)
from tpcore.distributed.comm import Comm
from tpcore.utils.dtypes import is_quantized, weight_format
from tpcore.nn.common import as_float32, check_grad, kept_output, layer_memory, zero
from tpcore.nn.partition import _plan_sizes, check_partition, partition_sizes
from tpcore.nn.quant import QuantTensor
from tpcore.nn.weights import _shard_float, _shard_host, is_lazy, load_weight


def _tokens(tokens, name="tokens", who="VocabParallelEmbedding"):
    """Integer ids as a C-contiguous int64 array (the range is checked in C)."""
    return int_array(tokens, who, name)


def _device_tensor(x, name: str, who: str, device, dtype: str) -> DeviceArray:
    """x (any DLPack tensor) on the layer's GPU `device`, of dtype `dtype`, as a DeviceArray
    view: another device is a TypeError naming who, name and both devices."""
    check_on_device(x, name, who, device)
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"{who}: {name} must be a tensor on {device_string(device)} (a tpcore.DeviceArray or any "
                        f"DLPack tensor), got {type(x).__name__}")
    xa = from_dlpack(x)
    if xa.dtype != dtype:
        raise TypeError(f"{who}: {name} must be {dtype} on {device_string(device)}, got {xa.dtype}")
    return xa


class VocabParallelEmbedding:
    """Embedding table split along the vocabulary; output replicated on every rank.

    A thin face of the C layer (csrc/layers/vocab.c): weight / grad_weight are
    views of this rank's rows [offset, offset + local); forward is one C call (a
    lookup and one all-reduce in registered memory).

    Parameters
    ----------
    num_embeddings : int
        The vocabulary size (rows of the full table), >= 1; need not divide by the ranks.
    embedding_dim : int
        The width of a row, >= 1.
    comm : Comm
        The ranks that share the table.
    partition : list of int or list of (int, int), optional
        How the vocabulary is split (one size per rank or `tpcore.partition`'s pairs).
        Default None: even.
    seed : int, default 0
        Initialisation N(0, 1) per element of the full table from seed (an integer in
        [0, 2**64)): the same logical table at every world size and partition.
    dtype : str or dtype, default "float32"
        Table storage: "float32", "bfloat16" or "float16"; the output and grad_weight
        are float32.  Or a quantized format of `tpcore.quant` ("int8", "q8_0", "q4_0",
        "q4_1", "q4_k", "q5_k", "q6_k"; embedding_dim whole blocks): rows dequantized as
        they are looked up, the table frozen (grad_weight None).
    device : str, optional
        "cpu" (default) or "cuda[:N]" (see the module doc).
    plan : Plan, optional
        A `tpcore.plan_partition` plan whose vocabulary rows split the table.

    Attributes
    ----------
    offset, local : int
        This rank's rows [offset, offset + local).
    partition : list of (int, int)
        Every rank's (offset, local).

    Raises
    ------
    TypeError
        comm not a Comm, an argument of the wrong type.
    ValueError
        A size < 1, an unsupported dtype, a partition that does not add up.

    Notes
    -----
    Collectives: forward: one all-reduce; backward: none (each rank scatters the
    replicated output gradient into its own rows).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Comm, partition: Any = None, seed: int = 0,
                 dtype: Any = "float32", device: Optional[str] = None, plan: Any = None) -> None:
        self.device = resolve_device(device, "VocabParallelEmbedding")
        if not isinstance(comm, Comm):
            raise TypeError(f"VocabParallelEmbedding: comm must be a tpcore.Comm, got {type(comm).__name__}")
        self.dtype = weight_format(dtype, "VocabParallelEmbedding")
        seed = seed_arg(seed, "VocabParallelEmbedding")
        num_embeddings = int_arg(num_embeddings, "VocabParallelEmbedding", "num_embeddings", lo=1)
        embedding_dim = int_arg(embedding_dim, "VocabParallelEmbedding", "embedding_dim", lo=1)
        self.comm, self.num_embeddings, self.embedding_dim = comm, int(num_embeddings), int(embedding_dim)
        partition = _plan_sizes(plan, comm, self.num_embeddings, "VocabParallelEmbedding", partition, "vocab")
        sizes = partition_sizes(partition, self.num_embeddings, comm.size, "num_embeddings",
                       "VocabParallelEmbedding: partition")
        kw = {} if self.device[0] == "cpu" else {"device": device_string(self.device)}
        self._c = _C.VocabEmbedding(comm._c, self.num_embeddings, self.embedding_dim, sizes, seed,
                                    weight_dtype=self.dtype, **kw)
        shard = self._c.shard
        self.offset, self.local = shard["offset"], shard["local"]
        self.partition = check_partition(comm, self.offset, self.local, self.num_embeddings, "VocabParallelEmbedding")

    @property
    def weight(self) -> np.ndarray:
        """This rank's rows of the table, (local, embedding_dim), a view of C memory."""
        return self._c.weight

    @property
    def grad_weight(self) -> np.ndarray:
        """The gradient of `weight` accumulated by `backward` (float32); None for a quantized
        table (frozen).  Allocated on demand (zeroed): by this, `parameters`, `zero_grad` or
        the first `backward`; a table used only for lookups holds none."""
        self._c.alloc_grads()
        return self._c.grad_weight

    def weight_float(self) -> np.ndarray:
        """This rank's rows as float32 (a copy; quantized rows dequantized)."""
        return _shard_float(self.weight, self.dtype, self.embedding_dim)

    def parameters(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """[(weight, grad_weight)], for the optimizers of `tpcore.optim` ([] when quantized:
        frozen); the gradient is allocated (zeroed) here if no backward has yet."""
        if is_quantized(self.dtype):
            return []
        return [(self.weight, self.grad_weight)]

    def zero_grad(self) -> None:
        """Set grad_weight to zero (allocating it if no backward has yet)."""
        g = self.grad_weight
        if g is not None:
            zero(g)

    def memory(self) -> Dict[str, Any]:
        """The bytes this rank's rows hold now: "params" (the table shard in its storage
        format), "grads" (its gradient, once it exists), "workspace" (the last forward's
        tokens), "comm" (the all-reduce buffer); the keys of `ColumnParallelLinear.memory`.

        Returns
        -------
        dict
        """
        return layer_memory(self._c.memory())

    def forward(self, tokens: Any) -> Any:
        """The rows of the full table for integer tokens (also ``emb(tokens)``).

        Parameters
        ----------
        tokens : array_like of int, shape (...)
            Token ids in [0, num_embeddings), the same on every rank.  On a GPU table: an
            int64 DLPack tensor on its device.

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (..., embedding_dim), float32
            The same on every rank.

        Raises
        ------
        TypeError
            tokens are not integers (or not on the table's device).
        ValueError
            A token id out of range.
        CommError, CommTimeout
            The all-reduce failed.

        Notes
        -----
        Collective: one all-reduce over comm.
        """
        if self.device[0] != "cpu":
            t = _device_tensor(tokens, "tokens", "VocabParallelEmbedding", self.device, "int64")
            kept_output(self, None)
            y = self._c.forward(t.reshape((t.size,)))
            kept_output(self, tuple(t.shape) + (self.embedding_dim,))
            return y.reshape(tuple(t.shape) + (self.embedding_dim,))
        t = _tokens(tokens)
        kept_output(self, None)
        y = self._c.forward(t.reshape(-1))
        kept_output(self, t.shape + (self.embedding_dim,))
        return y.reshape(t.shape + (self.embedding_dim,))

    __call__ = forward

    def backward(self, dout: Any) -> None:
        """Accumulate grad_weight from the output gradient of the last forward.

        Parameters
        ----------
        dout : array_like, shape (..., embedding_dim)
            The gradient of forward's output (replicated): exactly its shape, a float dtype.

        Raises
        ------
        TypeError, ValueError
            dout of a wrong dtype or shape (a ValueError naming both shapes when it is not
            the last forward's output's).
        RuntimeError
            No forward ran before.

        Notes
        -----
        No collective.
        """
        if self.device[0] != "cpu":
            d = _device_tensor(dout, "dout", "VocabParallelEmbedding", self.device, "float32")
            if d.ndim < 1 or d.shape[-1] != self.embedding_dim:
                raise ValueError(f"VocabParallelEmbedding: dout must have shape (..., {self.embedding_dim}), got "
                                 f"{d.shape}")
            check_grad(self, d.shape, "dout")
            self._c.backward(d.reshape((d.size // self.embedding_dim, self.embedding_dim)))
            return
        d = as_float32(dout, "dout", "VocabParallelEmbedding")
        if d.ndim < 1 or d.shape[-1] != self.embedding_dim:
            raise ValueError(f"VocabParallelEmbedding: dout must have shape (..., {self.embedding_dim}), got {d.shape}")
        check_grad(self, d.shape, "dout")
        self._c.backward(d.reshape(-1, self.embedding_dim))

    def load_full(self, table: Any) -> None:
        """Keep this rank's rows of the full table.

        Parameters
        ----------
        table : array_like, shape (num_embeddings, embedding_dim)
            Any float dtype, converted to the table's.

        Raises
        ------
        ValueError
            A wrong shape.

        Notes
        -----
        No collective.
        """
        if not isinstance(table, QuantTensor) and not is_lazy(table):
            table = asarray(table, "table", "VocabParallelEmbedding.load_full")
        if tuple(table.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"load_full: table must have shape {(self.num_embeddings, self.embedding_dim)}, "
                             f"got {tuple(table.shape)}")
        load_weight(self.weight, self.dtype, table, slice(self.offset, self.offset + self.local), None, "load_full")

    def gather_full(self) -> np.ndarray:
        """The full table (num_embeddings, embedding_dim), from every rank's rows.

        Notes
        -----
        Collective: an all-gather over comm.
        """
        return self.comm.all_gather(_shard_host(self.weight, self.dtype, self.embedding_dim),
                                    sizes=[s for _, s in self.partition])

    def __repr__(self) -> str:
        return (f"VocabParallelEmbedding({self.num_embeddings}, {self.embedding_dim}, rank {self.comm.rank} holds "
                f"{self.offset}:{self.offset + self.local})")


class VocabParallelCrossEntropy:
    """Softmax cross-entropy over a vocabulary split across ranks, with its backward.

    ``loss = xent(logits_shard, targets); dlogits_shard = xent.backward(dloss)``.  No
    rank holds the full logits (see the module doc).  The logits passed to forward are
    kept (not copied) until the next forward: do not modify them before backward.

    Parameters
    ----------
    comm : Comm
        The ranks that hold the vocabulary shards.
    ignore_index : int, default -100
        Rows whose target equals it (as in torch) have no loss and no gradient; "mean"
        averages over the other rows.  An int64.
    device : str, optional
        "cpu" (default) or "cuda[:N]": logits and targets are tensors on that GPU.

    Raises
    ------
    TypeError
        comm not a Comm, ignore_index not an integer.

    Notes
    -----
    Collectives: forward: a max all-reduce and one all-reduce of (sum of exp, target
    logit) per row, plus a small all-gather of the shard widths when vocab_offset is not
    given; backward: none.
    """

    def __init__(self, comm: Comm, ignore_index: int = -100, device: Optional[str] = None) -> None:
        self.device = resolve_device(device, "VocabParallelCrossEntropy")
        if not isinstance(comm, Comm):
            raise TypeError(f"VocabParallelCrossEntropy: comm must be a tpcore.Comm, got {type(comm).__name__}")
        self.comm = comm
        self.ignore_index = int_arg(ignore_index, "VocabParallelCrossEntropy", "ignore_index",
                                    lo=-2 ** 63, hi=2 ** 63 - 1, expected="an integer (int64)")
        kw = {} if self.device[0] == "cpu" else {"device": device_string(self.device)}
        self._c = _C.VocabCrossEntropy(comm._c, **kw)
        self._ctx = None

    def memory(self) -> Dict[str, Any]:
        """The bytes it holds now: "workspace" (per-row maxima, sums and targets of the
        largest batch seen) and "comm" (the all-reduce buffer); no parameters.  The logits
        it reads are the caller's.  The keys of `ColumnParallelLinear.memory`.

        Returns
        -------
        dict
        """
        return layer_memory(self._c.memory())

    def forward(self, logits_shard: Any, targets: Any, vocab_offset: Optional[int] = None,
                reduction: str = "mean") -> Any:
        """The cross-entropy of the full vocabulary (also ``xent(...)``).

        Parameters
        ----------
        logits_shard : numpy.ndarray, shape (..., local_vocab)
            This rank's columns of the logits (a float dtype; computed in float32), e.g.
            a column-parallel LM head's output without gather.  On a GPU: float32 there.
        targets : array_like of int, shape (...)
            Target ids in the full vocabulary (or ignore_index), the same on every rank.
        vocab_offset : int, optional
            The first vocabulary id of this rank's shard.  Default None: the shards lie in
            rank order and their widths are all-gathered.
        reduction : {"mean", "sum", "none"}, default "mean"
            "mean" over the rows not ignored, "sum", or the per-row losses.

        Returns
        -------
        float or numpy.ndarray
            A float for "mean" / "sum" (float64 math on the host); float32 losses of
            shape (...) for "none" (a DeviceArray on a GPU).

        Raises
        ------
        TypeError
            logits not a float array (or not on the device), targets not integers.
        ValueError
            reduction unknown, targets' shape not the logits' leading shape, a target out
            of the vocabulary, vocab_offset not 0 on one rank, or shards that do not tile
            the vocabulary.
        CommError, CommTimeout
            A collective failed.
        """
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got "
                             f"{reduction!r}")
        if self.device[0] != "cpu":
            return self._forward_device(logits_shard, targets, vocab_offset, reduction)
        check_host(logits_shard, "logits_shard", "vocab_parallel_cross_entropy")  # a device tensor: say so
        if not isinstance(logits_shard, np.ndarray):
            raise TypeError(f"vocab_parallel_cross_entropy: logits_shard must be a NumPy array, got "
                            f"{type(logits_shard).__name__}")
        logits = as_float32(logits_shard, "logits_shard", "vocab_parallel_cross_entropy")
        if logits.ndim < 1:
            raise ValueError("vocab_parallel_cross_entropy: logits_shard must have a vocabulary dimension")
        V, lead = logits.shape[-1], logits.shape[:-1]
        M = math.prod(lead)
        t = _tokens(targets, "targets", "vocab_parallel_cross_entropy")
        if t.shape != lead:
            raise ValueError(f"vocab_parallel_cross_entropy: targets must have shape {lead} (the logits' leading "
                             f"dims), got {t.shape}")
        self._ctx = None
        vocab_offset = self._offset(vocab_offset)
        losses, valid, vocab = self._c.forward(logits.reshape(M, V), t.reshape(M), vocab_offset, self.ignore_index)
        self._ctx = (lead, reduction, M, V, valid)
        return self._reduce(losses, lead, reduction, valid)

    def _offset(self, vocab_offset: Any) -> int:
        if vocab_offset is None:
            return -1
        vocab_offset = int_arg(vocab_offset, "vocab_parallel_cross_entropy", "vocab_offset", lo=0,
                               expected="an integer >= 0 (or None: the shards lie in rank order)")
        if self.comm.size == 1 and vocab_offset != 0:
            raise ValueError(f"vocab_parallel_cross_entropy: vocab_offset must be 0 (or None) on one rank, whose "
                             f"shard is the whole vocabulary; got {vocab_offset}")
        # Past int64 only on this rank: the layout check all ranks do together refuses it on
        # every rank (an error here would leave the others waiting in the collective).
        return int(min(vocab_offset, 2 ** 63 - 1))

    @staticmethod
    def _reduce(losses, lead, reduction, valid):
        """reduction='none': the per-row losses (on a GPU: a DeviceArray there); else the sum or
        the mean over the valid rows, in float64 on the host."""
        if reduction == "none":
            return losses.reshape(tuple(lead))
        host = losses.to_numpy() if isinstance(losses, DeviceArray) else losses
        total = float(host.sum(dtype=np.float64))
        if reduction == "sum":
            return total
        return total / valid if valid else float("nan")

    def _forward_device(self, logits_shard, targets, vocab_offset, reduction):
        """forward on a GPU: logits_shard float32 and targets int64, DLPack tensors on its device."""
        who = "VocabParallelCrossEntropy"
        logits = _device_tensor(logits_shard, "logits_shard", who, self.device, "float32")
        if logits.ndim < 1:
            raise ValueError("vocab_parallel_cross_entropy: logits_shard must have a vocabulary dimension")
        V, lead = logits.shape[-1], tuple(logits.shape[:-1])
        M = math.prod(lead)
        t = _device_tensor(targets, "targets", who, self.device, "int64")
        if tuple(t.shape) != lead:
            raise ValueError(f"vocab_parallel_cross_entropy: targets must have shape {lead} (the logits' leading "
                             f"dims), got {tuple(t.shape)}")
        self._ctx = None
        off = self._offset(vocab_offset)
        losses, valid, vocab = self._c.forward(logits.reshape((M, V)), t.reshape((M,)), off, self.ignore_index)
        self._ctx = (lead, reduction, M, V, valid)
        return self._reduce(losses, lead, reduction, valid)

    def _backward_device(self, dloss, out):
        lead, reduction, M, V, valid = self._ctx
        who = "vocab_parallel_cross_entropy backward"
        o = None
        if out is not None:
            o = _device_tensor(out, "out", who, self.device, "float32")
            if o.size != M * V:
                raise ValueError(f"backward: out must be a float32 tensor of {M * V} elements (the logits' shape)")
            o = o.reshape((M, V))
        if reduction == "none" and (hasattr(dloss, "__dlpack__") or np.ndim(dloss)):
            if not hasattr(dloss, "__dlpack__") or isinstance(dloss, np.ndarray):
                raise TypeError(f"{who}: dloss must be a number or a float32 tensor of the losses' shape {lead} on "
                                f"{device_string(self.device)}, got {type(dloss).__name__}")
            d = _device_tensor(dloss, "dloss", who, self.device, "float32")
            if tuple(d.shape) != lead and tuple(d.shape) != (M,):
                raise ValueError(f"{who}: dloss must be a number or an array of the losses' shape {lead}, got shape "
                                 f"{tuple(d.shape)}")
            return self._c.backward(d.reshape((M,)), 1.0, o).reshape(lead + (V,))
        if isinstance(dloss, np.ndarray) and dloss.size == 1:
            dloss = dloss.reshape(()).item()
        dloss = real_arg(dloss, who, "dloss")
        scale = dloss if reduction == "none" else dloss / (max(valid, 1) if reduction == "mean" else 1)
        return self._c.backward(None, scale, o).reshape(lead + (V,))

    __call__ = forward

    def backward(self, dloss: Any = 1.0, out: Optional[np.ndarray] = None) -> Any:
        """This rank's shard of dlogits for the last forward.

        Parameters
        ----------
        dloss : float or array_like, default 1.0
            The gradient of the loss: a number, or with reduction="none" an array of the
            losses' shape.
        out : numpy.ndarray, optional
            A writable C-contiguous float32 array of the logits' shape to write into; it may
            be the logits themselves (each element is read before it is written), saving a
            buffer the size of the shard.

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (..., local_vocab), float32
            out, or a new array.

        Raises
        ------
        RuntimeError
            No forward ran before.
        TypeError, ValueError
            dloss not a number / of the wrong shape, out unsuitable.

        Notes
        -----
        No collective.
        """
        if self._ctx is None:
            raise RuntimeError("vocab_parallel_cross_entropy backward: called before forward")
        if self.device[0] != "cpu":
            return self._backward_device(dloss, out)
        lead, reduction, M, V, valid = self._ctx
        o = None
        if out is not None:
            check_host(out, "out", "vocab_parallel_cross_entropy backward")
            if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.flags.c_contiguous
                    and out.flags.writeable and out.size == M * V):
                raise ValueError(f"backward: out must be a writable C-contiguous float32 array of {M * V} elements "
                                 f"(the logits' shape)")
            o = out.reshape(M, V)
        who = "vocab_parallel_cross_entropy backward"
        if not isinstance(dloss, np.ndarray) and hasattr(dloss, "__dlpack__"):
            dloss = asarray(dloss, "dloss", who)  # its device checked
        if reduction == "none" and np.ndim(dloss):
            d = asarray(dloss, "dloss", who)
            if d.dtype.kind not in "fiu" or d.dtype == np.bool_:
                raise TypeError(f"{who}: dloss must be a number or an array of the losses' shape {lead}, got dtype "
                                f"{d.dtype}")
            if d.shape != lead and d.shape != (M,):
                raise ValueError(f"{who}: dloss must be a number or an array of the losses' shape {lead}, got shape "
                                 f"{d.shape}")
            d = np.ascontiguousarray(d, np.float32).reshape(M)
            return self._c.backward(d, 1.0, o).reshape(lead + (V,))
        if isinstance(dloss, np.ndarray) and dloss.size == 1:
            dloss = dloss.reshape(()).item()  # a 1-element array
        dloss = real_arg(dloss, who, "dloss")
        if reduction == "none":
            return self._c.backward(None, dloss, o).reshape(lead + (V,))
        scale = dloss / (max(valid, 1) if reduction == "mean" else 1)
        return self._c.backward(None, scale, o).reshape(lead + (V,))


def vocab_parallel_cross_entropy(logits_shard: Any, targets: Any, comm: Comm, vocab_offset: Optional[int] = None,
                                 reduction: str = "mean", ignore_index: int = -100) -> Any:
    """Softmax cross-entropy of the full vocabulary from each rank's logits shard.

    For the backward, use `VocabParallelCrossEntropy`.

    Parameters
    ----------
    logits_shard : numpy.ndarray or DLPack tensor, shape (..., local_vocab)
        This rank's logits columns (a GPU tensor: computed on its device).
    targets : array_like of int, shape (...)
        Target ids of the full vocabulary.
    comm : Comm
        The ranks that hold the shards.
    vocab_offset : int, optional
        The first id of this rank's shard (default None: shards in rank order).
    reduction : {"mean", "sum", "none"}, default "mean"
        As `VocabParallelCrossEntropy.forward`.
    ignore_index : int, default -100
        Targets with no loss.

    Returns
    -------
    float or numpy.ndarray
        As `VocabParallelCrossEntropy.forward`.

    Raises
    ------
    TypeError, ValueError, CommError, CommTimeout
        As `VocabParallelCrossEntropy.forward`.

    Notes
    -----
    Collectives: a max all-reduce and one all-reduce per call (plus an all-gather of the
    shard widths without vocab_offset).
    """
    where = device_of(logits_shard)  # a GPU tensor: the GPU cross-entropy on its device
    dev = device_string(where) if where is not None and where[0] != "cpu" else None
    xent = VocabParallelCrossEntropy(comm, ignore_index, device=dev)
    return xent.forward(logits_shard, targets, vocab_offset, reduction)
