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

import functools
import inspect
import json
import math
import os
import stat
import struct
import zipfile
from typing import Dict, Iterator, Tuple

import numpy as np

from ._array import asarray
from .comm import Comm, CommError
from .layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from .vocab import VocabParallelEmbedding

_ST_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
              "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_ST_READ = dict(_ST_DTYPES, BF16=np.uint16)        # what a tensor of the file is read as (BF16: its bits)
MAX_HEADER = 100_000_000                           # the safetensors format's bound on the JSON header


class CheckpointError(ValueError):
    """A checkpoint file that is corrupt, or that disagrees with itself or with its config:
    a safetensors file (header length, JSON, dtypes, shapes, data_offsets), a config.json,
    tpcore_config.json, generation_config.json or *.safetensors.index.json, or one of
    tpcore's own .npz / .safetensors checkpoints.  The message reads
    "<file>: <tensor or field>: expected <what>, found <what>"; the parts are also the
    attributes path, field, expected and found.  A lower-level error (JSON, UTF-8, zip)
    is chained as __cause__.  Raised before any memory is allocated for the model."""

    def __init__(self, message: str, *, path=None, field=None, expected=None, found=None):
        super().__init__(message)
        self.path, self.field, self.expected, self.found = path, field, expected, found


def _short(v, n: int = 80) -> str:
    r = v if isinstance(v, str) and not v.startswith("'") else repr(v)
    return r if len(r) <= n else r[:n - 3] + "..."


def bad(path, field, expected, found) -> CheckpointError:
    """CheckpointError "<path>: <field>: expected <expected>, found <found>" (found: a
    string as it is, another value as its repr cut at 80 characters)."""
    found_s = found if isinstance(found, str) else _short(found)
    return CheckpointError(f"{path}: {field}: expected {expected}, found {found_s}",
                           path=str(path), field=field, expected=expected, found=found)


def _type(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__) + f" ({_short(v, 40)})"


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_json(raw: bytes, path, field: str = "JSON"):
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, bounded nesting."""
    def pairs(kv):
        d = {}
        for k, v in kv:
            if k in d:
                raise bad(path, f"key {k!r}", "each key once (duplicate keys are ambiguous)", "it twice")
            d[k] = v
        return d

    def const(name):
        raise bad(path, field, "standard JSON numbers", name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(path, field, "UTF-8 text", f"invalid byte {raw[e.start:e.start + 1]!r} at offset {e.start}") from e
    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=const)
    except RecursionError as e:
        raise bad(path, field, "JSON nested to a sane depth", "nesting too deep to parse") from e
    except json.JSONDecodeError as e:
        raise bad(path, field, "valid JSON", f"{e.msg} at line {e.lineno} column {e.colno}") from e
    except CheckpointError:
        raise
    except ValueError as e:   # e.g. an integer of more than 4300 digits
        raise bad(path, field, "valid JSON", str(e)) from e


def regular_file(path: str) -> int:
    """The size of `path`, which must be a regular file (a symlink to one is fine): a
    directory, a FIFO (open would block) or a device (/dev/zero: endless) is refused."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise bad(path, "file", "a readable regular file", f"{type(e).__name__}: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else
                "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise bad(path, "file", "a regular file", kind)
    return st.st_size


def read_json_object(path: str, max_bytes: int = 64 << 20) -> dict:
    """A small JSON file (config.json and the like) that must hold one object."""
    size = regular_file(path)
    if size > max_bytes:
        raise bad(path, "file size", f"at most {max_bytes} bytes for a JSON file", f"{size} bytes")
    with open(path, "rb") as f:
        data = f.read(size + 1)  # bounded even if the file grows meanwhile (size <= max_bytes)
    if len(data) > max_bytes:
        raise bad(path, "file size", f"at most {max_bytes} bytes for a JSON file", "more")
    obj = parse_json(data, path)
    if not isinstance(obj, dict):
        raise bad(path, "top level", "a JSON object", _type(obj))
    return obj


_MISSING = object()
INT_MAX = 2 ** 31 - 1       # sizes the C core takes as C ints


