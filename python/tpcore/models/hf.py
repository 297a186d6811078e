"""Hugging Face checkpoints (GPT-2, BERT, and the decoder families of tpcore.nn.hf_config:
Llama 2/3, Mistral, Qwen 2/3, Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE): what their tensors
and config are in tpcore's terms, both ways.

One name map per architecture (name_map: a list of Entry) says which Hugging Face
tensors hold which tpcore tensors; from_hf reads it one way (a checkpoint's tensors
-> tpcore's full tensors, as lazy views: GPT-2's Conv1D weights are stored (in, out)
and its c_attn fuses [q | k | v] along out, Phi-3's qkv_proj fuses them along rows,
Llama's gate_proj and up_proj (Mixtral's experts' w1 and w3) stack into tpcore's fc1,
Gemma's norm weights w are read as 1 + w) and to_hf the other (save_pretrained(hf=True)).
Loading reads only a rank's slices of the files (with pread, streamed through one
staging buffer: tpcore.io.stream): its rows of the vocabulary, its heads' rows of
Q/K/V (of Phi-3's fused tensor too), its columns of the output and fc2 projections,
its rows of fc1.

Before anything is allocated, the config is checked against the files' headers
(expected_shapes, check_against_config): a config whose sizes the files do not hold
raises tpcore.CheckpointError naming the file, the tensor or field, what was
expected and what was found.  The file formats (safetensors, the index of a sharded
checkpoint, JSON) are _formats.py's; loading a folder into a model is
tpcore.models.from_pretrained's (this module never imports tpcore.models).
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from tpcore.io.formats import CheckpointError, bad, open_tensors, to_float32
from tpcore.io.formats import base_row_index, row_runs, split_row_index
from tpcore.io.stream import read_into
from tpcore.nn.config import GATED, Config
from tpcore.nn.hf_config import DECODERS, hf_config_dict

_open = open_tensors  # every tensor of a checkpoint folder, read on indexing (the tests' old name)


class View:
    """full = base[off:off + n] (or, transposed, base[:, off:off + n].T), read lazily:
    indexing reads only the selected part of the memory-mapped base and follows NumPy's
    indexing rules for the first axis (negative indices, clamped slices, masks)."""

    def __init__(self, base, off: int = 0, n: int = None, transpose: bool = False):
        self.base, self.off, self.t = base, int(off), bool(transpose)
        bs = tuple(base.shape)
        if transpose:
            n = bs[1] - off if n is None else n
            self.shape = (n, bs[0])
        else:
            n = bs[0] - off if n is None else n
            self.shape = (n,) + bs[1:]
        self.n = n
        if not 0 <= self.off <= self.off + n <= (bs[1] if transpose else bs[0]):
            raise ValueError(f"checkpoint tensor of shape {bs} has no rows {off}:{off + n}"
                             f"{' (after transposing)' if transpose else ''}: its shape does not match the config")

    def __getitem__(self, key) -> np.ndarray:
        rows, scalar, rest = split_row_index(key, self.n)
        r = base_row_index(rows, self.off)
        if self.t:
            c = rest[0] if rest else slice(None)
            out = to_float32(self.base[c, r])
            out = np.ascontiguousarray(out.T) if out.ndim == 2 else out
            if len(rest) > 1:
                raise IndexError("View: too many indices")
        else:
            out = to_float32(self.base[(r,) + tuple(rest)])
        return out[0] if scalar else out

    @property
    def raw_dtype(self):
        return getattr(self.base, "raw_dtype", np.dtype(np.float32))

    def _read_into(self, rows, cols, out, stage) -> None:
        """out (float32, (len(rows), ncols)) = self[rows, cols], streamed (the loaders' fill):
        transposed, rows are the base's columns and cols select the base's rows."""
        rows = np.asarray(rows, np.int64)
        if not self.t:
            read_into(self.base, rows + self.off, cols, out, stage)
            return
        brows = np.arange(self.base.shape[0])[cols if cols is not None else slice(None)]
        for pos, r, n in row_runs(rows):
            read_into(self.base, brows, slice(self.off + r, self.off + r + n), out[pos:pos + n].T, stage)


class _Stack:
    """[gate; up] stacked along rows, read lazily (SwiGLU's fc1)."""

    def __init__(self, a, b):
        self.a, self.b = a, b
        self.shape = (a.shape[0] + b.shape[0],) + tuple(a.shape[1:])

    def __getitem__(self, key):
        rows, scalar, rest = split_row_index(key, self.shape[0])
        rows = np.atleast_1d(rows)
        n = self.a.shape[0]
        parts = []
        for src, idx in ((self.a, rows[rows < n]), (self.b, rows[rows >= n] - n)):
            if idx.size:
                parts.append(to_float32(src[base_row_index(idx, 0)]))
        out = np.concatenate(parts) if parts else np.zeros((0,) + self.shape[1:], np.float32)
        if len(parts) == 2 and not np.all(np.diff(rows) >= 0):  # rows out of order across the halves
            out = np.concatenate([to_float32(self.a[i:i + 1] if i < n else self.b[i - n:i - n + 1]) for i in rows])
        out = out[(slice(None),) + tuple(rest)] if rest else out
        return out[0] if scalar else out

    @property
    def raw_dtype(self):
        return getattr(self.a, "raw_dtype", np.dtype(np.float32))

    def _read_into(self, rows, cols, out, stage) -> None:
        """out (float32, (len(rows), ncols)) = self[rows, cols], streamed (the loaders' fill)."""
        n = self.a.shape[0]
        for pos, r, k in row_runs(np.asarray(rows, np.int64)):
            ka = max(0, min(n, r + k) - r)      # the part of the run in a
            if ka:
                read_into(self.a, np.arange(r, r + ka), cols, out[pos:pos + ka], stage)
            if k > ka:
                b0 = r + ka - n
                read_into(self.b, np.arange(b0, b0 + k - ka), cols, out[pos + ka:pos + k], stage)


class _Offset:
    """base + 1, read lazily (a Gemma norm weight w, which scales by 1 + w: tpcore holds 1 + w)."""

    def __init__(self, base):
        self.base = base
        self.shape = tuple(base.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(np.float32)

    def __getitem__(self, key) -> np.ndarray:
        return to_float32(self.base[key]) + np.float32(1)

    def __array__(self, dtype=None, copy=None):
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    @property
    def raw_dtype(self):
        return getattr(self.base, "raw_dtype", np.dtype(np.float32))


# The name maps: one per architecture, read both ways -----------------------------------
@dataclasses.dataclass(frozen=True)
class Entry:
    """tpcore's tensors `ours` and the Hugging Face tensors `theirs` (names without the
    checkpoint's prefix) that hold the same numbers: ours stacked along their first axis
    equal theirs stacked along their first axis, each of theirs transposed first when
    `transpose` (GPT-2's Conv1D weights are stored (in, out)).  Several of ours: one of
    theirs cut (GPT-2's c_attn into q, k, v); several of theirs: stacked into one of ours
    (Llama's gate_proj and up_proj into fc1).  fallback: the Hugging Face tensor to load
    from when theirs is absent (an untied Llama without lm_head.weight: the embedding).
    offset: ours = theirs + 1 (Gemma's norms, which scale by 1 + w)."""
    ours: Tuple[str, ...]
    theirs: Tuple[str, ...]
    transpose: bool = False
    fallback: Optional[str] = None
    offset: bool = False


def _e(ours: Union[str, tuple], theirs: Union[str, tuple], transpose=False, fallback=None, offset=False) -> Entry:
    return Entry((ours,) if isinstance(ours, str) else tuple(ours),
                 (theirs,) if isinstance(theirs, str) else tuple(theirs), transpose, fallback, offset)


def _gpt2_map(cfg: Config) -> List[Entry]:
    m = [_e("wte.weight", "wte.weight"), _e("wpe.weight", "wpe.weight"),
         _e("final_norm.weight", "ln_f.weight"), _e("final_norm.bias", "ln_f.bias")]
    for i in range(cfg.layers):
        p, q = f"h.{i}.", f"blocks.{i}."
        for w in ("weight", "bias"):
            m += [_e(q + f"norm1.{w}", p + f"ln_1.{w}"), _e(q + f"norm2.{w}", p + f"ln_2.{w}")]
        m += [_e([q + f"attn.{n}.weight" for n in "qkv"], p + "attn.c_attn.weight", transpose=True),
              _e([q + f"attn.{n}.bias" for n in "qkv"], p + "attn.c_attn.bias"),
              _e(q + "attn.out.weight", p + "attn.c_proj.weight", transpose=True),
              _e(q + "attn.out.bias", p + "attn.c_proj.bias"),
              _e(q + "mlp.fc1.weight", p + "mlp.c_fc.weight", transpose=True),
              _e(q + "mlp.fc1.bias", p + "mlp.c_fc.bias"),
              _e(q + "mlp.fc2.weight", p + "mlp.c_proj.weight", transpose=True),
              _e(q + "mlp.fc2.bias", p + "mlp.c_proj.bias")]
    if not cfg.tie_embeddings:
        m.append(_e("lm_head.weight", "lm_head.weight"))
    return m


def _decoder_map(cfg: Config) -> List[Entry]:
    """The Llama layout and its families (Mistral, Qwen 2/3, Gemma 2/3, Phi-3, Mixtral,
    Qwen3-MoE): biases per part, QK-norms, Gemma's four norms (+1), Phi-3's fused
    qkv_proj (cut into q, k, v: each rank reads only its heads' rows) and gate_up_proj
    (already [gate; up]), and the experts of a MoE layer."""
    off = cfg.norm_unit_offset
    m = [_e("wte.weight", "embed_tokens.weight"), _e("final_norm.weight", "norm.weight", offset=off)]
    for i in range(cfg.layers):
        p, q = f"layers.{i}.", f"blocks.{i}."
        m.append(_e(q + "norm1.weight", p + "input_layernorm.weight", offset=off))
        if cfg.post_norms:
            m += [_e(q + "attn_post_norm.weight", p + "post_attention_layernorm.weight", offset=off),
                  _e(q + "norm2.weight", p + "pre_feedforward_layernorm.weight", offset=off),
                  _e(q + "mlp_post_norm.weight", p + "post_feedforward_layernorm.weight", offset=off)]
        else:
            m.append(_e(q + "norm2.weight", p + "post_attention_layernorm.weight", offset=off))
        a = p + "self_attn."
        if cfg.model_type == "phi3":
            m.append(_e([q + f"attn.{n}.weight" for n in "qkv"], a + "qkv_proj.weight"))
        else:
            m += [_e(q + f"attn.{n}.weight", a + f"{n}_proj.weight") for n in "qkv"]
        if cfg.qkv_bias:
            m += [_e(q + f"attn.{n}.bias", a + f"{n}_proj.bias") for n in "qkv"]
        m.append(_e(q + "attn.out.weight", a + "o_proj.weight"))
        if cfg.out_bias:
            m.append(_e(q + "attn.out.bias", a + "o_proj.bias"))
        if cfg.qk_norm:
            m += [_e(q + f"attn.{n}_norm.weight", a + f"{n}_norm.weight", offset=off) for n in "qk"]
        m += _mlp_entries(cfg, p, q)
    if not cfg.tie_embeddings:
        m.append(_e("lm_head.weight", "lm_head.weight", fallback="embed_tokens.weight"))
    return m


def _mlp_entries(cfg: Config, p: str, q: str) -> List[Entry]:
    if cfg.experts and cfg.model_type == "mixtral":
        b = p + "block_sparse_moe."
        m = [_e(q + "moe.router.weight", b + "gate.weight")]
        for e in range(cfg.experts):
            x, y = f"{b}experts.{e}.", f"{q}moe.experts.{e}."
            m += [_e(y + "fc1.weight", (x + "w1.weight", x + "w3.weight")), _e(y + "fc2.weight", x + "w2.weight")]
        return m
    if cfg.experts:   # Qwen3-MoE's names (and any other family with experts)
        b = p + "mlp."
        m = [_e(q + "moe.router.weight", b + "gate.weight")]
        for e in range(cfg.experts):
            x, y = f"{b}experts.{e}.", f"{q}moe.experts.{e}."
            m += [_e(y + "fc1.weight", (x + "gate_proj.weight", x + "up_proj.weight")),
                  _e(y + "fc2.weight", x + "down_proj.weight")]
        return m
    b = p + "mlp."
    if cfg.model_type == "phi3":
        return [_e(q + "mlp.fc1.weight", b + "gate_up_proj.weight"), _e(q + "mlp.fc2.weight", b + "down_proj.weight")]
    m = [_e(q + "mlp.fc1.weight", (b + "gate_proj.weight", b + "up_proj.weight")),
         _e(q + "mlp.fc2.weight", b + "down_proj.weight")]
    if cfg.mlp_bias:
        m += [_e(q + "mlp.fc1.bias", (b + "gate_proj.bias", b + "up_proj.bias")),
              _e(q + "mlp.fc2.bias", b + "down_proj.bias")]
    return m


def _bert_map(cfg: Config) -> List[Entry]:
    e = "embeddings."
    m = [_e("wte.weight", e + "word_embeddings.weight"), _e("wpe.weight", e + "position_embeddings.weight"),
         _e("tte.weight", e + "token_type_embeddings.weight"),
         _e("emb_norm.weight", e + "LayerNorm.weight"), _e("emb_norm.bias", e + "LayerNorm.bias")]
    for i in range(cfg.layers):
        p, q = f"encoder.layer.{i}.", f"blocks.{i}."
        for w in ("weight", "bias"):
            m += [_e(q + f"attn.{n}.{w}", p + f"attention.self.{h}.{w}")
                  for n, h in (("q", "query"), ("k", "key"), ("v", "value"))]
            m += [_e(q + f"attn.out.{w}", p + f"attention.output.dense.{w}"),
                  _e(q + f"norm1.{w}", p + f"attention.output.LayerNorm.{w}"),
                  _e(q + f"mlp.fc1.{w}", p + f"intermediate.dense.{w}"),
                  _e(q + f"mlp.fc2.{w}", p + f"output.dense.{w}"),
                  _e(q + f"norm2.{w}", p + f"output.LayerNorm.{w}")]
    return m


NAME_MAPS = {"gpt2": _gpt2_map, "bert": _bert_map, **{k: _decoder_map for k in DECODERS}}
# the prefix a checkpoint's names may carry (stripped when loading) and the one save_pretrained(hf=True)
# writes (as transformers' GPT2LMHeadModel, LlamaForCausalLM and BertModel do; lm_head.* has none);
# a Gemma 3 multimodal checkpoint's language model is under model.language_model. (transformers 5)
# or language_model.model. (the published files), its vision tower's tensors unused
_PREFIXES = {"gpt2": ("transformer.",), "bert": ("bert.",), "tpcore": (),
             "llama": ("model.language_model.", "language_model.model.", "language_model.", "model.")}
_SAVE_PREFIX = {"gpt2": "transformer.", "llama": "model.", "bert": ""}


def layout(kind: str) -> str:
    """The layout of a model_type's names: "gpt2", "bert", "tpcore", or "llama" (every
    decoder family of tpcore.nn.hf_config shares Llama's names and prefixes)."""
    return "llama" if kind in DECODERS else kind


def name_map(cfg: Config, kind: Optional[str] = None) -> List[Entry]:
    """The entries of cfg's architecture (kind: "gpt2", "bert" or a decoder family, e.g.
    "llama", "qwen2", "gemma2", "phi3", "mixtral"; default cfg.model_type) for cfg's
    number of layers, features and tied or untied head."""
    kind = cfg.model_type if kind is None else kind
    if kind not in NAME_MAPS:
        raise ValueError(f"model_type {kind!r} has no Hugging Face layout here")
    return NAME_MAPS[kind](cfg)


def map_name(name: str, kind: str) -> str:
    """A checkpoint's tensor name as the name maps write it: its prefix ("transformer.",
    "model.", "bert.") taken off, and BERT's old LayerNorm.gamma/beta read as weight/bias."""
    kind = layout(kind)
    for p in _PREFIXES[kind]:
        if name.startswith(p):
            name = name[len(p):]
            break
    if kind == "bert":
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    return name


def _hf_name(name: str, kind: str) -> str:
    return name if name.startswith("lm_head.") else _SAVE_PREFIX[layout(kind)] + name


def _rows_of(shapes, name: str, transpose: bool) -> int:
    return shapes[name][1 if transpose else 0]


def from_hf(t: Dict[str, object], cfg: Config, kind: Optional[str] = None) -> Dict[str, object]:
    """A Hugging Face checkpoint's tensors (memory-mapped arrays) -> tpcore's full tensors
    (tpcore names), as lazy views where a tensor is transposed, cut or stacked.  A tensor
    the map needs and the checkpoint lacks is a KeyError naming it."""
    kind = cfg.model_type if kind is None else kind
    t = {map_name(k, kind): v for k, v in t.items()}
    ours_shapes = {k: tuple(v for v, _ in dims) for k, dims in expected_shapes(cfg, "tpcore")[0].items()}
    sd = {}
    for e in name_map(cfg, kind):
        src = [t[n] if n in t or e.fallback is None else t[e.fallback] for n in e.theirs]
        if len(e.ours) > 1:  # one of theirs, cut along its rows (after transposing)
            off = 0
            for o in e.ours:
                n = ours_shapes[o][0]
                sd[o] = View(src[0], off, n, transpose=e.transpose)
                off += n
            continue
        parts = [View(a, transpose=True) for a in src] if e.transpose else src
        sd[e.ours[0]] = parts[0] if len(parts) == 1 else _Stack(*parts)
        if e.offset:
            sd[e.ours[0]] = _Offset(sd[e.ours[0]])
    return sd


def gpt2_names(t: Dict[str, object], cfg: Config) -> Dict[str, object]:
    return from_hf(t, cfg, "gpt2")


def llama_names(t: Dict[str, object], cfg: Config) -> Dict[str, object]:
    return from_hf(t, cfg, "llama")


def bert_names(t: Dict[str, object], cfg: Config) -> Dict[str, object]:
    return from_hf(t, cfg, "bert")


def to_hf(cfg: Config, sd: Dict[str, np.ndarray]):
    """tpcore's full tensors -> (Hugging Face tensors, config.json dict) for cfg.model_type:
    the name map read the other way (GPT-2's Conv1D weights transposed back and c_attn
    fused again; fc1 split into gate_proj and up_proj, Phi-3's q, k, v and fc1 fused
    again; Gemma's norms less 1).  A Config its family's config.json cannot express
    (e.g. a model_type "qwen2" without its Q/K/V biases) is a ValueError naming the fields."""
    kind = cfg.model_type
    if kind not in NAME_MAPS:
        raise ValueError(f"to_hf: model_type {kind!r} has no Hugging Face layout here")
    conf = _hf_config(cfg)
    req, opt = expected_shapes(cfg, kind)
    theirs_shapes = {k: tuple(v for v, _ in dims) for k, dims in {**opt, **req}.items()}
    out = {}
    for e in name_map(cfg, kind):
        full = np.concatenate([sd[o] for o in e.ours]) if len(e.ours) > 1 else np.asarray(sd[e.ours[0]])
        if e.offset:
            full = np.asarray(full, np.float32) - np.float32(1)
        if len(e.theirs) > 1:
            cuts = np.cumsum([_rows_of(theirs_shapes, n, e.transpose) for n in e.theirs])[:-1]
            parts = np.split(full, cuts)
        else:
            parts = [full]
        for n, a in zip(e.theirs, parts):
            out[_hf_name(n, kind)] = a.T if e.transpose else a
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}, conf


def _hf_config(cfg: Config) -> dict:
    """config.json of cfg; a decoder family's is read back and must give cfg again."""
    L = cfg.layers
    if cfg.model_type == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
                "n_embd": cfg.hidden, "n_layer": L, "n_head": cfg.heads, "n_positions": cfg.max_positions,
                "n_inner": cfg.ffn_hidden, "layer_norm_epsilon": cfg.eps, "tie_word_embeddings": cfg.tie_embeddings,
                "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu",
                                        "silu": "silu"}[cfg.activation]}
    if cfg.model_type == "bert":
        return {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden, "num_hidden_layers": L, "num_attention_heads": cfg.heads,
                "intermediate_size": cfg.ffn_hidden, "max_position_embeddings": cfg.max_positions,
                "type_vocab_size": cfg.type_vocab_size, "layer_norm_eps": cfg.eps,
                "hidden_act": {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[cfg.activation]}
    conf, _ = hf_config_dict(cfg)
    try:
        back = Config.from_hf_dict(conf, source=f"the config.json of a {cfg.model_type} model")
    except ValueError as e:
        raise ValueError(f"to_hf: this Config cannot be written as a {cfg.model_type} config.json: {e}") from None
    diff = [f.name for f in dataclasses.fields(Config) if getattr(back, f.name) != getattr(cfg, f.name)]
    if diff:
        raise ValueError(f"to_hf: a {cfg.model_type} config.json cannot express this Config's "
                         + ", ".join(f"{k}={getattr(cfg, k)!r} (it would read back as {getattr(back, k)!r})"
                                     for k in diff))
    return conf


# Checking a checkpoint against its config before anything is allocated ---------------
_LAYER = {"gpt2": re.compile(r"h\.(\d+)\."), "llama": re.compile(r"layers\.(\d+)\."),
          "bert": re.compile(r"encoder\.layer\.(\d+)\."), "tpcore": re.compile(r"blocks\.(\d+)\.")}
# buffers that transformers writes into some checkpoints and ignores on loading
# (_keys_to_ignore_on_load_unexpected): causal masks, rotary frequencies, position ids
_BUFFERS = {"gpt2": re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$"),
            "llama": re.compile(r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$"),
            "bert": re.compile(r"embeddings\.(position_ids|token_type_ids)$"), "tpcore": re.compile(r"(?!)")}
# Config attribute -> the config file's field that sets it (for messages)
_LABELS = {"gpt2": dict(vocab_size="vocab_size", hidden="n_embd", layers="n_layer", heads="n_head", kv_heads="n_head",
                        head_dim="(n_embd/n_head)", ffn_hidden="n_inner", max_positions="n_positions"),
           "llama": dict(vocab_size="vocab_size", hidden="hidden_size", layers="num_hidden_layers",
                         heads="num_attention_heads", kv_heads="num_key_value_heads", head_dim="head_dim",
                         ffn_hidden="intermediate_size", max_positions="max_position_embeddings",
                         experts="num_local_experts"),
           "bert": dict(vocab_size="vocab_size", hidden="hidden_size", layers="num_hidden_layers",
                        heads="num_attention_heads", kv_heads="num_attention_heads",
                        head_dim="(hidden_size/num_attention_heads)", ffn_hidden="intermediate_size",
                        max_positions="max_position_embeddings", type_vocab_size="type_vocab_size"),
           "tpcore": {}}


def expected_shapes(cfg: Config, kind: str):
    """The tensors a checkpoint of cfg must hold, as (required, optional): {name: dims},
    each dim a (size, "config_field") pair; names without the checkpoint's prefix
    ("transformer.", "model.", "bert."); kind: "gpt2", "llama", "bert" (Hugging Face
    names) or "tpcore" (tpcore's names, as save_pretrained writes them)."""
    kind = layout(kind)
    lab = _LABELS[kind]

    def d(attr, k=1):
        name = lab.get(attr, attr)
        return (k * getattr(cfg, attr), f"{k}*{name}" if k != 1 else name)

    def prod(a, b):
        return (getattr(cfg, a) * getattr(cfg, b), f"{lab.get(a, a)}*{lab.get(b, b)}")
    V, C, F, P, L = d("vocab_size"), d("hidden"), d("ffn_hidden"), d("max_positions"), cfg.layers
    Q, KV = prod("heads", "head_dim"), prod("kv_heads", "head_dim")
    req, opt = {}, {}
    if kind == "gpt2":
        req.update({"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)})
        for i in range(L):
            p = f"h.{i}."
            for n in ("ln_1", "ln_2"):
                req[p + n + ".weight"] = req[p + n + ".bias"] = (C,)
            req.update({p + "attn.c_attn.weight": (C, d("hidden", 3)), p + "attn.c_attn.bias": (d("hidden", 3),),
                        p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
                        p + "mlp.c_fc.weight": (C, F), p + "mlp.c_fc.bias": (F,),
                        p + "mlp.c_proj.weight": (F, C), p + "mlp.c_proj.bias": (C,)})
        (opt if cfg.tie_embeddings else req)["lm_head.weight"] = (V, C)
    elif kind == "llama":
        ours = {}
        _tpcore_shapes(cfg, ours, V, C, F, P, Q, KV, d)
        _derived_shapes(cfg, cfg.model_type if cfg.model_type in DECODERS else kind, ours, req, opt)
    elif kind == "bert":
        e = "embeddings."
        req.update({e + "word_embeddings.weight": (V, C), e + "position_embeddings.weight": (P, C),
                    e + "token_type_embeddings.weight": (d("type_vocab_size"), C),
                    e + "LayerNorm.weight": (C,), e + "LayerNorm.bias": (C,)})
        for i in range(L):
            p = f"encoder.layer.{i}."
            for n in ("query", "key", "value"):
                req[p + f"attention.self.{n}.weight"], req[p + f"attention.self.{n}.bias"] = (C, C), (C,)
            for n in ("attention.output.LayerNorm", "output.LayerNorm"):
                req[p + n + ".weight"] = req[p + n + ".bias"] = (C,)
            req.update({p + "attention.output.dense.weight": (C, C), p + "attention.output.dense.bias": (C,),
                        p + "intermediate.dense.weight": (F, C), p + "intermediate.dense.bias": (F,),
                        p + "output.dense.weight": (C, F), p + "output.dense.bias": (C,)})
    else:   # tpcore's own names (TransformerLM.state_dict_full)
        _tpcore_shapes(cfg, req, V, C, F, P, Q, KV, d)
    return req, opt


def _derived_shapes(cfg: Config, kind: str, ours: dict, req: dict, opt: dict) -> None:
    """A checkpoint's shapes read off the name map from tpcore's (`ours`, labelled with the
    config file's fields): cut tensors' rows summed, stacked halves halved, transposed ones
    flipped; a tensor with a fallback (an untied head) optional."""
    for e in name_map(cfg, kind):
        dims = [ours[o] for o in e.ours]
        full = dims[0] if len(dims) == 1 else \
            ((sum(x[0][0] for x in dims), "+".join(x[0][1] for x in dims)),) + tuple(dims[0][1:])
        n = len(e.theirs)
        if n > 1:
            v, lab = full[0]
            full = ((v // n, lab[len(f"{n}*"):] if lab.startswith(f"{n}*") else f"{lab}/{n}"),) + tuple(full[1:])
        for t in e.theirs:
            (opt if e.fallback else req)[t] = tuple(reversed(full)) if e.transpose else full
    if cfg.tie_embeddings:
        opt["lm_head.weight"] = ours["wte.weight"]   # a tied checkpoint may carry the head too


def _tpcore_shapes(cfg: Config, req: dict, V, C, F, P, Q, KV, d) -> None:
    """expected_shapes in tpcore's names (TransformerLM.state_dict_full)."""
    ln = cfg.norm == "layernorm"
    g = 2 if cfg.activation in GATED else 1

    def norm(name, dims=(C,)):
        req[name + ".weight"] = dims
        if ln:
            req[name + ".bias"] = dims
    req["wte.weight"] = (V, C)
    if cfg.positions == "learned":
        req["wpe.weight"] = (P, C)
    if cfg.type_vocab_size:
        req["tte.weight"] = (d("type_vocab_size"), C)
    if cfg.embedding_norm:
        norm("emb_norm")
    for i in range(cfg.layers):
        p = f"blocks.{i}."
        for n in ("norm1", "norm2") + (("attn_post_norm", "mlp_post_norm") if cfg.post_norms else ()):
            norm(p + n)
        req.update({p + "attn.q.weight": (Q, C), p + "attn.k.weight": (KV, C), p + "attn.v.weight": (KV, C),
                    p + "attn.out.weight": (C, Q)})
        if cfg.qkv_bias:
            req.update({p + "attn.q.bias": (Q,), p + "attn.k.bias": (KV,), p + "attn.v.bias": (KV,)})
        if cfg.out_bias:
            req[p + "attn.out.bias"] = (C,)
        if cfg.qk_norm:
            req[p + "attn.q_norm.weight"] = req[p + "attn.k_norm.weight"] = (d("head_dim"),)
        if cfg.experts:
            req[p + "moe.router.weight"] = (d("experts"), C)
            for e in range(cfg.experts):
                x = f"{p}moe.experts.{e}."
                req.update({x + "fc1.weight": (d("ffn_hidden", g), C), x + "fc2.weight": (C, F)})
            continue
        req.update({p + "mlp.fc1.weight": (d("ffn_hidden", g), C), p + "mlp.fc2.weight": (C, F)})
        if cfg.mlp_bias:
            req.update({p + "mlp.fc1.bias": (d("ffn_hidden", g),), p + "mlp.fc2.bias": (C,)})
    if cfg.final_norm and cfg.pre_norm:
        norm("final_norm")
    if not cfg.tie_embeddings:
        req["lm_head.weight"] = (V, C)


def _dims(dims) -> str:
    return "(" + ", ".join(f"{lab}={v}" for v, lab in dims) + ("," if len(dims) == 1 else "") + ")"


def check_against_config(path: str, cfg: Config, kind: str, source: str, headers, warn: bool = True) -> None:
    """Every tensor cfg needs must be in the checkpoint with exactly the shape cfg implies
    and a float dtype; only the headers are read.  Extra tensors: transformers' harmless
    buffers are ignored; a tensor of a layer past cfg.layers, or one inside a layer that
    tpcore has no place for (a feature the config does not declare, e.g. biases), is a
    CheckpointError; anything else (BERT's pooler and pre-training heads, classifier
    heads) is unused, with a warning, as transformers does.  headers: {name: (file,
    TensorInfo)}."""
    kind = layout(kind)
    layers = _LABELS[kind].get("layers", "layers")
    found = {}
    for name, (fn, info) in headers.items():
        k = map_name(name, kind)
        if k in found:
            raise bad(fn, f"tensor {name!r}", "one tensor per name", f"both it and {found[k][0]!r} (as {k!r})")
        found[k] = (name, fn, info)
    # a layer count past the file's first missing layer is refused before the expected
    # tensors are listed (their number grows with the count the config claims)
    present = {int(m.group(1)) for m in map(_LAYER[kind].match, found) if m}
    gap = next(i for i in range(len(present) + 1) if i not in present)
    if gap < cfg.layers:
        raise bad(path, f"layer {gap}", f"its tensors ({layers}={cfg.layers} as {source} says)",
                  f"no tensor of layer {gap} in the checkpoint (it holds {len(present)} layers)")
    req, opt = expected_shapes(cfg, kind)

    def check(k, dims):
        name, fn, info = found[k]
        want = tuple(v for v, _ in dims)
        if info.shape != want:
            raise bad(fn, f"tensor {name!r}", f"shape {_dims(dims)} as {source} says", f"shape {info.shape}")
        if not info.floating:
            raise bad(fn, f"tensor {name!r} dtype", "a floating-point dtype (F16, BF16, F32, F64)", info.dtype)
    for k, dims in req.items():
        if k not in found:
            m = _LAYER[kind].match(k)
            why = f"layer {m.group(1)} of {layers}={cfg.layers}" if m else f"a {cfg.model_type} model"
            raise bad(path, f"tensor {k!r}", f"a tensor of shape {_dims(dims)} ({why}, as {source} says)",
                      "no such tensor in the checkpoint")
        check(k, dims)
    unused = []
    for k, (name, fn, _info) in found.items():
        if k in req:
            continue
        if k in opt:
            check(k, opt[k])
            continue
        if _BUFFERS[kind].match(k):
            continue
        m = _LAYER[kind].match(k)
        if m and int(m.group(1)) >= cfg.layers:
            raise bad(fn, f"tensor {name!r}", f"layers 0 to {cfg.layers - 1} ({layers}={cfg.layers} as {source} says)",
                      f"a tensor of layer {m.group(1)}")
        if m or kind == "tpcore":
            raise bad(fn, f"tensor {name!r}", f"only the tensors of the model {source} describes",
                      "a tensor tpcore has no place for (a feature the config does not declare?)")
        unused.append(name)
    if unused and warn:
        warnings.warn(f"{path}: {len(unused)} tensor(s) of the checkpoint are not used by tpcore's {kind} model "
                      f"and were ignored: {', '.join(sorted(unused)[:8])}{' ...' if len(unused) > 8 else ''}",
                      stacklevel=3)


__all__ = ["Entry", "NAME_MAPS", "name_map", "map_name", "from_hf", "to_hf", "View", "gpt2_names", "llama_names",
           "bert_names", "expected_shapes", "check_against_config", "CheckpointError"]
