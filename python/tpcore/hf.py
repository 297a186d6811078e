"""Hugging Face checkpoints (GPT-2, Llama family, BERT) into tpcore models.

Each rank memory-maps the *.safetensors files (tpcore's own reader: nothing is
read until indexed, and bfloat16 works without torch or ml_dtypes) and copies
only its slices: its rows of the vocabulary, its heads' rows of Q/K/V, its
columns of the output and fc2 projections, its rows of fc1.  A rank's memory
grows by about its shard, not by the model.

Before anything is allocated, every file is checked: config.json's fields (types,
ranges, consistency), each safetensors header (the format's rules), the index
json of a sharded checkpoint, and the config against the tensors' shapes
(check_against_config): a corrupt file or a config whose sizes the files do not
hold raises tpcore.CheckpointError naming the file, the tensor or field, what was
expected and what was found.  Names are mapped to tpcore's
(transformer.TransformerBlock's docstring); GPT-2's Conv1D weights are stored
(in, out) and its c_attn fuses [q | k | v] along out: the views below transpose
and cut them lazily.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import warnings
from typing import Dict

import numpy as np

from .checkpoint import (CheckpointError, ConfigFields, _collective, _type, bad, check_tensors, is_int, read_json_object,
                         read_safetensors, read_safetensors_header, to_float32)
from .comm import Comm
from .transformer import Config


def _rows(key, n):
    """The row part of an index into an n-row tensor, as NumPy would resolve it (negative
    indices, clamped slices, boolean masks): (index for the base rows, is_scalar, rest)."""
    if key is Ellipsis:
        key = ()
    key = key if isinstance(key, tuple) else (key,)
    if key and key[0] is Ellipsis:
        key = (slice(None),) + key[1:]
    first = key[0] if key else slice(None)
    rows = np.arange(n)[first]
    return rows, np.ndim(rows) == 0, key[1:]


def _as_base_index(rows, off):
    rows = np.atleast_1d(rows) + off
    if rows.size and np.all(np.diff(rows) == 1):
        return slice(int(rows[0]), int(rows[-1]) + 1)  # a contiguous run: a plain (cheap) slice of the map
    return rows


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
        rows, scalar, rest = _rows(key, self.n)
        r = _as_base_index(rows, self.off)
        if self.t:
            c = rest[0] if rest else slice(None)
            out = to_float32(self.base[c, r])
            out = np.ascontiguousarray(out.T) if out.ndim == 2 else out
            if len(rest) > 1:
                raise IndexError("View: too many indices")
        else:
            out = to_float32(self.base[(r,) + tuple(rest)])
        return out[0] if scalar else out


def _index_files(path: str):
    """The safetensors files of a Hugging Face checkpoint folder, with the tensor -> file
    map of its *.safetensors.index.json when it has one (checked: an object whose
    weight_map names plain files of the folder).  Without an index: every *.safetensors."""
    idx = os.path.join(path, "model.safetensors.index.json")
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
        raise f.fail("weight_map", "an object of tensor name -> file name", _type(wm))
    for name, fn in wm.items():
        if not (isinstance(fn, str) and fn and fn == os.path.basename(fn) and fn not in (".", "..")
                and fn.endswith(".safetensors")):
            raise f.fail(f"weight_map[{name!r}]", "the name of a .safetensors file in the folder", _type(fn))
        if not os.path.isfile(os.path.join(path, fn)):
            raise f.fail(f"weight_map[{name!r}]", "an existing file of the folder", f"{fn!r}, which is missing")
    return [os.path.join(path, fn) for fn in sorted(set(wm.values()))], wm, idx


def _headers(path: str):
    """{tensor name: (file, TensorInfo)} over every file of the checkpoint, headers checked
    (no tensor data read): a name in two files, or a file and its index disagreeing, is a
    CheckpointError."""
    files, wm, idx = _index_files(path)
    out = {}
    for fn in files:
        header, _, _ = read_safetensors_header(fn)
        for name, info in header.items():
            if name in out:
                raise bad(fn, f"tensor {name!r}", "each tensor in one file", f"it also in {out[name][0]}")
            if wm is not None and wm.get(name) != os.path.basename(fn):
                raise bad(idx, f"weight_map[{name!r}]", f"{os.path.basename(fn)!r} (the file that holds it)",
                          _type(wm.get(name)) if name in wm else "no entry")
            out[name] = (fn, info)
    if wm is not None:
        for name, fn in wm.items():
            if name not in out:
                raise bad(os.path.join(path, fn), f"tensor {name!r}", f"the tensor (as {os.path.basename(idx)} says)",
                          "no such tensor")
    return out


def _open(path: str, headers=None) -> Dict[str, object]:
    """Every tensor of a Hugging Face checkpoint folder, memory-mapped (headers checked;
    headers: _headers(path) when the caller has it)."""
    headers = _headers(path) if headers is None else headers
    out = {}
    for f in sorted({fn for fn, _ in headers.values()}):
        t, _ = read_safetensors(f)
        out.update(t)
    return out


def _strip(tensors, prefixes):
    out = {}
    for k, v in tensors.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v
    return out


def gpt2_names(t: Dict[str, object], cfg: Config) -> Dict[str, object]:
    t = _strip(t, ("transformer.",))
    C = cfg.hidden
    sd = {"wte.weight": t["wte.weight"], "wpe.weight": t["wpe.weight"],
          "final_norm.weight": t["ln_f.weight"], "final_norm.bias": t["ln_f.bias"]}
    for i in range(cfg.layers):
        p, q = f"h.{i}.", f"blocks.{i}."
        sd[q + "norm1.weight"], sd[q + "norm1.bias"] = t[p + "ln_1.weight"], t[p + "ln_1.bias"]
        sd[q + "norm2.weight"], sd[q + "norm2.bias"] = t[p + "ln_2.weight"], t[p + "ln_2.bias"]
        w, b = t[p + "attn.c_attn.weight"], t[p + "attn.c_attn.bias"]     # (C, 3C) and (3C,)
        for j, nm in enumerate("qkv"):
            sd[q + f"attn.{nm}.weight"] = View(w, j * C, C, transpose=True)
            sd[q + f"attn.{nm}.bias"] = View(b, j * C, C)
        sd[q + "attn.out.weight"] = View(t[p + "attn.c_proj.weight"], transpose=True)
        sd[q + "attn.out.bias"] = t[p + "attn.c_proj.bias"]
        sd[q + "mlp.fc1.weight"] = View(t[p + "mlp.c_fc.weight"], transpose=True)
        sd[q + "mlp.fc1.bias"] = t[p + "mlp.c_fc.bias"]
        sd[q + "mlp.fc2.weight"] = View(t[p + "mlp.c_proj.weight"], transpose=True)
        sd[q + "mlp.fc2.bias"] = t[p + "mlp.c_proj.bias"]
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = t["lm_head.weight"]
    return sd


class _Stack:
    """[gate; up] stacked along rows, read lazily (SwiGLU's fc1)."""

    def __init__(self, a, b):
        self.a, self.b = a, b
        self.shape = (a.shape[0] + b.shape[0],) + tuple(a.shape[1:])

    def __getitem__(self, key):
        rows, scalar, rest = _rows(key, self.shape[0])
        rows = np.atleast_1d(rows)
        n = self.a.shape[0]
        parts = []
        for src, idx in ((self.a, rows[rows < n]), (self.b, rows[rows >= n] - n)):
            if idx.size:
                parts.append(to_float32(src[_as_base_index(idx, 0)]))
        out = np.concatenate(parts) if parts else np.zeros((0,) + self.shape[1:], np.float32)
        if len(parts) == 2 and not np.all(np.diff(rows) >= 0):  # rows out of order across the halves
            out = np.concatenate([to_float32(self.a[i:i + 1] if i < n else self.b[i - n:i - n + 1]) for i in rows])
        out = out[(slice(None),) + tuple(rest)] if rest else out
        return out[0] if scalar else out


def llama_names(t: Dict[str, object], cfg: Config) -> Dict[str, object]:
    t = _strip(t, ("model.",))
    sd = {"wte.weight": t["embed_tokens.weight"], "final_norm.weight": t["norm.weight"]}
    for i in range(cfg.layers):
        p, q = f"layers.{i}.", f"blocks.{i}."
        sd[q + "norm1.weight"] = t[p + "input_layernorm.weight"]
        sd[q + "norm2.weight"] = t[p + "post_attention_layernorm.weight"]
        for nm in "qkv":
            sd[q + f"attn.{nm}.weight"] = t[p + f"self_attn.{nm}_proj.weight"]
        sd[q + "attn.out.weight"] = t[p + "self_attn.o_proj.weight"]
        sd[q + "mlp.fc1.weight"] = _Stack(t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"])
        sd[q + "mlp.fc2.weight"] = t[p + "mlp.down_proj.weight"]
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = t["lm_head.weight"] if "lm_head.weight" in t else t["embed_tokens.weight"]
    return sd


def bert_names(t: Dict[str, object], cfg: Config) -> Dict[str, object]:
    t = _strip(t, ("bert.",))
    t = {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
         for k, v in t.items()}
    e = "embeddings."
    sd = {"wte.weight": t[e + "word_embeddings.weight"], "wpe.weight": t[e + "position_embeddings.weight"],
          "tte.weight": t[e + "token_type_embeddings.weight"],
          "emb_norm.weight": t[e + "LayerNorm.weight"], "emb_norm.bias": t[e + "LayerNorm.bias"]}
    for i in range(cfg.layers):
        p, q = f"encoder.layer.{i}.", f"blocks.{i}."
        for nm, hf in (("q", "query"), ("k", "key"), ("v", "value")):
            sd[q + f"attn.{nm}.weight"] = t[p + f"attention.self.{hf}.weight"]
            sd[q + f"attn.{nm}.bias"] = t[p + f"attention.self.{hf}.bias"]
        sd[q + "attn.out.weight"] = t[p + "attention.output.dense.weight"]
        sd[q + "attn.out.bias"] = t[p + "attention.output.dense.bias"]
        sd[q + "norm1.weight"] = t[p + "attention.output.LayerNorm.weight"]
        sd[q + "norm1.bias"] = t[p + "attention.output.LayerNorm.bias"]
        sd[q + "mlp.fc1.weight"] = t[p + "intermediate.dense.weight"]
        sd[q + "mlp.fc1.bias"] = t[p + "intermediate.dense.bias"]
        sd[q + "mlp.fc2.weight"] = t[p + "output.dense.weight"]
        sd[q + "mlp.fc2.bias"] = t[p + "output.dense.bias"]
        sd[q + "norm2.weight"] = t[p + "output.LayerNorm.weight"]
        sd[q + "norm2.bias"] = t[p + "output.LayerNorm.bias"]
    return sd


def to_hf(cfg: Config, sd: Dict[str, np.ndarray]):
    """tpcore's full tensors -> (Hugging Face tensors, config.json dict) for cfg.model_type:
    the inverse of gpt2_names / llama_names / bert_names (GPT-2's Conv1D weights transposed
    back and c_attn fused again; Llama's gate/up split)."""
    out = {}
    L = cfg.layers
    if cfg.model_type == "gpt2":
        out["transformer.wte.weight"], out["transformer.wpe.weight"] = sd["wte.weight"], sd["wpe.weight"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = sd["final_norm.weight"], sd["final_norm.bias"]
        for i in range(L):
            p, q = f"transformer.h.{i}.", f"blocks.{i}."
            out[p + "ln_1.weight"], out[p + "ln_1.bias"] = sd[q + "norm1.weight"], sd[q + "norm1.bias"]
            out[p + "ln_2.weight"], out[p + "ln_2.bias"] = sd[q + "norm2.weight"], sd[q + "norm2.bias"]
            out[p + "attn.c_attn.weight"] = np.concatenate([sd[q + f"attn.{n}.weight"] for n in "qkv"]).T
            out[p + "attn.c_attn.bias"] = np.concatenate([sd[q + f"attn.{n}.bias"] for n in "qkv"])
            out[p + "attn.c_proj.weight"], out[p + "attn.c_proj.bias"] = sd[q + "attn.out.weight"].T, sd[q + "attn.out.bias"]
            out[p + "mlp.c_fc.weight"], out[p + "mlp.c_fc.bias"] = sd[q + "mlp.fc1.weight"].T, sd[q + "mlp.fc1.bias"]
            out[p + "mlp.c_proj.weight"], out[p + "mlp.c_proj.bias"] = sd[q + "mlp.fc2.weight"].T, sd[q + "mlp.fc2.bias"]
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"]
        conf = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
                "n_embd": cfg.hidden, "n_layer": L, "n_head": cfg.heads, "n_positions": cfg.max_positions,
                "n_inner": cfg.ffn_hidden, "layer_norm_epsilon": cfg.eps, "tie_word_embeddings": cfg.tie_embeddings,
                "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu",
                                        "silu": "silu"}[cfg.activation]}
    elif cfg.model_type == "llama":
        F = cfg.ffn_hidden
        out["model.embed_tokens.weight"], out["model.norm.weight"] = sd["wte.weight"], sd["final_norm.weight"]
        for i in range(L):
            p, q = f"model.layers.{i}.", f"blocks.{i}."
            out[p + "input_layernorm.weight"] = sd[q + "norm1.weight"]
            out[p + "post_attention_layernorm.weight"] = sd[q + "norm2.weight"]
            for n in "qkv":
                out[p + f"self_attn.{n}_proj.weight"] = sd[q + f"attn.{n}.weight"]
            out[p + "self_attn.o_proj.weight"] = sd[q + "attn.out.weight"]
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = sd[q + "mlp.fc1.weight"][:F], \
                sd[q + "mlp.fc1.weight"][F:]
            out[p + "mlp.down_proj.weight"] = sd[q + "mlp.fc2.weight"]
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"]
        conf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden, "num_hidden_layers": L, "num_attention_heads": cfg.heads,
                "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "intermediate_size": F,
                "rms_norm_eps": cfg.eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_positions,
                "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
                "mlp_bias": False}
    elif cfg.model_type == "bert":
        e = "embeddings."
        out[e + "word_embeddings.weight"], out[e + "position_embeddings.weight"] = sd["wte.weight"], sd["wpe.weight"]
        out[e + "token_type_embeddings.weight"] = sd["tte.weight"]
        out[e + "LayerNorm.weight"], out[e + "LayerNorm.bias"] = sd["emb_norm.weight"], sd["emb_norm.bias"]
        for i in range(L):
            p, q = f"encoder.layer.{i}.", f"blocks.{i}."
            for n, h in (("q", "query"), ("k", "key"), ("v", "value")):
                out[p + f"attention.self.{h}.weight"] = sd[q + f"attn.{n}.weight"]
                out[p + f"attention.self.{h}.bias"] = sd[q + f"attn.{n}.bias"]
            out[p + "attention.output.dense.weight"] = sd[q + "attn.out.weight"]
            out[p + "attention.output.dense.bias"] = sd[q + "attn.out.bias"]
            out[p + "attention.output.LayerNorm.weight"] = sd[q + "norm1.weight"]
            out[p + "attention.output.LayerNorm.bias"] = sd[q + "norm1.bias"]
            out[p + "intermediate.dense.weight"], out[p + "intermediate.dense.bias"] = sd[q + "mlp.fc1.weight"], \
                sd[q + "mlp.fc1.bias"]
            out[p + "output.dense.weight"], out[p + "output.dense.bias"] = sd[q + "mlp.fc2.weight"], sd[q + "mlp.fc2.bias"]
            out[p + "output.LayerNorm.weight"], out[p + "output.LayerNorm.bias"] = sd[q + "norm2.weight"], \
                sd[q + "norm2.bias"]
        conf = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden, "num_hidden_layers": L, "num_attention_heads": cfg.heads,
                "intermediate_size": cfg.ffn_hidden, "max_position_embeddings": cfg.max_positions,
                "type_vocab_size": cfg.type_vocab_size, "layer_norm_eps": cfg.eps,
                "hidden_act": {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[cfg.activation]}
    else:
        raise ValueError(f"to_hf: model_type {cfg.model_type!r} has no Hugging Face layout here")
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}, conf