class ConfigFields:
    """Typed reads of a config dict, each failure a CheckpointError naming the file and
    field: fields.int("n_head"), fields.num("layer_norm_epsilon", 1e-5), ..."""

    def __init__(self, d: dict, source: str):
        if not isinstance(d, dict):
            raise bad(source, "top level", "a JSON object", _type(d))
        self.d, self.source = d, str(source)

    def get(self, key, default=_MISSING):
        if key not in self.d:
            if default is _MISSING:
                raise bad(self.source, key, "a value (a required field)", "no such field")
            return default
        return self.d[key]

    def int(self, key, default=_MISSING, lo=1, hi=INT_MAX, null=False):
        v = self.get(key, default)
        if v is None and null:
            return None
        if not (is_int(v) and lo <= v <= hi):
            raise bad(self.source, key, f"an integer from {lo} to {hi}{' or null' if null else ''}", _type(v))
        return v

    def num(self, key, default=_MISSING, positive=True):
        v = self.get(key, default)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and (v > 0 or not positive)):
            raise bad(self.source, key, f"a finite number{' > 0' if positive else ''}", _type(v))
        return float(v)

    def bool(self, key, default=_MISSING):
        v = self.get(key, default)
        if v is None:
            v = default
        if not isinstance(v, bool):
            raise bad(self.source, key, "true or false", _type(v))
        return v

    def str(self, key, default=_MISSING, choices=None, note=""):
        v = self.get(key, default)
        if not isinstance(v, str) or (choices is not None and v not in choices):
            want = "a string" if choices is None else f"one of {', '.join(map(repr, choices))}{note}"
            raise bad(self.source, key, want, _type(v))
        return v

    def obj(self, key):
        v = self.get(key, None)
        if v is not None and not isinstance(v, dict):
            raise bad(self.source, key, "an object or null", _type(v))
        return v or {}

    def fail(self, key, expected, found):
        return bad(self.source, key, expected, found)


class TensorInfo(tuple):
    """(dtype name, shape, begin, end) of one tensor of a safetensors header."""
    __slots__ = ()

    def __new__(cls, dtype, shape, begin, end):
        return tuple.__new__(cls, (dtype, shape, begin, end))

    dtype = property(lambda self: self[0])
    shape = property(lambda self: self[1])
    begin = property(lambda self: self[2])
    end = property(lambda self: self[3])

    @property
    def floating(self) -> bool:
        return self[0] in ("F16", "BF16", "F32", "F64")


