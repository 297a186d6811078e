"""Saving and loading parameters: per rank (sharded) or as full tensors.

    tpcore.save(model, "mlp.safetensors", comm)                # full tensors, written by rank 0
    tpcore.save(model, "ckpt/mlp.npz", comm, sharded=True)     # each rank writes its shard
    tpcore.load(model, "mlp.safetensors", comm)                # any world size / partition
    tpcore.load(model, "ckpt/mlp.npz", comm, sharded=True)     # same world size and partition

`model` is a layer, a ParallelMLP, or a dict of those (names become prefixes:
"mlp.fc1.weight").  The format follows the file suffix: ".npz" (NumPy) or
".safetensors" (the Hugging Face format, written and read here; the
`safetensors` package reads our files and we read its).  A full checkpoint
holds the logical tensors, so it loads at any world size (resharding); a
sharded one is a file per rank, "<stem>.rank<r>-of-<n><suffix>", with its
partition recorded, and loads only into the same layout.

The file formats themselves (safetensors, .npz, JSON, model folders) live in
_formats.py; their readers and writers are importable from here as before.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Dict, Iterator, Tuple, TypeVar

import numpy as np

from tpcore.utils.args import is_int
from tpcore.io.formats import (type_name, bad, check_tensors, file_format, read_tensors_file, shard_path, to_float32,
                               write_tensors_file)
from tpcore.distributed.comm import Comm, CommError
from tpcore.io import stream as _stream
from tpcore.utils.dtypes import is_quantized
from tpcore.nn.linear import ColumnParallelLinear, RowParallelLinear
from tpcore.nn.mlp import ParallelMLP
from tpcore.nn.weights import load_weight
from tpcore.nn.vocab import VocabParallelEmbedding

_F = TypeVar("_F", bound=Callable[..., Any])

def _leaves(model, prefix="") -> Iterator[Tuple[str, object]]:
    if isinstance(model, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
        yield prefix, model
    elif isinstance(model, ParallelMLP):
        yield from _leaves(model.fc1, prefix + "fc1.")
        yield from _leaves(model.fc2, prefix + "fc2.")
    elif isinstance(model, dict):
        for k, m in model.items():
            yield from _leaves(m, prefix + str(k) + ".")
    else:
        raise TypeError(f"save/load: cannot handle {type(model).__name__} (layers, ParallelMLP or dicts of them)")


def _full(layer) -> Dict[str, np.ndarray]:
    if isinstance(layer, VocabParallelEmbedding):
        return {"weight": layer.gather_full()}
    W, b = layer.gather_full()
    return {"weight": W} if b is None else {"weight": W, "bias": b}


def _shard(layer) -> Dict[str, np.ndarray]:
    out = {"weight": layer.weight}
    if getattr(layer, "bias", None) is not None:
        out["bias"] = layer.bias
    return out


def _full_shapes(layer) -> Dict[str, tuple]:
    if isinstance(layer, VocabParallelEmbedding):
        return {"weight": (layer.num_embeddings, layer.embedding_dim)}
    rows = (2 if getattr(layer, "gated", False) else 1) * layer.out_features
    out = {"weight": (rows, layer.in_features)}
    if layer.bias is not None:
        out["bias"] = (rows,)
    return out


def _check_meta(path, meta, comm, sharded):
    for k in ("world", "rank"):
        if k in meta and not (is_int(meta[k]) and meta[k] >= 0):
            raise bad(path, f"__metadata__ {k!r}", "a non-negative integer", type_name(meta[k]))
    parts = meta.get("partitions", {})
    if not isinstance(parts, dict):
        raise bad(path, "__metadata__ 'partitions'", "an object of layer name -> [[offset, size], ...]",
                  type_name(parts))
    for k, v in parts.items():
        if not (isinstance(v, list) and all(isinstance(x, list) and len(x) == 2 and all(is_int(i) for i in x)
                                            for x in v)):
            raise bad(path, f"__metadata__ partitions[{k!r}]", "a list of [offset, size] integer pairs", type_name(v))
    if sharded:
        for k, want in (("world", comm.size), ("rank", comm.rank)):
            if k in meta and meta[k] != want:
                raise bad(path, f"__metadata__ {k!r}", f"{want} (the file's name says so)", meta[k])


def collective(fn: _F) -> _F:
    """A failure on one rank (a full disk, a missing file, a shard of another
    partition) aborts the communicator, so that the other ranks fail at once
    instead of waiting in a collective, and a barrier at the end lets a rank
    return only when every rank succeeded (fn takes `path` and `comm` arguments)."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        bound = sig.bind(*args, **kw).arguments
        comm, path = bound["comm"], bound["path"]
        many = isinstance(comm, Comm) and comm.size > 1
        try:
            out = fn(*args, **kw)
        except Exception as e:
            # every_rank: every rank raises this same error in step (a file refused by rank 0, see
            # models.loader.first_rank_reads): the communicator stays usable
            if many and not isinstance(e, CommError) and not comm.closed and not getattr(e, "every_rank", False):
                comm.abort(f"{fn.__name__}({path!r}) failed on rank {comm.rank}: {type(e).__name__}: {e}")
            raise
        if many:
            comm.barrier()  # done only if every rank is: one that failed has aborted the communicator
        return out
    return wrapper  # type: ignore[return-value]  # the same signature (functools.wraps)