# Checking a checkpoint against its config before anything is allocated ---------------
_PREFIXES = {"gpt2": ("transformer.",), "llama": ("model.",), "bert": ("bert.",), "tpcore": ()}
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
                         ffn_hidden="intermediate_size", max_positions="max_position_embeddings"),
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
        req.update({"embed_tokens.weight": (V, C), "norm.weight": (C,)})
        for i in range(L):
            p = f"layers.{i}."
            req.update({p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                        p + "self_attn.q_proj.weight": (Q, C), p + "self_attn.k_proj.weight": (KV, C),
                        p + "self_attn.v_proj.weight": (KV, C), p + "self_attn.o_proj.weight": (C, Q),
                        p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C),
                        p + "mlp.down_proj.weight": (C, F)})
        opt["lm_head.weight"] = (V, C)   # untied without it: the embedding (as before)
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
        ln = cfg.norm == "layernorm"
        g = 2 if cfg.activation == "swiglu" else 1

        def norm(name):
            req[name + ".weight"] = (C,)
            if ln:
                req[name + ".bias"] = (C,)
        req["wte.weight"] = (V, C)
        if cfg.positions == "learned":
            req["wpe.weight"] = (P, C)
        if cfg.type_vocab_size:
            req["tte.weight"] = (d("type_vocab_size"), C)
        if cfg.embedding_norm:
            norm("emb_norm")
        for i in range(L):
            p = f"blocks.{i}."
            norm(p + "norm1")
            norm(p + "norm2")
            req.update({p + "attn.q.weight": (Q, C), p + "attn.k.weight": (KV, C), p + "attn.v.weight": (KV, C),
                        p + "attn.out.weight": (C, Q), p + "mlp.fc1.weight": (d("ffn_hidden", g), C),
                        p + "mlp.fc2.weight": (C, F)})
            if cfg.bias:
                req.update({p + "attn.q.bias": (Q,), p + "attn.k.bias": (KV,), p + "attn.v.bias": (KV,),
                            p + "attn.out.bias": (C,), p + "mlp.fc1.bias": (d("ffn_hidden", g),),
                            p + "mlp.fc2.bias": (C,)})
        if cfg.final_norm and cfg.pre_norm:
            norm("final_norm")
        if not cfg.tie_embeddings:
            req["lm_head.weight"] = (V, C)
    return req, opt


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
    layers = _LABELS[kind].get("layers", "layers")
    found = {}
    for name, (fn, info) in headers.items():
        k = name
        for p in _PREFIXES[kind]:
            if k.startswith(p):
                k = k[len(p):]
                break
        if kind == "bert":
            k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
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
    for k, (name, fn, info) in found.items():
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


