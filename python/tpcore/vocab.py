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
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from . import _C
from .comm import Comm
from .layers import _sizes, check_partition


def _tokens(tokens, vocab, name="tokens"):
    t = np.asarray(tokens)
    if t.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got {t.dtype}")
    t = np.ascontiguousarray(t, dtype=np.int64)
    if t.size and (t.min() < 0 or t.max() >= vocab):
        raise ValueError(f"{name} must be in 0..{vocab - 1}, got values from {t.min()} to {t.max()}")
    return t


class VocabParallelEmbedding:
    """Embedding table split along the vocabulary; output replicated on every rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Comm, partition=None, seed: int = 0,
                 dtype="float32"):
        if np.dtype(dtype) != np.float32:
            raise ValueError(f"VocabParallelEmbedding: dtype {np.dtype(dtype)} is not supported yet; use float32")
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError("VocabParallelEmbedding: num_embeddings and embedding_dim must be >= 1")
        self.comm, self.num_embeddings, self.embedding_dim = comm, int(num_embeddings), int(embedding_dim)
        sizes = _sizes(partition, self.num_embeddings, comm.size, "num_embeddings")
        if sizes is None:
            n, w = self.num_embeddings, comm.size
            sizes = [n // w + (1 if r < n % w else 0) for r in range(w)]
        offs = [sum(sizes[:r]) for r in range(comm.size)]
        self.offset, self.local = offs[comm.rank], sizes[comm.rank]
        self.partition = check_partition(comm, self.offset, self.local, self.num_embeddings, "VocabParallelEmbedding")
        # N(0, 1) like torch.nn.Embedding, drawn per full row so every world size agrees
        self.weight = np.empty((self.local, self.embedding_dim), np.float32)
        for i in range(self.local):
            g = np.random.default_rng([seed, 0x656D62, self.offset + i])
            self.weight[i] = g.standard_normal(self.embedding_dim)
        self.grad_weight = np.zeros_like(self.weight)
        self._tok = None
        self._buf = None

    def parameters(self):
        return [(self.weight, self.grad_weight)]

    def zero_grad(self):
        self.grad_weight[...] = 0

    def _reg(self, n):
        if self._buf is None or self._buf.size < n:  # collective: every rank has the same n
            self._buf = self.comm.alloc((max(n, 1024) * 3 // 2,), np.float32)
        return self._buf[:n]

    def forward(self, tokens) -> np.ndarray:
        t = _tokens(tokens, self.num_embeddings)
        flat = t.reshape(-1)
        M, C = flat.size, self.embedding_dim
        out = self._reg(M * C).reshape(M, C) if self.comm.size > 1 else np.empty((M, C), np.float32)
        _C.embedding("forward", flat, self.weight, self.offset, out)
        if self.comm.size > 1:
            self.comm.all_reduce(out)  # registered: in place, zero-copy
        self._tok = flat
        return out.reshape(t.shape + (C,)).copy()

    __call__ = forward

    def backward(self, dout) -> None:
        if self._tok is None:
            raise RuntimeError("VocabParallelEmbedding.backward: called before forward")
        d = np.ascontiguousarray(dout, dtype=np.float32).reshape(-1, self.embedding_dim)
        if d.shape[0] != self._tok.size:
            raise ValueError(f"backward: dout has {d.shape[0]} rows, the last forward had {self._tok.size} tokens")
        _C.embedding("backward", self._tok, self.grad_weight, self.offset, d)

    def load_full(self, table: np.ndarray) -> None:
        table = np.asarray(table)
        if table.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"load_full: table must have shape {(self.num_embeddings, self.embedding_dim)}, "
                             f"got {table.shape}")
        self.weight[...] = table[self.offset:self.offset + self.local]

    def gather_full(self) -> np.ndarray:
        return self.comm.all_gather(np.ascontiguousarray(self.weight), sizes=[s for _, s in self.partition])


class VocabParallelCrossEntropy:
    """loss = xent(logits_shard, targets); dlogits_shard = xent.backward(dloss)."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self._ctx = None

    def forward(self, logits_shard: np.ndarray, targets, vocab_offset: Optional[int] = None,
                reduction: str = "mean"):
        if not isinstance(logits_shard, np.ndarray) or logits_shard.dtype != np.float32:
            raise TypeError("vocab_parallel_cross_entropy: logits_shard must be a float32 NumPy array")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        V = logits_shard.shape[-1]
        lead = logits_shard.shape[:-1]
        M = math.prod(lead)
        widths = self.comm.all_gather(np.array([V], np.int64))
        if vocab_offset is None:
            vocab_offset = int(widths[:self.comm.rank].sum())
        t = _tokens(targets, int(widths.sum()), "targets")
        if t.shape != lead:
            raise ValueError(f"targets must have shape {lead} (the logits' leading dims), got {t.shape}")
        logits = np.ascontiguousarray(logits_shard).reshape(M, V)
        t = t.reshape(M)
        gmax = _C.xent("max", logits)
        self.comm.all_reduce(gmax, op="max")
        sums = _C.xent("sums", logits, gmax, t, vocab_offset)
        self.comm.all_reduce(sums)
        sumexp, tlogit = sums[:M], sums[M:]
        losses = np.log(sumexp.astype(np.float64)) + gmax - tlogit
        self._ctx = (logits, gmax, np.ascontiguousarray(sumexp), t, vocab_offset, lead, reduction, M)
        if reduction == "none":
            return losses.reshape(lead)
        return float(losses.mean() if reduction == "mean" else losses.sum())

    __call__ = forward

    def backward(self, dloss=1.0) -> np.ndarray:
        """This rank's shard of dlogits for the last forward (no communication)."""
        if self._ctx is None:
            raise RuntimeError("vocab_parallel_cross_entropy backward: called before forward")
        logits, gmax, sumexp, t, off, lead, reduction, M = self._ctx
        if reduction == "none":
            d = np.asarray(dloss, np.float32).reshape(M)
            out = _C.xent("backward", logits, gmax, sumexp, t, off, 1.0)
            return (out * d[:, None]).reshape(lead + (logits.shape[1],))
        scale = float(dloss) / (M if reduction == "mean" else 1)
        return _C.xent("backward", logits, gmax, sumexp, t, off, scale).reshape(lead + (logits.shape[1],))


def vocab_parallel_cross_entropy(logits_shard, targets, comm: Comm, vocab_offset: Optional[int] = None,
                                 reduction: str = "mean"):
    """Mean softmax cross-entropy of the full vocabulary from each rank's logits
    shard.  For the backward, use VocabParallelCrossEntropy(comm)."""
    return VocabParallelCrossEntropy(comm).forward(logits_shard, targets, vocab_offset, reduction)