@collective
def save(model: Any, path: str, comm: Comm, sharded: bool = False) -> None:
    """Save a model's parameters: full tensors (written by rank 0) or one file per rank.

    Parameters
    ----------
    model : layer, ParallelMLP or dict
        A ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, a ParallelMLP,
        or a dict of those (names become prefixes: "mlp.fc1.weight").
    path : str
        Ends in ".npz" (NumPy) or ".safetensors"; sharded: each rank writes
        "<stem>.rank<r>-of-<n><suffix>" with its partition recorded.
    comm : Comm
        The model's communicator.
    sharded : bool, default False
        One file per rank (loads only into the same world size and partition) instead of
        the full logical tensors (load at any world size).

    Raises
    ------
    ValueError
        path has another suffix, or the model holds something that is not a layer.
    OSError
        A file cannot be written.
    CommError
        Another rank failed (a rank that fails aborts the communicator, so that the
        others fail at once instead of waiting).

    Notes
    -----
    Collective: all-gathers the shards for a full checkpoint, then a barrier; returns
    on any rank only once the files are complete.
    """
    file_format(path)
    leaves = list(_leaves(model))
    if sharded:
        tensors, parts, formats = {}, {}, {}
        for name, layer in leaves:
            for k, v in _shard(layer).items():
                tensors[name + k] = np.ascontiguousarray(v)
            parts[name] = layer.partition
            if is_quantized(layer.dtype):  # raw rows: the format must match on load
                formats[name] = layer.dtype
        meta = {"world": comm.size, "rank": comm.rank, "partitions": parts}
        if formats:
            meta["formats"] = formats
        write_tensors_file(shard_path(path, comm.rank, comm.size), tensors, meta)
    else:
        tensors = {}
        for name, layer in leaves:
            for k, v in _full(layer).items():
                tensors[name + k] = v
        if comm.rank == 0:
            write_tensors_file(path, tensors, {"world": comm.size})
    comm.barrier()  # the files are complete when save returns on any rank


@collective
def load(model: Any, path: str, comm: Comm, sharded: bool = False) -> None:
    """Load a model's parameters saved by `save`.

    Parameters
    ----------
    model : layer, ParallelMLP or dict
        As for `save`, with the same names.
    path : str
        The path given to `save`.
    comm : Comm
        The model's communicator.
    sharded : bool, default False
        False: full tensors, any world size (each rank keeps its slice: resharding).
        True: this rank's shard file (the same world size and partition it was saved
        with).

    Raises
    ------
    FileNotFoundError
        A file is missing (a shard file at another world size: load the full checkpoint).
    CheckpointError
        A corrupt or inconsistent file (a ValueError), naming the file, the tensor or
        field, what was expected and what was found.
    ValueError
        A shard saved with another partition, or with weights of another format (a quantized
        layer's shard holds its raw rows, copied as they are).
    CommError
        Another rank failed.

    Notes
    -----
    Collective: ends with a barrier (every rank returns only when every rank succeeded).
    """
    leaves = list(_leaves(model))
    with _stream.loading(_stream.staging_arg(None, "load")):
        _load_leaves(leaves, path, comm, sharded)
    comm.barrier()


def _load_leaves(leaves, path, comm, sharded):
    if sharded:
        p = shard_path(path, comm.rank, comm.size)
        if not os.path.exists(p):
            raise FileNotFoundError(f"load: {p} not found (a sharded checkpoint loads at the world size it was "
                                    f"saved with; load the full checkpoint to reshard)")
        tensors, meta = read_tensors_file(p)
        _check_meta(p, meta, comm, True)
        expected, raw = {}, {}
        formats = meta.get("formats", {})
        formats = formats if isinstance(formats, dict) else {}
        for name, layer in leaves:
            saved = meta.get("partitions", {}).get(name)
            if saved is not None and [list(x) for x in saved] != [list(x) for x in layer.partition]:
                raise ValueError(f"load: {name or 'layer'} was saved with partition {saved}, but this layer has "
                                 f"{layer.partition}; load a full checkpoint to reshard")
            fmt = layer.dtype if is_quantized(layer.dtype) else None
            if formats.get(name) != fmt:
                raise ValueError(f"load: {name or 'layer'} was saved with {formats.get(name) or 'float'} weights, but "
                                 f"this layer holds {fmt or 'float'} ones; load a full checkpoint to convert")
            for k, dst in _shard(layer).items():
                (raw if fmt and k == "weight" else expected)[name + k] = dst.shape
        check_tensors(p, {k: v for k, v in tensors.items() if k not in raw}, expected,
                      "this rank's shard of the model")
        for k, shape in raw.items():  # a quantized weight's raw rows: uint8 of exactly its shape
            t = tensors.get(k)
            if t is None or tuple(t.shape) != tuple(shape) or np.dtype(getattr(t, "dtype", None)) != np.uint8:
                raise bad(p, f"tensor {k!r}", f"uint8 raw rows of shape {tuple(shape)}",
                          "no such tensor" if t is None else f"{getattr(t, 'dtype', '?')} of shape {tuple(t.shape)}")
        for name, layer in leaves:
            for k, dst in _shard(layer).items():
                t = tensors[name + k]
                if name + k in raw:   # raw quantized rows, copied as they are, chunk by chunk
                    _stream.copy_raw(dst, t)
                elif len(t.shape) == 2:
                    load_weight(dst, "float32", t, slice(None), None, f"load: {name + k}")
                else:
                    dst[...] = to_float32(t[...])
    else:
        tensors, meta = read_tensors_file(path)
        _check_meta(path, meta, comm, False)
        expected = {name + k: shape for name, layer in leaves for k, shape in _full_shapes(layer).items()}
        check_tensors(path, tensors, expected)
        for name, layer in leaves:
            if isinstance(layer, VocabParallelEmbedding):
                layer.load_full(tensors[name + "weight"])
            else:
                layer.load_full(tensors[name + "weight"], tensors.get(name + "bias"))
