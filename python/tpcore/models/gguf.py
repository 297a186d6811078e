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

Architectures: Llama (and Mistral converted as Llama; SmolLM2, TinyLlama...) and GPT-2.
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

__all__ = ["read_gguf", "GGUFModel", "LazyTensor", "QuantRows", "tokenizer", "unpermute_rows", "part_of", "is_gguf",
           "CheckpointError"]

_MAGIC = b"GGUF"
_MISSING = object()
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
    row perm[i]."""

    def __init__(self, path: str, t, perm: Optional[np.ndarray] = None):
        self.path, self.name = path, t.name
        self.type_name = t.type
        self.block, self.type_size = t.block, t.type_size
        self.shape = shape = t.shape                          # outermost first: (rows, cols)
        self.n = shape[0] if len(shape) == 2 else 1
        self.cols = shape[-1]
        self.offset = t.offset
        self.row_bytes = t.nbytes // self.n
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
_PART_RE = re.compile(r"blocks\.\d+\.(attn\.[qkv]|attn\.out|mlp\.fc[12])\.weight$")
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
    return _PART[m.group(1)] if m else None


# The metadata --------------------------------------------------------------------------
_INTS = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
_ARCHS = ("llama", "mistral", "gpt2")


class _Meta:
    """Typed access to a GGUF file's key/value fields (`tpcore.io.gguf.Field`); a missing or
    mistyped key is a CheckpointError naming the file and the key."""

    def __init__(self, path: str, fields):
        self.path, self.fields = path, fields

    def _field(self, key, default):
        f = self.fields.get(key)
        if f is None:
            if default is _MISSING:
                raise bad(self.path, f"metadata key {key!r}", "the key (GGUF metadata)", "no such key in the file")
            return None
        return f

    def _kind(self, f):
        return list(f.kinds)

    def int(self, key, default=_MISSING, lo: int = 1):
        f = self._field(key, default)
        if f is None:
            return default
        kinds = self._kind(f)
        if len(kinds) != 1 or kinds[0] not in _INTS:
            raise bad(self.path, f"metadata key {key!r}", "an integer", f"a value of type {'/'.join(kinds)}")
        v = int(f.contents())
        if v < lo or v > 2 ** 31 - 1:
            raise bad(self.path, f"metadata key {key!r}", f"an integer in [{lo}, 2**31)", v)
        return v

    def num(self, key, default=_MISSING, positive: bool = True):
        f = self._field(key, default)
        if f is None:
            return default
        kinds = self._kind(f)
        if len(kinds) != 1 or kinds[0] not in _INTS + ("FLOAT32", "FLOAT64"):
            raise bad(self.path, f"metadata key {key!r}", "a number", f"a value of type {'/'.join(kinds)}")
        v = float(f.contents())
        if not np.isfinite(v) or v < 0 or (positive and v == 0):
            raise bad(self.path, f"metadata key {key!r}", "a finite number > 0" if positive else "a finite number >= 0",
                      v)
        return v

    def str(self, key, default=_MISSING):
        f = self._field(key, default)
        if f is None:
            return default
        if self._kind(f) != ["STRING"]:
            raise bad(self.path, f"metadata key {key!r}", "a string", f"a value of type {'/'.join(self._kind(f))}")
        try:
            return f.contents()
        except UnicodeDecodeError as e:
            raise bad(self.path, f"metadata key {key!r}", "a UTF-8 string", "invalid UTF-8") from e

    def bool(self, key, default=_MISSING):
        f = self._field(key, default)
        if f is None:
            return default
        if self._kind(f) != ["BOOL"]:
            raise bad(self.path, f"metadata key {key!r}", "a boolean", f"a value of type {'/'.join(self._kind(f))}")
        return bool(f.contents())

    def strings(self, key, default=_MISSING):
        f = self._field(key, default)
        if f is None:
            return default
        if self._kind(f) != ["ARRAY", "STRING"]:
            raise bad(self.path, f"metadata key {key!r}", "an array of strings",
                      f"a value of type {'/'.join(self._kind(f))}")
        try:
            return f.contents()
        except UnicodeDecodeError as e:
            raise bad(self.path, f"metadata key {key!r}", "UTF-8 strings", "invalid UTF-8") from e

    def ints(self, key, default=_MISSING):
        f = self._field(key, default)
        if f is None:
            return default
        kinds = self._kind(f)
        if len(kinds) != 2 or kinds[0] != "ARRAY" or kinds[1] not in _INTS:
            raise bad(self.path, f"metadata key {key!r}", "an array of integers", f"a value of type {'/'.join(kinds)}")
        return [int(x) for x in f.contents()]


def _config(m: _Meta, arch: str, n_tokens: Optional[int]) -> Dict[str, Any]:
    """The Config fields the metadata describes (tie_embeddings aside: the tensors say)."""
    a = arch
    if m.int(f"{a}.expert_count", 0, lo=0):
        raise bad(m.path, f"metadata key '{a}.expert_count'", "0 (mixture-of-experts models are not supported)",
                  m.int(f"{a}.expert_count", 0, lo=0))
    C = m.int(f"{a}.embedding_length")
    H = m.int(f"{a}.attention.head_count")
    kw: Dict[str, Any] = {}
    vocab = m.int(f"{a}.vocab_size", None)
    if vocab is None:
        if n_tokens is None:
            raise bad(m.path, f"metadata key '{a}.vocab_size'", "the vocabulary size (or tokenizer.ggml.tokens)",
                      "neither key in the file")
        vocab = n_tokens
    if a == "gpt2":
        if C % H:
            raise bad(m.path, f"metadata key '{a}.attention.head_count'", f"a divisor of {a}.embedding_length ({C})", H)
        kw = dict(norm="layernorm", eps=m.num(f"{a}.attention.layer_norm_epsilon", 1e-5), activation="gelu_tanh",
                  positions="learned", bias=True, kv_heads=H, model_type="gpt2")
    else:
        kv = m.int(f"{a}.attention.head_count_kv", H)
        if H % kv:
            raise bad(m.path, f"metadata key '{a}.attention.head_count_kv'", f"a divisor of head_count ({H})", kv)
        D = m.int(f"{a}.attention.key_length", None)
        if D is None:
            if C % H:
                raise bad(m.path, f"metadata key '{a}.attention.head_count'", f"a divisor of embedding_length ({C})", H)
            D = C // H
        if m.int(f"{a}.attention.value_length", D) != D:
            raise bad(m.path, f"metadata key '{a}.attention.value_length'", f"key_length ({D})",
                      m.int(f"{a}.attention.value_length"))
        rot = m.int(f"{a}.rope.dimension_count", D)
        if rot != D:
            raise bad(m.path, f"metadata key '{a}.rope.dimension_count'",
                      f"the head width {D} (partial rotary embeddings are not supported)", rot)
        scaling = m.str(f"{a}.rope.scaling.type", "none")
        if scaling not in ("none", "") or m.num(f"{a}.rope.scale_linear", 1.0) != 1.0:
            raise bad(m.path, f"metadata key '{a}.rope.scaling.type'", "none (rope scaling is not supported)",
                      scaling)
        kw = dict(kv_heads=kv, head_dim=D if D * H != C else None, norm="rmsnorm",
                  eps=m.num(f"{a}.attention.layer_norm_rms_epsilon", positive=False), activation="swiglu",
                  positions="rope", rope_theta=m.num(f"{a}.rope.freq_base", 10000.0), bias=False, model_type="llama")
    return dict(vocab_size=vocab, hidden=C, layers=m.int(f"{a}.block_count"), heads=H,
                ffn_hidden=m.int(f"{a}.feed_forward_length"),
                max_positions=m.int(f"{a}.context_length", 2048), **kw)


def _layout(cfg: Config, arch: str, untied: bool):
    """{tpcore name: [(GGUF tensor, first row, rows, permute heads or 0)]} and {GGUF name:
    the shape the config implies, as (rows, cols) or (n,)}: everything tpcore reads."""
    C, V, F, L = cfg.hidden, cfg.vocab_size, cfg.ffn_hidden, cfg.layers
    H, Hk, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    src: Dict[str, list] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}

    def one(ours, theirs, shape, heads=0, first=0, rows=None):
        shapes[theirs] = shape
        src.setdefault(ours, []).append((theirs, first, shape[0] if rows is None else rows, heads))
    one("wte.weight", "token_embd.weight", (V, C))
    if untied:
        one("lm_head.weight", "output.weight", (V, C))
    if arch == "gpt2":
        one("wpe.weight", "position_embd.weight", (cfg.max_positions, C))
        for w in ("weight", "bias"):
            one(f"final_norm.{w}", f"output_norm.{w}", (C,))
        for i in range(L):
            q, p = f"blocks.{i}.", f"blk.{i}."
            for w in ("weight", "bias"):
                one(q + f"norm1.{w}", p + f"attn_norm.{w}", (C,))
                one(q + f"norm2.{w}", p + f"ffn_norm.{w}", (C,))
                for j, n in enumerate("qkv"):
                    one(q + f"attn.{n}.{w}", p + f"attn_qkv.{w}", (3 * C, C) if w == "weight" else (3 * C,),
                        first=j * C, rows=C)
                one(q + f"attn.out.{w}", p + f"attn_output.{w}", (C, C) if w == "weight" else (C,))
                one(q + f"mlp.fc1.{w}", p + f"ffn_up.{w}", (F, C) if w == "weight" else (F,))
                one(q + f"mlp.fc2.{w}", p + f"ffn_down.{w}", (C, F) if w == "weight" else (C,))
        return src, shapes
    one("final_norm.weight", "output_norm.weight", (C,))
    for i in range(L):
        q, p = f"blocks.{i}.", f"blk.{i}."
        one(q + "norm1.weight", p + "attn_norm.weight", (C,))
        one(q + "norm2.weight", p + "ffn_norm.weight", (C,))
        one(q + "attn.q.weight", p + "attn_q.weight", (H * D, C), heads=H)
        one(q + "attn.k.weight", p + "attn_k.weight", (Hk * D, C), heads=Hk)
        one(q + "attn.v.weight", p + "attn_v.weight", (Hk * D, C))
        one(q + "attn.out.weight", p + "attn_output.weight", (C, H * D))
        one(q + "mlp.fc1.weight", p + "ffn_gate.weight", (F, C))
        one(q + "mlp.fc1.weight", p + "ffn_up.weight", (F, C))
        one(q + "mlp.fc2.weight", p + "ffn_down.weight", (C, F))
    return src, shapes


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
                     "a tensor tpcore has no place for (rope_freqs: rope scaling; biases, experts...: "
                     "a feature this architecture does not have here)")
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
        if arch not in _ARCHS:
            raise bad(path, "metadata key 'general.architecture'", f"one of {', '.join(_ARCHS)}", arch)
        tf = m.fields.get("tokenizer.ggml.tokens")
        if tf is not None and tf.kinds != ("ARRAY", "STRING"):
            raise bad(path, "metadata key 'tokenizer.ggml.tokens'", "an array of strings", "/".join(tf.kinds))
        n_tokens = None if tf is None else tf.count        # the strings are decoded only by tokenizer()
        kw = _config(m, arch, n_tokens)
        # every count the layout is sized by, against what the file holds: a forged block_count
        # must not size a loop (or a dict) of 2**31 layers before the first missing tensor
        if kw["layers"] > len(by_name):
            raise bad(path, f"metadata key '{arch}.block_count'",
                      f"at most the number of tensors in the file ({len(by_name)}): each layer has its own",
                      kw["layers"])
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
        src, shapes = _layout(cfg, arch, untied)
        parts = _check_tensors(path, arch, cfg, by_name, shapes)
        perms: Dict[Tuple[str, int], _Part] = {}
        self._rows: Dict[str, _Rows] = {}
        for ours, items in src.items():
            ps = []
            for theirs, first, n, heads in items:
                p = parts[theirs]
                if heads and arch in ("llama", "mistral"):   # llama.cpp's Q/K row order -> Hugging Face's
                    key = (theirs, heads)
                    if key not in perms:
                        perms[key] = _Part(path, by_name[theirs], unpermute_rows(p.shape[0], heads))
                    p = perms[key]
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
        The tpcore Config from the metadata (Llama family or GPT-2; tied when the file
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
# tokenizer.ggml.pre -> how text is split before BPE (as llama.cpp's pre-tokenizer types):
# GPT-2's byte-level regex, SmolLM's (digits one by one, then GPT-2's)
_PRE = ("default", "gpt2", "smollm")


def tokenizer(path):
    """A `tokenizers.Tokenizer` built from a GGUF file's vocabulary and merges.

    Byte-level BPE files (tokenizer.ggml.model "gpt2") with the GPT-2 or SmolLM
    pre-tokenizer; the control tokens (token type 3, e.g. <|im_start|>) are special
    tokens, parsed in text.  No BOS is added (as tokenizer.ggml.add_bos_token says;
    add it yourself where the file asks for one).

    Raises
    ------
    ImportError
        `tokenizers` is missing.
    CheckpointError
        A file without a byte-level BPE vocabulary, or with another pre-tokenizer.
    """
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError as e:
        raise ImportError("tpcore.models.gguf.tokenizer needs the `tokenizers` package: pip install tokenizers") from e
    g = path if isinstance(path, GGUFModel) else GGUFModel(path, "tokenizer")
    m = _Meta(g.path, g.file.fields)
    kind = m.str("tokenizer.ggml.model")
    if kind != "gpt2":
        raise bad(g.path, "metadata key 'tokenizer.ggml.model'", "'gpt2' (byte-level BPE; others are not supported)",
                  kind)
    pre = m.str("tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        raise bad(g.path, "metadata key 'tokenizer.ggml.pre'", f"one of {', '.join(_PRE)}", pre)
    tokens = m.strings("tokenizer.ggml.tokens")
    merges = m.strings("tokenizer.ggml.merges")
    types = m.ints("tokenizer.ggml.token_type", [1] * len(tokens))
    if len(types) != len(tokens):
        raise bad(g.path, "metadata key 'tokenizer.ggml.token_type'", f"{len(tokens)} entries", len(types))
    pairs = []
    for i, mg in enumerate(merges):
        a, sep, b = mg.partition(" ")
        if not sep or not a or not b:
            raise bad(g.path, f"metadata key 'tokenizer.ggml.merges' entry {i}", "two tokens separated by a space", mg)
        pairs.append((a, b))
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    byte = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte]) \
        if pre == "smollm" else byte
    tk.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    if special:
        tk.add_special_tokens(special)
    return tk
