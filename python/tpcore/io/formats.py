"""Checkpoint formats, in one place: every file tpcore reads or writes for parameters.

- safetensors (the Hugging Face format; tpcore's own reader and writer: headers checked
  against the format's rules, tensors read with pread on indexing (open_safetensors; the
  loaders stream them, tpcore.io.stream) or memory-mapped (read_safetensors), bfloat16 without
  torch): safetensors.py, and lazy.py for the tensors read on indexing (FileTensor),
- NumPy .npz (checked before it is read: no pickles, headers that match the members): npz.py,
- strict JSON (config.json, tpcore_config.json, generation_config.json, index files) and the
  checks every reader shares (CheckpointError, bad, ConfigFields): checks.py,
- here: the files of tpcore.save (one file, or one per rank "<stem>.rank<r>-of-<n><suffix>",
  with tpcore's metadata), and
- a model folder: Hugging Face's (config.json, *.safetensors and the
  *.safetensors.index.json of a sharded checkpoint) and tpcore's own from
  save_pretrained (tpcore_config.json with model.safetensors, or
  model.rank<r>-of-<n>.safetensors of tensors param.<i>).

Every name of those modules that the rest of tpcore uses is importable from here.

Every corrupt or inconsistent file raises CheckpointError (a ValueError) naming the
file, the tensor or field, what was expected and what was found.  This module knows
file layouts only: what the tensors mean (names, shapes of a model) is the Hugging Face
module's (hf.py) and the models' (models.py)."""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
from typing import Dict

import numpy as np

from tpcore.io.checks import (INT_MAX, MISSING, CheckpointError, ConfigFields, _short, bad, is_int, parse_json,
                              read_json_object, regular_file, type_name)
from tpcore.io.lazy import FileTensor, base_row_index, open_safetensors, read_rows, row_runs, split_row_index
from tpcore.io.npz import read_npz
from tpcore.io.safetensors import (MAX_HEADER, BF16View, TensorInfo, read_safetensors, read_safetensors_header,
                                   to_float32, write_safetensors)

__all__ = [
    # checks.py
    "CheckpointError", "bad", "type_name", "is_int", "parse_json", "regular_file", "read_json_object", "MISSING",
    "INT_MAX", "ConfigFields",
    # safetensors.py
    "MAX_HEADER", "TensorInfo", "read_safetensors_header", "write_safetensors", "BF16View", "to_float32",
    "read_safetensors",
    # lazy.py
    "open_safetensors", "split_row_index", "base_row_index", "row_runs", "read_rows", "FileTensor",
    # npz.py
    "read_npz",
    # here
    "check_tensors", "shard_path", "file_format", "write_tensors_file", "read_tensors_file", "index_files",
    "read_headers", "open_tensors", "HF_CONFIG", "GENERATION_CONFIG", "OWN_CONFIG", "MODEL_FILE", "OWN_PARAM",
    "own_shard_file", "own_shard_files", "write_json", "write_own_config", "read_own_config", "write_own_shard",
    "count_own_shards", "read_generation_config",
]


# The files of tpcore.save ----------------------------------------------------------------
def _meta_json(path, text, field):
    if not isinstance(text, str):
        raise bad(path, field, "a JSON string", type_name(text))
    meta = parse_json(text.encode("utf-8", "surrogatepass"), path, field)
    if not isinstance(meta, dict):
        raise bad(path, field, "a JSON object", type_name(meta))
    return meta


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
        if dt not in ("float16", "float32", "float64", "bfloat16"):
            raise bad(path, f"tensor {k!r} dtype", "a floating-point dtype", dt)
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise bad(path, f"tensor {extra[0]!r}", f"only the tensors of {what} ({len(expected)})",
                  f"{len(extra)} unexpected tensor{'s' if len(extra) > 1 else ''}: {_short(extra, 120)}")


def shard_path(path: str, rank: int, world: int) -> str:
    """Rank r's file of a sharded checkpoint: "<stem>.rank<r>-of-<n><suffix>"."""
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}-of-{world}{suffix}"


def file_format(path):
    """"npz" or "safetensors", from the suffix of a tpcore.save path."""
    if path.endswith(".npz"):
        return "npz"
    if path.endswith(".safetensors"):
        return "safetensors"
    raise ValueError(f"checkpoint path must end in .npz or .safetensors, got {path!r}")


def write_tensors_file(path, tensors, meta):
    """One of tpcore.save's files: tensors and tpcore's metadata (a JSON object)."""
    if file_format(path) == "npz":
        np.savez(path, **tensors, __metadata__=np.array(json.dumps(meta)))
    else:
        write_safetensors(path, tensors, {"tpcore": json.dumps(meta)})


