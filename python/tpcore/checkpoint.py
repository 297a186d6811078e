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
"""
from __future__ import annotations

import json
import os
import struct
from typing import Dict, Iterator, Tuple

import numpy as np

from .comm import Comm, CommError
from .layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from .vocab import VocabParallelEmbedding

_ST_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I8": np.int8, "U8": np.uint8}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def write_safetensors(path: str, tensors: Dict[str, np.ndarray], metadata: Dict[str, str] = None) -> None:
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _ST_NAMES:
            raise TypeError(f"safetensors: dtype {a.dtype} of {name!r} is not supported")
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the format pads the header to 8 bytes
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


class BF16View:
    """A bfloat16 tensor of a memory-mapped file (NumPy has no bfloat16): indexing
    reads only the selected elements and gives them as float32."""

    def __init__(self, raw: np.ndarray):
        self._raw = raw  # uint16 bit patterns
        self.shape, self.ndim, self.dtype_name = raw.shape, raw.ndim, "bfloat16"

    def __getitem__(self, key) -> np.ndarray:
        bits = np.asarray(self._raw[key], dtype=np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def __array__(self, dtype=None, copy=None):
        a = self[...]
        return a if dtype is None else a.astype(dtype)


def to_float32(a) -> np.ndarray:
    """Any float tensor (NumPy, memory-mapped, bfloat16 view, ml_dtypes) as float32."""
    if isinstance(a, BF16View):
        return a[...]
    a = np.asarray(a)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise TypeError(f"expected a floating-point tensor, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def read_safetensors(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Every tensor of the file, memory-mapped (read-only: nothing is read until a
    tensor is indexed), and its metadata.  BF16 tensors come as BF16View."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"{path}: not a safetensors file (header of {n} bytes)")
        header = json.loads(f.read(n))
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, info in header.items():
        bf16 = info["dtype"] == "BF16"
        dt = np.uint16 if bf16 else _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        b0, b1 = info["data_offsets"]
        shape = tuple(info["shape"])
        if not 0 <= b0 <= b1 <= mm.size or (b1 - b0) != int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize:
            raise ValueError(f"{path}: tensor {name!r} has inconsistent offsets {info['data_offsets']} for shape {shape}")
        out[name] = mm[b0:b1].view(np.dtype(dt).newbyteorder("<")).reshape(shape)
        if bf16:
            out[name] = BF16View(out[name])
    return out, meta


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


def _format(path):
    if path.endswith(".npz"):
        return "npz"
    if path.endswith(".safetensors"):
        return "safetensors"
    raise ValueError(f"checkpoint path must end in .npz or .safetensors, got {path!r}")


def _write(path, tensors, meta):
    if _format(path) == "npz":
        np.savez(path, **tensors, __metadata__=np.array(json.dumps(meta)))
    else:
        write_safetensors(path, tensors, {"tpcore": json.dumps(meta)})


def _read(path):
    if _format(path) == "npz":
        with np.load(path, allow_pickle=False) as z:
            tensors = {k: z[k] for k in z.files if k != "__metadata__"}
            meta = json.loads(str(z["__metadata__"])) if "__metadata__" in z.files else {}
        return tensors, meta
    tensors, meta = read_safetensors(path)
    return tensors, json.loads(meta.get("tpcore", "{}"))


def shard_path(path: str, rank: int, world: int) -> str:
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}-of-{world}{suffix}"


def _collective(fn):
    """A failure on one rank (a full disk, a missing file) aborts the communicator,
    so that the other ranks fail at once instead of waiting in the barrier."""
    def wrapper(model, path, comm, sharded=False):
        try:
            return fn(model, path, comm, sharded)
        except Exception as e:
            if not isinstance(e, CommError) and not comm.closed:
                comm.abort(f"{fn.__name__}({path!r}) failed on rank {comm.rank}: {type(e).__name__}: {e}")
            raise
    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


@_collective
def save(model, path: str, comm: Comm, sharded: bool = False) -> None:
    """Collective.  Full tensors (written by rank 0) or one file per rank."""
    _format(path)
    leaves = list(_leaves(model))
    if sharded:
        tensors, parts = {}, {}
        for name, layer in leaves:
            for k, v in _shard(layer).items():
                tensors[name + k] = np.ascontiguousarray(v)
            parts[name] = layer.partition
        _write(shard_path(path, comm.rank, comm.size), tensors,
               {"world": comm.size, "rank": comm.rank, "partitions": parts})
    else:
        tensors = {}
        for name, layer in leaves:
            for k, v in _full(layer).items():
                tensors[name + k] = v
        if comm.rank == 0:
            _write(path, tensors, {"world": comm.size})
    comm.barrier()  # the files are complete when save returns on any rank


@_collective
def load(model, path: str, comm: Comm, sharded: bool = False) -> None:
    """Load full tensors (any world size: each rank keeps its slice) or this
    rank's shard file (the same world size and partition it was saved with)."""
    leaves = list(_leaves(model))
    if sharded:
        p = shard_path(path, comm.rank, comm.size)
        if not os.path.exists(p):
            raise FileNotFoundError(f"load: {p} not found (a sharded checkpoint loads at the world size it was "
                                    f"saved with; load the full checkpoint to reshard)")
        tensors, meta = _read(p)
        for name, layer in leaves:
            saved = meta.get("partitions", {}).get(name)
            if saved is not None and [list(x) for x in saved] != [list(x) for x in layer.partition]:
                raise ValueError(f"load: {name or 'layer'} was saved with partition {saved}, but this layer has "
                                 f"{layer.partition}; load a full checkpoint to reshard")
            for k, dst in _shard(layer).items():
                src = tensors.get(name + k)
                if src is None or src.shape != dst.shape:
                    raise ValueError(f"load: {p} has {name + k} of shape {None if src is None else src.shape}, "
                                     f"expected {dst.shape}")
                dst[...] = src
    else:
        tensors, _ = _read(path)
        for name, layer in leaves:
            W = tensors.get(name + "weight")
            if W is None:
                raise ValueError(f"load: {path} has no tensor {name + 'weight'!r}")
            if isinstance(layer, VocabParallelEmbedding):
                layer.load_full(W)
            else:
                layer.load_full(W, tensors.get(name + "bias"))
    comm.barrier()
