"""Hugging Face checkpoints (GPT-2, Llama family, BERT) into tpcore models.

Each rank memory-maps the *.safetensors files (tpcore's own reader: nothing is
read until indexed, and bfloat16 works without torch or ml_dtypes) and copies
only its slices: its rows of the vocabulary, its heads' rows of Q/K/V, its
columns of the output and fc2 projections, its rows of fc1.  A rank's memory
grows by about its shard, not by the model.  Names are mapped to tpcore's
(transformer.TransformerBlock's docstring); GPT-2's Conv1D weights are stored
(in, out) and its c_attn fuses [q | k | v] along out: the views below transpose
and cut them lazily.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Dict

import numpy as np

from .checkpoint import read_safetensors, to_float32
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


def _open(path: str) -> Dict[str, object]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    out = {}
    for f in files:
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


def load(path: str, comm: Comm, partition=None, progress: bool = True):
    from .models import TransformerLM
    own = os.path.join(path, "tpcore_config.json")
    if os.path.exists(own):
        with open(own) as f:
            cfg = Config(**json.load(f))
        model = TransformerLM(cfg, comm, partition=partition)
        shards = sorted(glob.glob(os.path.join(path, "model.rank*-of-*.safetensors")))
        full = os.path.join(path, "model.safetensors")
        if os.path.exists(full):
            t, _ = read_safetensors(full)
            model.load_state_dict_full(t, progress=progress)
        elif shards:
            mine = os.path.join(path, f"model.rank{comm.rank}-of-{comm.size}.safetensors")
            if not os.path.exists(mine):
                raise ValueError(f"{path}: a sharded checkpoint of another world size ({os.path.basename(shards[0])}); "
                                 f"save it with sharded=False to reshard")
            t, _ = read_safetensors(mine)
            params = model.parameters()
            for i, (p, _) in enumerate(params):
                src = t.get(f"param.{i}")
                if src is None or tuple(src.shape) != p.shape:
                    raise ValueError(f"{mine}: parameter {i} is missing or has another shape (another layout)")
                p[...] = to_float32(src)
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors")
        return model
    cfg = Config.from_hf(path)
    t = _open(path)
    names = {"gpt2": gpt2_names, "llama": llama_names, "bert": bert_names}[cfg.model_type]
    try:
        sd = names(t, cfg)
    except KeyError as e:
        raise KeyError(f"{path}: the checkpoint has no tensor {e} (expected {cfg.model_type} names)") from None
    model = TransformerLM(cfg, comm, partition=partition)
    model.load_state_dict_full(sd, progress=progress)
    del t, sd
    gc_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gc_path):
        with open(gc_path) as f:
            g = json.load(f)
        model.generation_config = {k: g[k] for k in ("eos_token_id", "pad_token_id") if g.get(k) is not None}
    return model


__all__ = ["load", "to_hf", "View", "gpt2_names", "llama_names", "bert_names"]