def read_tensors_file(path):
    """(tensors, tpcore metadata) of one of tpcore.save's files; CheckpointError if corrupt."""
    if file_format(path) == "npz":
        tensors = read_npz(path, lazy=True)   # stored members read on indexing (pread), streamed
        meta = tensors.pop("__metadata__", None)
        if meta is None:
            return tensors, {}
        if meta.ndim != 0 or meta.dtype.kind != "U":
            raise bad(path, "array '__metadata__'", "a 0-d unicode string", f"{meta.dtype} of shape {meta.shape}")
        return tensors, _meta_json(path, str(meta), "__metadata__")
    tensors, meta = open_safetensors(path)   # read on indexing (pread), streamed by the loaders
    return tensors, _meta_json(path, meta.get("tpcore", "{}"), "__metadata__['tpcore']")


# A Hugging Face checkpoint folder: its safetensors files and index -------------------
def index_files(path: str):
    """The safetensors files of a Hugging Face checkpoint folder, with the tensor -> file
    map of its *.safetensors.index.json when it has one (checked: an object whose
    weight_map names plain files of the folder).  Without an index: every *.safetensors."""
    idx = os.path.join(path, MODEL_FILE + ".index.json")
    found = sorted(glob.glob(os.path.join(path, "*.safetensors.index.json")))
    if not os.path.exists(idx):
        if len(found) > 1:
            raise bad(path, "index", "one *.safetensors.index.json", f"{len(found)}: "
                      f"{[os.path.basename(f) for f in found]}")
        idx = found[0] if found else None
    if idx is None:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        return files, None, None
    f = ConfigFields(read_json_object(idx), idx)
    wm = f.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise f.fail("weight_map", "an object of tensor name -> file name", type_name(wm))
    for name, fn in wm.items():
        if not (isinstance(fn, str) and fn and fn == os.path.basename(fn) and fn not in (".", "..")
                and fn.endswith(".safetensors")):
            raise f.fail(f"weight_map[{name!r}]", "the name of a .safetensors file in the folder", type_name(fn))
        if not os.path.isfile(os.path.join(path, fn)):
            raise f.fail(f"weight_map[{name!r}]", "an existing file of the folder", f"{fn!r}, which is missing")
    return [os.path.join(path, fn) for fn in sorted(set(wm.values()))], wm, idx


def read_headers(path: str):
    """{tensor name: (file, TensorInfo)} over every file of the checkpoint, headers checked
    (no tensor data read): a name in two files, or a file and its index disagreeing, is a
    CheckpointError."""
    files, wm, idx = index_files(path)
    out = {}
    for fn in files:
        header, _, _ = read_safetensors_header(fn)
        for name, info in header.items():
            if name in out:
                raise bad(fn, f"tensor {name!r}", "each tensor in one file", f"it also in {out[name][0]}")
            if wm is not None and wm.get(name) != os.path.basename(fn):
                raise bad(idx, f"weight_map[{name!r}]", f"{os.path.basename(fn)!r} (the file that holds it)",
                          type_name(wm.get(name)) if name in wm else "no entry")
            out[name] = (fn, info)
    if wm is not None:
        for name, fn in wm.items():
            if name not in out:
                raise bad(os.path.join(path, fn), f"tensor {name!r}", f"the tensor (as {os.path.basename(idx)} says)",
                          "no such tensor")
    return out


def open_tensors(path: str, headers=None) -> Dict[str, object]:
    """Every tensor of a Hugging Face checkpoint folder, as FileTensors read on indexing
    (open_safetensors; headers checked; headers: read_headers(path) when the caller has it)."""
    headers = read_headers(path) if headers is None else headers
    starts = {}
    out = {}
    for name, (fn, info) in headers.items():
        if fn not in starts:
            starts[fn] = read_safetensors_header(fn)[2]
        out[name] = FileTensor(fn, name, info.dtype, info.shape, starts[fn] + info.begin)
    return out



# A model folder (TransformerLM.save_pretrained, from_pretrained) ------------------------
HF_CONFIG = "config.json"                   # Hugging Face's config
GENERATION_CONFIG = "generation_config.json"
OWN_CONFIG = "tpcore_config.json"           # tpcore's: Config's fields
MODEL_FILE = "model.safetensors"            # full tensors (tpcore's names, or Hugging Face's)
OWN_PARAM = re.compile(r"param\.(0|[1-9][0-9]*)")  # the tensors of a shard file: parameters() in order


def own_shard_file(folder: str, rank: int, world: int) -> str:
    """model.rank<r>-of-<n>.safetensors: rank r's parameters (save_pretrained(sharded=True))."""
    return shard_path(os.path.join(folder, MODEL_FILE), rank, world)


def own_shard_files(folder: str):
    return sorted(glob.glob(os.path.join(folder, "model.rank*-of-*.safetensors")))


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def write_own_config(folder: str, cfg) -> None:
    """tpcore_config.json: the fields of a Config (a dataclass)."""
    write_json(os.path.join(folder, OWN_CONFIG), dataclasses.asdict(cfg))


