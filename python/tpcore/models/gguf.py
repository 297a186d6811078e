"""GGUF files (llama.cpp's format) as tpcore models: the config from the metadata, the
tensors under tpcore's names, the tokenizer.

    cfg, tensors, tok = tpcore.models.gguf.read_gguf("model.gguf")
    model = tpcore.models.from_gguf("model.gguf", comm)      # or from_pretrained(path)
    tk = tpcore.models.gguf.tokenizer("model.gguf")                  # a `tokenizers.Tokenizer`

The header, metadata and tensor infos are read by `tpcore.io.gguf.GGUFFile` (tpcore's own
reader: every count and length checked against the file before anything is sized by it,
the tensors' offsets, alignment and spans as llama.cpp's loader checks them); the block
formats are dequantized by `tpcore.quant` (bit for bit as llama.cpp's own dequantizers;
no optional package is needed to load).  The tensor data is read with pread: a
tensor is handed out as a lazy view whose indexing reads and dequantizes only the
selected rows (and, for a column slice, only the quantization blocks that cover it),
so a rank loading its shard touches only its part of the file.

Architectures: llama (Llama 1-3, Mistral, Mixtral, SmolLM2, TinyLlama...), qwen2, qwen3,
qwen3moe, gemma2, gemma3, phi3 and gpt2: `tpcore.models.gguf_arch` reads each one's
metadata and names its tensors.
llama.cpp's converter reorders the rows of attn_q / attn_k within every head (Hugging
Face's rotate-half RoPE pairs dimension i with i + D/2; llama.cpp's rotates adjacent
pairs 2i, 2i+1), and tpcore computes RoPE as Hugging Face does, so those rows are put
back (`unpermute_rows`).  A row permutation moves whole rows; quantization blocks run
along a row, so it applies to quantized rows unchanged.

A file that is not GGUF, is truncated, lacks a key or a tensor, or whose tensors
disagree with its metadata or with each other (offsets, alignment, type x shape against
the span, a type the tensor cannot have) raises tpcore.CheckpointError (a ValueError)
naming the file and the key or tensor, before anything is sized by the file's counts.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from tpcore.io.formats import HF_CONFIG, OWN_CONFIG, CheckpointError, bad
from tpcore.io.formats import split_row_index
from tpcore.nn.config import Config
from tpcore.models.gguf_arch import ARCHS, PERMUTED, Meta as _Meta, config_kwargs, layout

__all__ = ["read_gguf", "GGUFModel", "LazyTensor", "QuantRows", "tokenizer", "unpermute_rows", "part_of", "is_gguf",
           "CheckpointError"]

_MAGIC = b"GGUF"
# GGUF tensor types this module hands out.  The quantized ones are those tpcore.quant
# stores as they are (QuantTensor formats); the float ones are converted to float32.
_FLOAT_TYPES = ("F32", "F16", "BF16")
_QUANT_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}


def _dequantize(raw: np.ndarray, type_name: str, cols: int) -> np.ndarray:
    """Rows of raw bytes (uint8, (rows, row_bytes)) of a GGUF type as float32 (rows, cols):
    the float types converted, the block formats by tpcore.quant (bit for bit as llama.cpp's
    dequantizers)."""
    raw = np.ascontiguousarray(raw)
    if type_name == "F32":
        return raw.view("<f4").astype(np.float32, copy=False)
    if type_name == "F16":
        return raw.view("<f2").astype(np.float32)
    if type_name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    from tpcore.nn.quant import dequantize
    return dequantize(raw, _QUANT_TYPES[type_name], cols)


def is_gguf(path) -> bool:
    """Whether path is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == _MAGIC
    except OSError:
        return False