def read_safetensors_header(path: str) -> Tuple[Dict[str, TensorInfo], Dict[str, str], int]:
    """The checked header of a safetensors file: ({name: TensorInfo}, metadata, offset of
    the data section).  Reads only the header.  Enforces the format: a header length of at
    most 100 MB inside the file, a UTF-8 JSON object starting with "{" and without duplicate
    keys, "__metadata__" a str -> str object, every tensor an object with a known dtype, a
    shape of non-negative integers and data_offsets [begin, end] with shape x itemsize =
    end - begin, the tensors' byte ranges in order without overlaps or holes and exactly
    covering the data section up to the end of the file.  Else CheckpointError."""
    size = regular_file(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise bad(path, "header length", "an 8-byte little-endian length (a safetensors file)",
                      f"a file of {size} bytes")
        (n,) = struct.unpack("<Q", raw)
        if not 2 <= n <= min(size - 8, MAX_HEADER):
            why = "past the end of the file" if n > size - 8 else "too long" if n > MAX_HEADER else "too short"
            raise bad(path, "header length", f"2 to {min(size - 8, MAX_HEADER)} bytes (the file has {size} bytes, "
                      f"the format allows at most {MAX_HEADER})", f"{n} ({why}; not a safetensors file or truncated)")
        text = f.read(n)
    if len(text) != n:
        raise bad(path, "header", f"{n} bytes", f"{len(text)} (the file changed while read)")
    if text[:1] != b"{":
        raise bad(path, "header", "a JSON object starting with '{'", _short(text[:16]))
    header = parse_json(text, path, "header")
    if not isinstance(header, dict):
        raise bad(path, "header", "a JSON object", _type(header))
    meta = header.pop("__metadata__", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise bad(path, "__metadata__", "an object of strings", _type(meta))
    for k, v in meta.items():
        if not isinstance(v, str):
            raise bad(path, f"__metadata__[{k!r}]", "a string", _type(v))
    data = size - 8 - n
    out, spans = {}, []
    for name, info in header.items():
        where = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise bad(path, where, "an object with dtype, shape and data_offsets", _type(info))
        for key in ("dtype", "shape", "data_offsets"):
            if key not in info:
                raise bad(path, f"{where}", f"a {key!r} entry", f"keys {sorted(info)}")
        dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dt, str) or dt not in _ST_READ:
            raise bad(path, f"{where} dtype", f"one of {', '.join(sorted(_ST_READ))}", _type(dt))
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise bad(path, f"{where} shape", "a list of non-negative integers", _type(shape))
        if not (isinstance(offs, list) and len(offs) == 2 and all(is_int(o) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise bad(path, f"{where} data_offsets", "[begin, end], integers with 0 <= begin <= end", _type(offs))
        nbytes = math.prod(shape) * np.dtype(_ST_READ[dt]).itemsize
        if offs[1] - offs[0] != nbytes:
            raise bad(path, f"{where} data_offsets", f"{nbytes} bytes (shape {_short(shape)} x {dt})",
                      f"{offs} ({offs[1] - offs[0]} bytes)")
        if offs[1] > data:
            raise bad(path, f"{where} data_offsets", f"an end within the {data} bytes of data the file holds",
                      f"{offs} (the file is truncated or the header lies)")
        out[name] = TensorInfo(dt, tuple(shape), offs[0], offs[1])
        spans.append((offs[0], offs[1], name))
    spans.sort()
    pos, prev = 0, None
    for b0, b1, name in spans:
        if b0 != pos:
            what = f"overlaps tensor {prev!r} (which ends at {pos})" if b0 < pos else \
                f"leaves a hole of {b0 - pos} bytes after {'the header' if prev is None else repr(prev)}"
            raise bad(path, f"tensor {name!r} data_offsets", f"to begin at byte {pos} (tensors are contiguous)",
                      f"[{b0}, {b1}], which {what}")
        pos, prev = b1, name
    if pos != data:
        raise bad(path, "data section", f"{pos} bytes (the end of the last tensor)",
                  f"{data} bytes after the header (trailing bytes or a truncated file)")
    return out, meta, 8 + n


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
    a = asarray(a, "a tensor", "checkpoint")
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise TypeError(f"expected a floating-point tensor, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def read_safetensors(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Every tensor of the file, memory-mapped (read-only: nothing is read until a
    tensor is indexed), and its metadata.  BF16 tensors come as BF16View.  The header
    is checked first (read_safetensors_header): a corrupt file raises CheckpointError."""
    header, meta, start = read_safetensors_header(path)
    size = os.path.getsize(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=start) if size > start else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        dt = np.dtype(_ST_READ[info.dtype]).newbyteorder("<")
        out[name] = mm[info.begin:info.end].view(dt).reshape(info.shape)
        if info.dtype == "BF16":
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


def read_npz(path: str) -> Dict[str, np.ndarray]:
    """Every array of a .npz archive, checked before it is read: a zip of .npy members
    only, no pickled objects, each member's .npy header consistent with the member's
    size (a header that lies about its shape allocates nothing).  Else CheckpointError."""
    if os.path.exists(path):
        regular_file(path)
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise bad(path, "file", "a NumPy .npz archive (zip)", f"{type(e).__name__}: {e}") from e
    out = {}
    with zf:
        for info in zf.infolist():
            member = info.filename
            if not member.endswith(".npy") or info.is_dir():
                raise bad(path, f"member {member!r}", "only .npy arrays in the archive", "another kind of member")
            key = member[:-4]
            if key in out:
                raise bad(path, f"array {key!r}", "each array once", "it twice")
            try:
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                    elif version == (2, 0):
                        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                    else:
                        raise bad(path, f"array {key!r}", ".npy format version 1.0 or 2.0", f"version {version}")
                    if dtype.hasobject:
                        raise bad(path, f"array {key!r} dtype", "a numeric dtype (pickled objects are refused)",
                                  str(dtype))
                    need = f.tell() + math.prod(shape) * dtype.itemsize
                if need != info.file_size:
                    raise bad(path, f"array {key!r}", f"{need} bytes for shape {shape} of {dtype}",
                              f"{info.file_size} bytes in the archive")
                with zf.open(info) as f:
                    out[key] = np.lib.format.read_array(f, allow_pickle=False)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001  zip CRC, zlib, EOF, a malformed .npy header
                raise bad(path, f"array {key!r}", "a readable .npy array", f"{type(e).__name__}: {e}") from e
    return out


def _meta_json(path, text, field):
    if not isinstance(text, str):
        raise bad(path, field, "a JSON string", _type(text))
    meta = parse_json(text.encode("utf-8", "surrogatepass"), path, field)
    if not isinstance(meta, dict):
        raise bad(path, field, "a JSON object", _type(meta))
    return meta


def _read(path):
    """(tensors, tpcore metadata) of one of tpcore.save's files; CheckpointError if corrupt."""
    if _format(path) == "npz":
        tensors = read_npz(path)
        meta = tensors.pop("__metadata__", None)
        if meta is None:
            return tensors, {}
        if meta.ndim != 0 or meta.dtype.kind != "U":
            raise bad(path, "array '__metadata__'", "a 0-d unicode string", f"{meta.dtype} of shape {meta.shape}")
        return tensors, _meta_json(path, str(meta), "__metadata__")
    tensors, meta = read_safetensors(path)
    return tensors, _meta_json(path, meta.get("tpcore", "{}"), "__metadata__['tpcore']")


def _full_shapes(layer) -> Dict[str, tuple]:
    if isinstance(layer, VocabParallelEmbedding):
        return {"weight": (layer.num_embeddings, layer.embedding_dim)}
    rows = (2 if getattr(layer, "gated", False) else 1) * layer.out_features
    out = {"weight": (rows, layer.in_features)}
    if layer.bias is not None:
        out["bias"] = (rows,)
    return out


def check_tensors(path, tensors, expected: Dict[str, tuple], what: str = "the model") -> None:
    """CheckpointError unless tensors holds exactly the names of expected, each a float
    tensor of exactly the expected shape."""
    for k, shape in expected.items():
        t = tensors.get(k)
        if t is None:
            raise bad(path, f"tensor {k!r}", f"a tensor of shape {tuple(shape)} ({what} has it)", "no such tensor")
        if tuple(t.shape) != tuple(shape):
            raise bad(path, f"tensor {k!r}", f"shape {tuple(shape)}", f"shape {tuple(t.shape)}")
        dt = getattr(t, "dtype_name", None) or np.dtype(t.dtype).name
        if not (dt in ("float16", "float32", "float64", "bfloat16")):
            raise bad(path, f"tensor {k!r} dtype", "a floating-point dtype", dt)
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise bad(path, f"tensor {extra[0]!r}", f"only the tensors of {what} ({len(expected)})",
                  f"{len(extra)} unexpected tensor{'s' if len(extra) > 1 else ''}: {_short(extra, 120)}")


def _check_meta(path, meta, comm, sharded):
    for k in ("world", "rank"):
        if k in meta and not (is_int(meta[k]) and meta[k] >= 0):
            raise bad(path, f"__metadata__ {k!r}", "a non-negative integer", _type(meta[k]))
    parts = meta.get("partitions", {})
    if not isinstance(parts, dict):
        raise bad(path, "__metadata__ 'partitions'", "an object of layer name -> [[offset, size], ...]", _type(parts))
    for k, v in parts.items():
        if not (isinstance(v, list) and all(isinstance(x, list) and len(x) == 2 and all(is_int(i) for i in x)
                                            for x in v)):
            raise bad(path, f"__metadata__ partitions[{k!r}]", "a list of [offset, size] integer pairs", _type(v))
    if sharded:
        for k, want in (("world", comm.size), ("rank", comm.rank)):
            if k in meta and meta[k] != want:
                raise bad(path, f"__metadata__ {k!r}", f"{want} (the file's name says so)", meta[k])


def shard_path(path: str, rank: int, world: int) -> str:
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}-of-{world}{suffix}"


def _collective(fn):
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
            if many and not isinstance(e, CommError) and not comm.closed:
                comm.abort(f"{fn.__name__}({path!r}) failed on rank {comm.rank}: {type(e).__name__}: {e}")
            raise
        if many:
            comm.barrier()  # done only if every rank is: one that failed has aborted the communicator
        return out
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
        _check_meta(p, meta, comm, True)
        expected = {}
        for name, layer in leaves:
            saved = meta.get("partitions", {}).get(name)
            if saved is not None and [list(x) for x in saved] != [list(x) for x in layer.partition]:
                raise ValueError(f"load: {name or 'layer'} was saved with partition {saved}, but this layer has "
                                 f"{layer.partition}; load a full checkpoint to reshard")
            expected.update({name + k: dst.shape for k, dst in _shard(layer).items()})
        check_tensors(p, tensors, expected, "this rank's shard of the model")
        for name, layer in leaves:
            for k, dst in _shard(layer).items():
                dst[...] = to_float32(tensors[name + k])
    else:
        tensors, meta = _read(path)
        _check_meta(path, meta, comm, False)
        expected = {name + k: shape for name, layer in leaves for k, shape in _full_shapes(layer).items()}
        check_tensors(path, tensors, expected)
        for name, layer in leaves:
            if isinstance(layer, VocabParallelEmbedding):
                layer.load_full(tensors[name + "weight"])
            else:
                layer.load_full(tensors[name + "weight"], tensors.get(name + "bias"))
    comm.barrier()