def _own_config(p: str) -> Config:
    """tpcore_config.json (save_pretrained): an object of Config's fields, each checked."""
    from .layers import ACTIVATIONS
    from .transformer import NORMS, POSITIONS
    d = read_json_object(p)
    f = ConfigFields(d, p)
    fields = {x.name for x in dataclasses.fields(Config)}
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
            kw[k] = f.num(k, positive=False)  # the value rules are Config's (below), written once
        elif k in ("norm", "activation", "positions"):
            kw[k] = f.str(k, choices={"norm": NORMS, "activation": ACTIVATIONS, "positions": POSITIONS}[k])
        elif k == "model_type":
            kw[k] = f.str(k)
        else:
            kw[k] = f.bool(k)
    try:
        return Config(**kw)
    except (TypeError, ValueError) as e:
        raise bad(p, "config", "a consistent configuration", str(e)) from e


def _check_own_shards(path: str, cfg: Config, source: str, world: int) -> None:
    """The shard files of a sharded save_pretrained checkpoint, before allocating: every
    rank's file exists with its rank and world in the metadata, tensors param.<i> of a
    float dtype, and together at least as many values as cfg's full tensors hold (every
    value of the model is on some rank), so a config that claims more than the files
    hold is refused."""
    req, _ = expected_shapes(dataclasses.replace(cfg, layers=1), "tpcore")   # a layer's tensors, not L layers'
    sizes = {k: math.prod(v for v, _ in dims) for k, dims in req.items()}
    per_layer = sum(n for k, n in sizes.items() if k.startswith("blocks.0."))
    need = sum(sizes.values()) + (cfg.layers - 1) * per_layer
    total = 0
    for r in range(world):
        fn = os.path.join(path, f"model.rank{r}-of-{world}.safetensors")
        if not os.path.exists(fn):
            raise bad(fn, "file", f"rank {r}'s shard of a {world}-rank checkpoint", "no such file")
        header, meta, _ = read_safetensors_header(fn)
        for k, want in (("world", str(world)), ("rank", str(r))):
            if k in meta and meta[k] != want:
                raise bad(fn, f"__metadata__[{k!r}]", repr(want), repr(meta[k]))
        for name, info in header.items():
            if not re.fullmatch(r"param\.(0|[1-9][0-9]*)", name):
                raise bad(fn, f"tensor {name!r}", "tensors named param.<i>", "another name")
            if not info.floating:
                raise bad(fn, f"tensor {name!r} dtype", "a floating-point dtype", info.dtype)
            total += math.prod(info.shape)
    if total < need:
        raise bad(source, "sizes", f"a model the {world} shard files can hold ({total} values)",
                  f"sizes that need {need} values (vocab_size={cfg.vocab_size}, hidden={cfg.hidden}, "
                  f"layers={cfg.layers}, max_positions={cfg.max_positions}, ...)")