def gguf_file(path) -> Optional[str]:
    """The GGUF file from_pretrained loads for path: path itself when it is a file ending in
    .gguf (or starting with the GGUF magic), the one .gguf of a directory without a
    config.json / tpcore_config.json; None: not a GGUF checkpoint.  A directory with
    several .gguf files (and no config) is a ValueError listing them."""
    p = os.fspath(path)
    if p.lower().endswith(".gguf") and not os.path.isdir(p):
        return p                          # (a missing one: from_gguf's FileNotFoundError names it)
    if os.path.isfile(p):
        return p if is_gguf(p) else None
    if not os.path.isdir(p) or os.path.exists(os.path.join(p, OWN_CONFIG)) or \
            os.path.exists(os.path.join(p, HF_CONFIG)):
        return None
    found = sorted(f for f in os.listdir(p) if f.lower().endswith(".gguf") and os.path.isfile(os.path.join(p, f)))
    if len(found) > 1:
        raise ValueError(f"from_pretrained: {p!r} holds {len(found)} GGUF files ({', '.join(found)}); pass the one "
                         f"to load")
    return os.path.join(p, found[0]) if found else None


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's Q/K permutation: a tensor of `rows` rows in
    `heads` heads, as stored in a GGUF file (g), is Hugging Face's (h = g[perm]).

    llama.cpp's converter reshapes each head's D rows as (2, D/2), swaps the axes and
    flattens: GGUF row 2*i + j of a head is Hugging Face row j*D/2 + i (j in {0, 1},
    i < D/2).  So Hugging Face row r of a head is GGUF row 2*(r % (D/2)) + r // (D/2)."""
    if heads < 1 or rows % heads or (rows // heads) % 2:
        raise ValueError(f"unpermute_rows: {rows} rows do not split into {heads} heads of an even width")
    D = rows // heads
    r = np.arange(D)
    within = 2 * (r % (D // 2)) + r // (D // 2)
    return (np.arange(heads)[:, None] * D + within[None, :]).reshape(-1)


class _Part:
    """One GGUF tensor's rows as raw bytes, shape (rows, row_bytes) (a 1-D tensor: one row),
    read from the file with pread on demand (never through a memory map, so a load keeps
    no file pages resident); perm (optional): the tensor's row i is the file's
    row perm[i]; expert (optional): the matrix `expert` of a 3-D tensor (E, rows, cols)."""

    def __init__(self, path: str, t, perm: Optional[np.ndarray] = None, expert: Optional[int] = None):
        self.path, self.name = path, t.name
        self.type_name = t.type
        self.block, self.type_size = t.block, t.type_size
        shape, self.offset, nbytes = t.shape, t.offset, t.nbytes   # outermost first: (rows, cols)
        if expert is not None:           # one matrix of a 3-D tensor (the experts stacked, (E, rows, cols))
            nbytes //= shape[0]
            self.offset += expert * nbytes
            shape = shape[1:]
        self.shape = shape
        self.n = shape[0] if len(shape) == 2 else 1
        self.cols = shape[-1]
        self.row_bytes = nbytes // self.n if len(shape) <= 2 else nbytes
        self.perm = perm

    def _bytes(self, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Bytes lo:hi of the file's rows (uint8, (len(rows), hi - lo)); a short read is a
        CheckpointError naming the file and tensor."""
        from tpcore.io.stream import read_rows
        out = np.empty((rows.size, hi - lo), np.uint8)
        read_rows(self.path, self.name, self.offset, self.row_bytes, rows, lo, hi, out)
        return out

    def read(self, rows: np.ndarray, cols: Optional[slice]) -> np.ndarray:
        """float32 rows (indices into this tensor's rows) and columns (a step-1 slice or
        None: all), dequantizing only the blocks that cover the columns."""
        rows = np.atleast_1d(np.asarray(rows, np.int64))
        if self.perm is not None:
            rows = self.perm[rows]
        if cols is None:
            return _dequantize(self._bytes(rows, 0, self.row_bytes), self.type_name, self.cols)
        lo, hi, _ = cols.indices(self.cols)
        b0, b1 = lo // self.block, -(-hi // self.block) if hi > lo else lo // self.block
        raw = self._bytes(rows, b0 * self.type_size, b1 * self.type_size)
        out = _dequantize(raw, self.type_name, (b1 - b0) * self.block)
        return out[:, lo - b0 * self.block:hi - b0 * self.block]

    def raw_rows(self, rows: np.ndarray) -> np.ndarray:
        rows = np.atleast_1d(np.asarray(rows, np.int64))
        if self.perm is not None:
            rows = self.perm[rows]
        return self._bytes(rows, 0, self.row_bytes)


class _Rows:
    """A tpcore tensor made of GGUF tensors' rows: one tensor, its rows permuted (Q/K), a
    cut of one (GPT-2's fused attn_qkv into q, k, v), or several stacked (SwiGLU's
    [gate; up]).  Holds no data: `lazy` reads float32, `raw_rows` the stored bytes."""

    def __init__(self, parts: List[Tuple[_Part, int, int]], shape: Tuple[int, ...]):
        self.parts, self.shape = parts, shape   # parts: (part, first row in it, rows taken)

    def read(self, rows: np.ndarray, cols: Optional[slice]) -> np.ndarray:
        ncols = len(range(*cols.indices(self.shape[-1]))) if cols is not None else self.shape[-1]
        out = np.empty((rows.size, ncols), np.float32)
        off = 0
        for part, first, n in self.parts:
            sel = (rows >= off) & (rows < off + n)
            if sel.any():
                out[sel] = part.read(rows[sel] - off + first, cols)
            off += n
        return out

    def vector(self) -> np.ndarray:
        """A 1-D tensor (norm weights, biases; a cut of GPT-2's fused qkv bias): read whole."""
        return np.concatenate([p.read(np.zeros(1, np.int64), None)[0][first:first + n] for p, first, n in self.parts])

    def raw_rows(self, rows: np.ndarray) -> np.ndarray:
        rows = np.atleast_1d(np.asarray(rows, np.int64))
        part0 = self.parts[0][0]
        out = np.empty((rows.size, part0.row_bytes), np.uint8)
        off = 0
        for part, first, n in self.parts:
            sel = (rows >= off) & (rows < off + n)
            if sel.any():
                out[sel] = part.raw_rows(rows[sel] - off + first)
            off += n
        return out

    def type_name(self) -> str:
        return self.parts[0][0].type_name


class LazyTensor:
    """A tensor of a GGUF file as float32, read on indexing: ``t[rows]`` / ``t[rows,
    cols]`` follow NumPy's rules for the first axis and dequantize only the selected rows
    (and the blocks covering a column slice).  ``np.asarray(t)`` reads all of it."""

    def __init__(self, rows: _Rows):
        self._r = rows
        self.shape = rows.shape
        self.ndim = len(self.shape)
        self.dtype = np.dtype(np.float32)
        self.gguf_type = rows.type_name()

    def __getitem__(self, key) -> np.ndarray:
        if self.ndim == 1:   # a 1-D tensor (norm weights, biases): small, read whole
            return self._r.vector()[key]
        rows, scalar, rest = split_row_index(key, self.shape[0])
        rows = np.atleast_1d(rows).astype(np.int64)
        cols = None
        if rest and isinstance(rest[0], slice) and rest[0].step in (None, 1):
            cols, rest = rest[0], rest[1:]
        out = self._r.read(rows, cols)
        if rest:
            out = out[(slice(None),) + tuple(rest)]
        return out[0] if scalar else out

    def __array__(self, dtype=None, copy=None):
        a = self[...]
        return a if dtype is None else a.astype(dtype)

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"LazyTensor(shape={self.shape}, gguf_type={self.gguf_type})"


class QuantRows:
    """A quantized tensor made of rows of GGUF tensors in another order (Q/K rows put
    back) or stacked ([gate; up]), kept in its format: ``t[rows]`` (and ``t[rows, a:b]``)
    is a `tpcore.quant.QuantTensor` of just those rows' stored bytes, read from the map on
    indexing; ``np.asarray(t)`` dequantizes all of it."""

    ndim = 2
    dtype = np.dtype(np.float32)   # what it reads as

    def __init__(self, rows: _Rows, fmt: str):
        self._r, self.fmt, self.shape = rows, fmt, rows.shape

    def __getitem__(self, key):
        from tpcore.nn.quant import QuantTensor
        rows, scalar, rest = split_row_index(key, self.shape[0])
        qt = QuantTensor(self.fmt, (np.size(rows), self.shape[1]), self._r.raw_rows(np.atleast_1d(rows)))
        if rest:
            qt = qt[(slice(None),) + tuple(rest)]
        return np.asarray(qt)[0] if scalar else qt

    def __array__(self, dtype=None, copy=None):
        a = self._r.read(np.arange(self.shape[0]), None)
        return a if dtype is None else a.astype(dtype)

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"QuantRows({self.fmt!r}, shape={self.shape})"


# tpcore's model parts (TransformerLM's dtype keys) by tensor
_PART = {"attn.q": "qkv", "attn.k": "qkv", "attn.v": "qkv", "attn.out": "out", "mlp.fc1": "fc1", "mlp.fc2": "fc2"}
_PART_RE = re.compile(r"blocks\.\d+\.(attn\.[qkv]|attn\.out|mlp\.fc[12]|moe\.experts\.\d+\.fc[12])\.weight$")
# the storage that holds a part whose tensors come in several formats (a "K_M" mix): the
# most bits per weight among them
_WIDTH = ("q4_0", "q4_k", "q4_1", "q5_k", "q6_k", "q8_0", "bfloat16", "float16", "float32")
_FLOAT_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def part_of(name: str) -> Optional[str]:
    """The TransformerLM dtype part ("embedding", "head", "qkv", "out", "fc1", "fc2") a
    tensor belongs to; None for norms, biases and position embeddings (always float32)."""
    if name == "wte.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "head"
    m = _PART_RE.match(name)
    return _PART[re.sub(r"moe\.experts\.\d+", "mlp", m.group(1))] if m else None


# The tensors against the metadata -------------------------------------------------
def _check_tensors(path: str, arch: str, cfg: Config, by_name: Dict[str, Any],
                   shapes: Dict[str, Tuple[int, ...]]) -> Dict[str, _Part]:
    """The file's tensors against the layout the metadata implies: none missing, none
    extra, each of the implied shape and of a type that tensor may have (1-D: F32, as
    llama.cpp's converter and quantizer write norms and biases; 2-D: a float type or a
    block format tpcore keeps).  {GGUF name: _Part}."""
    for name in by_name:
        if name not in shapes:
            mm = re.match(r"blk\.(\d+)\.", name)
            where = (f"a tensor of layer {mm.group(1)} but {arch}.block_count={cfg.layers}"
                     if mm and int(mm.group(1)) >= cfg.layers else
                     "a tensor tpcore has no place for (biases, norms, experts...: a feature this "
                     "architecture does not have here)")
            raise bad(path, f"tensor {name!r}", f"only the tensors of a {arch} model", where)
    parts: Dict[str, _Part] = {}
    for name, want in shapes.items():
        t = by_name.get(name)
        if t is None:
            raise bad(path, f"tensor {name!r}", f"a tensor of shape {want} (as the metadata says)",
                      "no such tensor in the file")
        if t.shape != want:
            raise bad(path, f"tensor {name!r}", f"shape {want} (as the metadata says)", f"shape {t.shape}")
        if len(want) == 1 and t.type != "F32":
            raise bad(path, f"tensor {name!r} type", "F32 for a 1-D tensor (norm weights and biases)", t.type)
        if t.type not in _FLOAT_TYPES and t.type not in _QUANT_TYPES:
            raise bad(path, f"tensor {name!r} type", f"one of {', '.join(_FLOAT_TYPES + tuple(_QUANT_TYPES))}",
                      t.type)
        parts[name] = _Part(path, t)
    return parts


class GGUFModel:
    """A GGUF file opened (its header, metadata and tensor infos read and checked by
    `tpcore.io.gguf.GGUFFile`; the tensor data read with pread when a tensor is indexed) and
    checked against its own metadata.

    Attributes: path, arch (general.architecture), config (a tpcore Config), names (the
    tpcore tensor names), tokenizer_info (a dict, see `read_gguf`), file (the
    `tpcore.io.gguf.GGUFFile`).  `tensor(name)` hands a tensor out; `state_dict()` all of them.
    """

    def __init__(self, path, who: str = "read_gguf"):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{who}: path must be a GGUF file (str or os.PathLike), got {type(path).__name__}")
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{who}: {path!r} is not a file")
        from tpcore.io.gguf import GGUFFile
        self.path, self.file = path, GGUFFile(path)
        by_name = {t.name: t for t in self.file.tensors}
        m = _Meta(path, self.file.fields)
        arch = m.str("general.architecture")
        if arch not in ARCHS:
            raise bad(path, "metadata key 'general.architecture'", f"one of {', '.join(ARCHS)}", arch)
        tf = m.fields.get("tokenizer.ggml.tokens")
        if tf is not None and tf.kinds != ("ARRAY", "STRING"):
            raise bad(path, "metadata key 'tokenizer.ggml.tokens'", "an array of strings", "/".join(tf.kinds))
        n_tokens = None if tf is None else tf.count        # the strings are decoded only by tokenizer()
        # every count the layout is sized by, against what the file holds: a forged block_count
        # must not size a loop (or a dict) of 2**31 layers before the first missing tensor
        if m.int(f"{arch}.block_count") > len(by_name):
            raise bad(path, f"metadata key '{arch}.block_count'",
                      f"at most the number of tensors in the file ({len(by_name)}): each layer has its own",
                      m.int(f"{arch}.block_count"))

        def vector(name, want):   # a 1-D F32 tensor the config is made of (rope factors), checked, read
            t = by_name.get(name)
            if t is None or t.shape != want or t.type != "F32":
                raise bad(path, f"tensor {name!r}", f"an F32 tensor of shape {want}",
                          "no such tensor" if t is None else f"{t.type} of shape {t.shape}")
            return _Part(path, t).read(np.zeros(1, np.int64), None)[0].astype(np.float64)
        kw, consumed = config_kwargs(m, arch, n_tokens, by_name, vector)
        untied = "output.weight" in by_name
        try:
            cfg = Config(tie_embeddings=not untied, **kw)
        except (TypeError, ValueError) as e:
            raise bad(path, "metadata", "a consistent model configuration", str(e)) from e
        if n_tokens is not None and n_tokens != cfg.vocab_size:
            raise bad(path, "metadata key 'tokenizer.ggml.tokens'", f"{cfg.vocab_size} tokens ({arch}.vocab_size)",
                      f"{n_tokens} tokens")
        tt = m.fields.get("tokenizer.ggml.token_type")
        if tt is not None and n_tokens is not None and tt.count != n_tokens:
            raise bad(path, "metadata key 'tokenizer.ggml.token_type'", f"{n_tokens} entries (one per token)",
                      f"{tt.count} entries")
        src, shapes = layout(cfg, arch, untied)
        parts = _check_tensors(path, arch, cfg, by_name, dict(shapes, **consumed))
        perms: Dict[Tuple[str, int], _Part] = {}
        self._rows: Dict[str, _Rows] = {}
        for ours, items in src.items():
            ps = []
            for theirs, first, n, heads, expert in items:
                p = parts[theirs]
                if heads and arch in PERMUTED:   # llama.cpp's Q/K row order -> Hugging Face's
                    key = (theirs, heads)
                    if key not in perms:
                        perms[key] = _Part(path, by_name[theirs], unpermute_rows(p.shape[0], heads))
                    p = perms[key]
                if expert is not None:           # expert e's matrix of a stacked (E, rows, cols) tensor
                    p = _Part(path, by_name[theirs], expert=expert)
                ps.append((p, first, n))
            rows = sum(n for _, _, n in ps)
            shape = (rows,) + ps[0][0].shape[1:] if len(ps[0][0].shape) == 2 else (rows,)
            self._rows[ours] = _Rows(ps, shape)
        self.arch, self.config, self.names = arch, cfg, list(self._rows)
        self.tokenizer_info = _tokenizer_info(m, n_tokens)

    def _tensor(self, name: str, quantized: bool = False):
        """The one place that decides how a tensor is handed out: a float32 LazyTensor, or
        (quantized) its stored rows in tpcore's row order, as they are: a
        QuantRows (rows read from the file on indexing); a float-typed tensor stays a
        LazyTensor."""
        r = self._rows[name]
        if not quantized or len(r.shape) == 1:
            return LazyTensor(r)
        types = {p.type_name for p, _, _ in r.parts}
        if len(types) != 1:
            raise bad(self.path, f"tensor {name!r}", "its GGUF tensors in one format to keep it quantized",
                      f"formats {sorted(types)}")
        tn = types.pop()
        if tn in _FLOAT_TYPES:
            return LazyTensor(r)
        return QuantRows(r, _QUANT_TYPES[tn])   # rows read from the file (pread) when indexed

    def tensor(self, name: str, quantized: bool = False):
        """A tensor by tpcore name (see `_tensor`)."""
        if name not in self._rows:
            raise KeyError(f"{self.path}: no tensor {name!r} in tpcore's names for this {self.arch} model")
        return self._tensor(name, quantized)

    def raw_rows(self, name: str, rows) -> np.ndarray:
        """The stored bytes of rows of a tpcore tensor (uint8, (len(rows), row_bytes)), in
        tpcore's row order."""
        return self._rows[name].raw_rows(np.asarray(rows, np.int64))

    def gguf_type(self, name: str) -> str:
        return self._rows[name].type_name()

    def state_dict(self, quantized: Any = False) -> Dict[str, Any]:
        """Every tensor tpcore needs, by tpcore name, lazily (nothing is read yet).
        quantized: True (every quantized tensor kept in its format), False (all float32),
        or the parts (see `part_of`) to keep in their format."""
        keep = (lambda n: quantized) if isinstance(quantized, bool) else (lambda n: part_of(n) in set(quantized))
        return {k: self._tensor(k, keep(k)) for k in self._rows}

    def model_dtypes(self) -> Dict[str, str]:
        """TransformerLM's dtype (a dict by part) that keeps the file's formats: each part
        in its tensors' format ("q4_1", "float16", ...; a tied head the embedding's).  A part
        whose tensors differ in format (llama.cpp's K_M mixes keep some layers' attn_v and
        ffn_down at q6_k) takes the widest of them, and the others are requantized to it on
        loading (close, not bit for bit)."""
        kinds: Dict[str, set] = {}
        for name, r in self._rows.items():
            part = part_of(name)
            if part is not None:
                for p, _, _ in r.parts:
                    kinds.setdefault(part, set()).add(_QUANT_TYPES.get(p.type_name) or _FLOAT_NAMES[p.type_name])
        out = {}
        for part, ks in kinds.items():
            floats = ks & set(_FLOAT_NAMES.values())
            out[part] = "float32" if len(floats) > 1 else max(ks, key=_WIDTH.index)
        out.setdefault("head", out["embedding"])
        return out


def _tokenizer_info(m: _Meta, n_tokens: Optional[int]) -> Dict[str, Any]:
    info: Dict[str, Any] = {"model": m.str("tokenizer.ggml.model", None), "pre": m.str("tokenizer.ggml.pre", None),
                            "n_tokens": n_tokens,
                            "chat_template": m.str("tokenizer.chat_template", None),
                            "add_bos_token": m.bool("tokenizer.ggml.add_bos_token", None),
                            "add_eos_token": m.bool("tokenizer.ggml.add_eos_token", None)}
    for k in ("bos", "eos", "unknown", "padding"):
        v = m.int(f"tokenizer.ggml.{k}_token_id", None, lo=0)
        if v is not None and n_tokens is not None and v >= n_tokens:
            raise bad(m.path, f"metadata key 'tokenizer.ggml.{k}_token_id'", f"a token id < {n_tokens}", v)
        info[f"{k}_token_id"] = v
    return info


def read_gguf(path) -> Tuple[Config, Dict[str, LazyTensor], Dict[str, Any]]:
    """A GGUF file's model: (config, tensors, tokenizer info).

    Parameters
    ----------
    path : str or os.PathLike
        The .gguf file.

    Returns
    -------
    (Config, dict of str to LazyTensor, dict)
        The tpcore Config from the metadata (see gguf_arch for the architectures; tied when the file
        has no output.weight); the full tensors under tpcore's names as lazy float32 views
        of the file (indexing dequantizes only the selected rows; Q/K rows
        already in Hugging Face's order), for `TransformerLM.load_state_dict_full`; the
        tokenizer's metadata (model, pre, n_tokens, bos/eos/unknown/padding_token_id,
        add_bos_token, add_eos_token, chat_template; None where absent).

    Raises
    ------
    FileNotFoundError
        path is not a file.
    CheckpointError
        Not a GGUF file, a truncated or corrupt one, a missing or mistyped key, a tensor
        missing, of another shape than the metadata implies, or of an unsupported type.
    """
    g = GGUFModel(path)
    return g.config, g.state_dict(), g.tokenizer_info


# The tokenizer -------------------------------------------------------------------------
def tokenizer(path, add_bos: Optional[bool] = False):
    """A `tokenizers.Tokenizer` built from a GGUF file's embedded vocabulary
    (`tpcore.models.gguf_tokenizer` says how each kind is built).

    Byte-level BPE files (tokenizer.ggml.model "gpt2") with the pre-tokenizers
    tokenizer.ggml.pre "default"/"gpt2", "smollm", "llama-bpe" (Llama 3) and "qwen2";
    SentencePiece BPE files (tokenizer.ggml.model "llama": Llama 2, Mistral, Phi-3, Gemma)
    with their merges rebuilt from the vocabulary and byte fallback.  The control tokens
    (token type 3, e.g. <|im_start|>) are special tokens, parsed in text.

    Parameters
    ----------
    path : str, os.PathLike or GGUFModel
    add_bos : bool or None, default False
        Put the BOS token first (True), not (False: the ids of the text alone), or as
        tokenizer.ggml.add_bos_token says (None).

    Raises
    ------
    ImportError
        `tokenizers` is missing.
    CheckpointError
        Another kind of vocabulary or pre-tokenizer (named, with the supported ones).
    """
    from tpcore.models.gguf_tokenizer import build
    g = path if isinstance(path, GGUFModel) else GGUFModel(path, "tokenizer")
    return build(g, _Meta(g.path, g.file.fields), add_bos)