def read_own_config(p: str, cls, choices: Dict[str, tuple]):
    """tpcore_config.json: an object of cls's fields (a Config), each checked, then cls(**fields)
    (whose own checks apply the value rules, written once); choices: the allowed strings of
    the fields norm, activation and positions."""
    d = read_json_object(p)
    f = ConfigFields(d, p)
    fields = {x.name for x in dataclasses.fields(cls)}
    kw = {}
    for k in d:
        if k not in fields:
            raise f.fail(k, f"one of Config's fields ({', '.join(sorted(fields))})", "an unknown field")
        if k in ("vocab_size", "hidden", "layers", "heads", "max_positions"):
            kw[k] = f.int(k)
        elif k in ("kv_heads", "ffn_hidden", "head_dim", "sliding_window"):
            kw[k] = f.int(k, null=True)
        elif k == "type_vocab_size":
            kw[k] = f.int(k, lo=0)
        elif k in ("eps", "rope_theta"):
            kw[k] = f.num(k, positive=False)
        elif k in choices:
            kw[k] = f.str(k, choices=choices[k])
        elif k == "model_type":
            kw[k] = f.str(k)
        elif k in ("experts", "experts_per_token"):
            kw[k] = f.int(k, lo=0)
        elif k == "router_aux_loss_coef":
            kw[k] = f.num(k, positive=False)
        elif k in ("attn_scale", "attn_softcap", "final_softcap", "embed_scale", "rope_local_theta"):
            kw[k] = None if d[k] is None else f.num(k)
        elif k in ("qkv_bias", "out_bias", "mlp_bias"):
            kw[k] = None if d[k] is None else f.bool(k)
        elif k == "rope_scaling":
            kw[k] = f.obj(k) or None
        elif k == "layer_types":
            v = d[k]
            if v is not None and not (isinstance(v, list) and all(isinstance(t, str) for t in v)):
                raise f.fail(k, "a list of layer types or null", type_name(v))
            kw[k] = None if v is None else tuple(v)
        else:
            kw[k] = f.bool(k)
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        raise bad(p, "config", "a consistent configuration", str(e)) from e


def write_own_shard(folder: str, rank: int, world: int, params) -> None:
    """Rank r's parameters, in order, as param.<i>, with its rank and world in the metadata."""
    tensors = {f"param.{i}": np.ascontiguousarray(p) for i, p in enumerate(params)}
    write_safetensors(own_shard_file(folder, rank, world), tensors,
                      {"format": "tpcore-sharded", "world": str(world), "rank": str(rank)})


def count_own_shards(folder: str, world: int) -> int:
    """The values the world shard files of a sharded save_pretrained checkpoint hold, every
    file checked first (headers only): it exists, its metadata names its rank and world, it
    holds tensors param.<i> of a float dtype."""
    total = 0
    for r in range(world):
        fn = own_shard_file(folder, r, world)
        if not os.path.exists(fn):
            raise bad(fn, "file", f"rank {r}'s shard of a {world}-rank checkpoint", "no such file")
        header, meta, _ = read_safetensors_header(fn)
        for k, want in (("world", str(world)), ("rank", str(r))):
            if k in meta and meta[k] != want:
                raise bad(fn, f"__metadata__[{k!r}]", repr(want), repr(meta[k]))
        for name, info in header.items():
            if not OWN_PARAM.fullmatch(name):
                raise bad(fn, f"tensor {name!r}", "tensors named param.<i>", "another name")
            if not info.floating:
                raise bad(fn, f"tensor {name!r} dtype", "a floating-point dtype", info.dtype)
            total += math.prod(info.shape)
    return total


def read_generation_config(folder: str) -> dict:
    """eos_token_id, pad_token_id and the sampling defaults (temperature, top_p, top_k, min_p,
    repetition_penalty, do_sample) of generation_config.json, checked ({} without the file)."""
    p = os.path.join(folder, GENERATION_CONFIG)
    if not os.path.exists(p):
        return {}
    f = ConfigFields(read_json_object(p), p)
    out = {}
    for k in ("eos_token_id", "pad_token_id"):
        v = f.get(k, None)
        if v is None:
            continue
        ids = v if isinstance(v, list) and k == "eos_token_id" else [v]
        if not ids or not all(is_int(x) and x >= 0 for x in ids):
            raise f.fail(k, "a non-negative integer" + (" or a list of them" if k == "eos_token_id" else ""),
                         type_name(v))
        out[k] = v
    # the sampling defaults (their ranges are checked where they are used: SamplingParams.make)
    for k in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if f.get(k, None) is not None:
            out[k] = f.num(k, positive=False)
    if f.get("top_k", None) is not None:
        out["top_k"] = f.int("top_k", lo=-1)
    if f.get("do_sample", None) is not None:
        out["do_sample"] = f.bool("do_sample")
    return out