def _generation_config(path: str) -> dict:
    p = os.path.join(path, "generation_config.json")
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
            raise f.fail(k, "a non-negative integer" + (" or a list of them" if k == "eos_token_id" else ""), _type(v))
        out[k] = v
    return out


@_collective
def load(path: str, comm: Comm, partition=None, progress: bool = True):
    """A checkpoint folder: tpcore's own (tpcore_config.json) or Hugging Face's
    (config.json).  The config and every file header are checked against each other
    before the model is allocated (CheckpointError otherwise)."""
    from .models import TransformerLM
    own = os.path.join(path, "tpcore_config.json")
    if os.path.exists(own):
        cfg = _own_config(own)
        shards = sorted(glob.glob(os.path.join(path, "model.rank*-of-*.safetensors")))
        full = os.path.join(path, "model.safetensors")
        if os.path.exists(full):
            header, _, _ = read_safetensors_header(full)
            check_against_config(path, cfg, "tpcore", "tpcore_config.json", {k: (full, v) for k, v in header.items()})
            model = TransformerLM(cfg, comm, partition=partition)
            t, _ = read_safetensors(full)
            model.load_state_dict_full(t, progress=progress)
        elif shards:
            mine = os.path.join(path, f"model.rank{comm.rank}-of-{comm.size}.safetensors")
            if not os.path.exists(mine):
                raise ValueError(f"{path}: a sharded checkpoint of another world size ({os.path.basename(shards[0])}); "
                                 f"save it with sharded=False to reshard")
            _check_own_shards(path, cfg, own, comm.size)
            model = TransformerLM(cfg, comm, partition=partition)
            t, _ = read_safetensors(mine)
            params = model.parameters()
            check_tensors(mine, t, {f"param.{i}": p.shape for i, (p, _) in enumerate(params)},
                          "this rank's shard of the model (another partition?)")
            for i, (p, _) in enumerate(params):
                p[...] = to_float32(t[f"param.{i}"])
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors")
        return model
    cfg = Config.from_hf(path)
    headers = _headers(path)
    check_against_config(path, cfg, cfg.model_type, "config.json", headers, warn=comm.rank == 0)
    gen = _generation_config(path)
    t = _open(path, headers)
    names = {"gpt2": gpt2_names, "llama": llama_names, "bert": bert_names}[cfg.model_type]
    try:
        sd = names(t, cfg)
    except KeyError as e:
        raise KeyError(f"{path}: the checkpoint has no tensor {e} (expected {cfg.model_type} names)") from None
    model = TransformerLM(cfg, comm, partition=partition)
    model.load_state_dict_full(sd, progress=progress)
    del t, sd
    model.generation_config = gen
    return model


__all__ = ["load", "to_hf", "View", "gpt2_names", "llama_names", "bert_names", "expected_shapes",
           "check_against_config", "CheckpointError"]
