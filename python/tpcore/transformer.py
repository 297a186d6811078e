"""The tensor-parallel Transformer block (Megatron) over the C core.

``TransformerBlock(config, comm)`` is one C object (csrc/layers/transformer.c):
norms, attention with this rank's heads (fused QKV projection, column-parallel;
output projection row-parallel), the parallel MLP, residuals, and a KV cache for
decoding.  Forward does exactly one all-reduce after attention and one after
the MLP; backward mirrors them at the QKV and fc1 inputs.  One C call per block
per step, with the GIL released.

Heads split in whole heads: ``head_partition`` gives the query heads of each
rank (any sizes, e.g. 12 heads on 5 ranks as 3,3,2,2,2, or weighted for
mismatched devices); with grouped-query attention a rank holds the KV heads its
query heads use, so KV heads are split with their groups, or replicated when
there are fewer KV heads than ranks (their weight gradients are then summed over
the ranks that hold them).

Full-tensor names (``load_full`` / ``gather_full``), Hugging Face's shapes:
``norm1.weight``, ``norm1.bias``, ``attn.q.weight`` (heads*D, hidden),
``attn.k.weight``, ``attn.v.weight`` (kv_heads*D, hidden), their ``.bias``,
``attn.out.weight`` (hidden, heads*D), ``attn.out.bias``, ``norm2.*``,
``mlp.fc1.weight`` (ffn, hidden; SwiGLU: (2 ffn, hidden) = [gate; up]),
``mlp.fc1.bias``, ``mlp.fc2.weight`` (hidden, ffn), ``mlp.fc2.bias``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Optional, Sequence

import numpy as np

from . import _C
from .comm import Comm
from .checkpoint import to_float32
from .layers import _sizes, as_float32, check_partition, check_seed, partition

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope", "none")


@dataclasses.dataclass
class Config:
    """A decoder (GPT-2, Llama family) or encoder (BERT) Transformer."""
    vocab_size: int = 50257
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: Optional[int] = None          # None: = heads (multi-head attention)
    ffn_hidden: Optional[int] = None        # None: 4 * hidden
    head_dim: Optional[int] = None          # None: hidden // heads
    norm: str = "layernorm"                 # "layernorm" | "rmsnorm"
    eps: float = 1e-5
    activation: str = "gelu_tanh"           # gelu, gelu_tanh, silu, relu, swiglu
    positions: str = "learned"              # "learned" (GPT-2, BERT) | "rope" (Llama) | "none"
    max_positions: int = 1024
    rope_theta: float = 10000.0
    causal: bool = True                     # False: bidirectional encoder (BERT)
    pre_norm: bool = True                   # False: post-norm (BERT)
    bias: bool = True                       # biases of the linear layers (Llama: False)
    tie_embeddings: bool = True             # LM head = the token embedding (GPT-2)
    type_vocab_size: int = 0                # BERT token types (0: none)
    final_norm: bool = True                 # a norm after the last block (pre-norm models)
    embedding_norm: bool = False            # a norm after the embeddings (BERT)
    sliding_window: Optional[int] = None    # Mistral: longer sequences are refused (not implemented)
    model_type: str = "gpt2"

    def __post_init__(self):
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.hidden
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"Config: hidden ({self.hidden}) is not a multiple of heads ({self.heads}); "
                                 f"give head_dim")
            self.head_dim = self.hidden // self.heads
        if self.norm not in NORMS:
            raise ValueError(f"Config: norm must be one of {NORMS}, got {self.norm!r}")
        if self.positions not in POSITIONS:
            raise ValueError(f"Config: positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"Config: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Config: {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_hf(cls, path: str) -> "Config":
        """The config.json of a Hugging Face GPT-2, Llama (or Mistral) or BERT checkpoint."""
        p = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with open(p) as f:
            c = json.load(f)
        return cls.from_hf_dict(c)

    @classmethod
    def from_hf_dict(cls, c: dict) -> "Config":
        mt = c.get("model_type", "")
        if mt == "gpt2":
            if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn") or \
                    c.get("scale_attn_weights") is False:
                raise ValueError("Config.from_hf: GPT-2 with scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn "
                                 "or without scale_attn_weights is not supported")
            act = c.get("activation_function", "gelu_new")
            return cls(vocab_size=c["vocab_size"], hidden=c["n_embd"], layers=c["n_layer"], heads=c["n_head"],
                       ffn_hidden=c.get("n_inner") or 4 * c["n_embd"], norm="layernorm",
                       eps=c.get("layer_norm_epsilon", 1e-5), activation=_hf_act(act), positions="learned",
                       max_positions=c.get("n_positions", 1024), causal=True, pre_norm=True, bias=True,
                       tie_embeddings=c.get("tie_word_embeddings", True), model_type="gpt2")
        if mt in ("llama", "mistral"):
            rp = c.get("rope_parameters") or {}
            scaling = c.get("rope_scaling") or rp
            if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = {}  # plain RoPE written out explicitly
            if scaling:
                raise ValueError(f"Config.from_hf: rope scaling {scaling} is not supported")
            theta = c.get("rope_theta") or rp.get("rope_theta") or 10000.0
            act = c.get("hidden_act", "silu")
            if act != "silu":
                raise ValueError(f"Config.from_hf: Llama with hidden_act {act!r} is not supported (silu only)")
            if c.get("attention_bias") or c.get("mlp_bias"):
                raise ValueError("Config.from_hf: Llama with attention_bias / mlp_bias is not supported")
            return cls(vocab_size=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                       heads=c["num_attention_heads"], kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                       ffn_hidden=c["intermediate_size"], head_dim=c.get("head_dim"), norm="rmsnorm",
                       eps=c.get("rms_norm_eps", 1e-6), activation="swiglu", positions="rope",
                       max_positions=c.get("max_position_embeddings", 2048), rope_theta=float(theta),
                       causal=True, pre_norm=True, bias=False,
                       tie_embeddings=c.get("tie_word_embeddings", False),
                       sliding_window=c.get("sliding_window") or None, model_type="llama")
        if mt == "bert":
            return cls(vocab_size=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                       heads=c["num_attention_heads"], ffn_hidden=c["intermediate_size"], norm="layernorm",
                       eps=c.get("layer_norm_eps", 1e-12), activation=_hf_act(c.get("hidden_act", "gelu")),
                       positions="learned", max_positions=c.get("max_position_embeddings", 512), causal=False,
                       pre_norm=False, bias=True, tie_embeddings=True, type_vocab_size=c.get("type_vocab_size", 2),
                       final_norm=False, embedding_norm=True, model_type="bert")
        raise ValueError(f"Config.from_hf: model_type {mt!r} is not supported (gpt2, llama, mistral, bert)")


def _hf_act(name: str) -> str:
    table = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu",
             "relu": "relu", "silu": "silu", "swish": "silu"}
    if name not in table:
        raise ValueError(f"activation {name!r} is not supported")
    return table[name]


def positions0(pos0, B: int, T: int, who: str) -> np.ndarray:
    """pos0 as B int64 first positions: integers (TypeError otherwise) with pos0 >= 0 and
    pos0 + T representable (ValueError); the KV cache's end is checked in C."""
    a = np.array(pos0, dtype=object) if isinstance(pos0, (list, tuple)) else np.asarray(pos0)
    if a.dtype == object:  # Python ints (past int64 too), or anything else
        bad = [v for v in a.flat if isinstance(v, bool) or not isinstance(v, (int, np.integer))]
        if bad:
            raise TypeError(f"{who}: pos0 must be integers, got {type(bad[0]).__name__}")
    elif a.dtype.kind not in "iu":
        raise TypeError(f"{who}: pos0 must be integers, got {a.dtype}")
    if a.size != B:
        raise ValueError(f"{who}: pos0 must have one entry per sequence (B = {B}), got shape {a.shape}")
    if B and int(a.min()) < 0:
        raise ValueError(f"{who}: pos0 must be >= 0, got {int(a.min())}")
    if B and int(a.max()) > 2**63 - 1 - T:
        raise ValueError(f"{who}: pos0 + T must be at most 2**63 - 1 (T = {T}), got pos0 = {int(a.max())}")
    return np.ascontiguousarray(a.reshape(B), dtype=np.int64)  # in range: checked above


def head_partition(cfg: Config, world: int, weights: Optional[Sequence[float]] = None) -> list:
    """Query heads per rank, in whole heads (weights for mismatched devices)."""
    return [s for _, s in partition(cfg.heads, world, weights=weights)]


class TransformerBlock:
    """One Transformer block split over the ranks of comm (see the module doc)."""

    _attention_only = False

    def __init__(self, config: Config, comm: Comm, seed: int = 0, head_partition: Optional[Sequence[int]] = None,
                 ffn_partition=None):
        if not isinstance(comm, Comm):
            raise TypeError(f"TransformerBlock: comm must be a tpcore.Comm, got {type(comm).__name__}")
        cfg = config
        self.config, self.comm = cfg, comm
        hp = _sizes(head_partition, cfg.heads, comm.size, "heads")
        fp = _sizes(ffn_partition, cfg.ffn_hidden, comm.size, "ffn_hidden")
        self._c = _C.TransformerBlock(comm._c, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_hidden,
                                      norm=cfg.norm, eps=float(cfg.eps), activation=cfg.activation,
                                      pre_norm=cfg.pre_norm, bias=cfg.bias, causal=cfg.causal,
                                      rope_theta=float(cfg.rope_theta) if cfg.positions == "rope" else 0.0,
                                      head_partition=hp, ffn_partition=fp, seed=check_seed(seed, "TransformerBlock"),
                                      attention_only=self._attention_only)
        info = self._c.info
        self.q0, self.nq, self.k0, self.nk = info["q0"], info["nq"], info["k0"], info["nk"]
        self.kv_replicated = info["kv_replicated"]
        self.head_partition = check_partition(comm, self.q0, self.nq, cfg.heads, "TransformerBlock heads")
        self._p = self._c.params()
        g = 2 if cfg.activation == "swiglu" else 1
        self.ffn_local = self._p["mlp.fc1.weight"][0].shape[0] // g if "mlp.fc1.weight" in self._p else 0
        offs = comm.all_gather(np.array([self.ffn_local], np.int64))
        self.ffn_offset = int(offs[:comm.rank].sum())
        self.ffn_partition = [(int(offs[:r].sum()), int(offs[r])) for r in range(comm.size)]

    # ------------------------------------------------------------- parameters
    def parameters(self):
        """(param, grad) pairs of this rank's shard (views of C memory)."""
        return list(self._p.values())

    def named_parameters(self) -> Dict[str, tuple]:
        return dict(self._p)

    def zero_grad(self):
        for _, g in self._p.values():
            g[...] = 0

    def _slices(self):
        """name of a full tensor -> (local param name, rows of the local tensor, how to cut the full one)."""
        cfg, D = self.config, self.config.head_dim
        q = slice(self.q0 * D, (self.q0 + self.nq) * D)
        kv = slice(self.k0 * D, (self.k0 + self.nk) * D)
        nq, nk = self.nq * D, self.nk * D
        lo, n = self.ffn_offset, self.ffn_local
        F = cfg.ffn_hidden
        fc1_rows = (np.r_[lo:lo + n, F + lo:F + lo + n] if cfg.activation == "swiglu" else np.arange(lo, lo + n))
        out = {
            "norm1.weight": ("norm1.weight", slice(None), slice(None)),
            "norm1.bias": ("norm1.bias", slice(None), slice(None)),
            "norm2.weight": ("norm2.weight", slice(None), slice(None)),
            "norm2.bias": ("norm2.bias", slice(None), slice(None)),
            "attn.q.weight": ("attn.qkv.weight", slice(0, nq), q),
            "attn.k.weight": ("attn.qkv.weight", slice(nq, nq + nk), kv),
            "attn.v.weight": ("attn.qkv.weight", slice(nq + nk, nq + 2 * nk), kv),
            "attn.q.bias": ("attn.qkv.bias", slice(0, nq), q),
            "attn.k.bias": ("attn.qkv.bias", slice(nq, nq + nk), kv),
            "attn.v.bias": ("attn.qkv.bias", slice(nq + nk, nq + 2 * nk), kv),
            "attn.out.weight": ("attn.out.weight", slice(None), (slice(None), q)),
            "attn.out.bias": ("attn.out.bias", slice(None), slice(None)),
            "mlp.fc1.weight": ("mlp.fc1.weight", slice(None), fc1_rows),
            "mlp.fc1.bias": ("mlp.fc1.bias", slice(None), fc1_rows),
            "mlp.fc2.weight": ("mlp.fc2.weight", slice(None), (slice(None), slice(lo, lo + n))),
            "mlp.fc2.bias": ("mlp.fc2.bias", slice(None), slice(None)),
        }
        return {k: v for k, v in out.items() if v[0] in self._p}

    def full_shapes(self) -> Dict[str, tuple]:
        cfg, D = self.config, self.config.head_dim
        C, H, Hk, F = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
        g = 2 if cfg.activation == "swiglu" else 1
        shapes = {"norm1.weight": (C,), "norm1.bias": (C,), "norm2.weight": (C,), "norm2.bias": (C,),
                  "attn.q.weight": (H * D, C), "attn.k.weight": (Hk * D, C), "attn.v.weight": (Hk * D, C),
                  "attn.q.bias": (H * D,), "attn.k.bias": (Hk * D,), "attn.v.bias": (Hk * D,),
                  "attn.out.weight": (C, H * D), "attn.out.bias": (C,), "mlp.fc1.weight": (g * F, C),
                  "mlp.fc1.bias": (g * F,), "mlp.fc2.weight": (C, F), "mlp.fc2.bias": (C,)}
        return {k: shapes[k] for k in self._slices()}

    def load_full(self, tensors: Dict[str, np.ndarray], strict: bool = True) -> None:
        """Keep this rank's slices of full tensors (names in the module doc; any float dtype,
        memory-mapped arrays and lazy views included: only this rank's slices are read)."""
        shapes = self.full_shapes()
        if strict:
            missing = sorted(set(shapes) - set(tensors))
            extra = sorted(set(tensors) - set(shapes))
            if missing or extra:
                raise KeyError(f"TransformerBlock.load_full: missing {missing}, unexpected {extra}")
        for name, (local, rows, cut) in self._slices().items():
            if name not in tensors:
                continue
            t = tensors[name]  # an array, a memory-mapped array or a lazy view (hf.View): only the cut is read
            if not hasattr(t, "shape"):
                t = np.asarray(t)
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"TransformerBlock.load_full: {name} has shape {tuple(t.shape)}, expected {shapes[name]}")
            dst = self._p[local][0][rows]
            part = t[cut]
            part = np.asarray(part) if isinstance(part, np.ndarray) else part
            if tuple(np.shape(part)) != dst.shape:
                raise ValueError(f"TransformerBlock.load_full: {name}: slice has shape {np.shape(part)}, "
                                 f"expected {dst.shape}")
            self._p[local][0][rows] = to_float32(part)

    def gather_full(self, grads: bool = False) -> Dict[str, np.ndarray]:
        """The full tensors (or their gradients) rebuilt from every rank (collective)."""
        cfg, D, comm = self.config, self.config.head_dim, self.comm
        shapes = self.full_shapes()
        out = {}
        which = 1 if grads else 0
        # attention rows/cols by head; replicated KV heads are identical on their ranks: keep one
        heads = comm.all_gather(np.array([self.q0, self.nq, self.k0, self.nk], np.int64)).reshape(-1, 4)
        for name, (local, rows, cut) in self._slices().items():
            mine = np.ascontiguousarray(self._p[local][which][rows])
            shape = shapes[name]
            if name.startswith(("norm", "attn.out.bias", "mlp.fc2.bias")):
                out[name] = mine.copy()
                continue
            if name == "attn.out.weight":
                out[name] = comm.all_gather(mine, axis=1, sizes=[int(h[1]) * D for h in heads])
                continue
            if name.startswith("mlp.fc2.weight"):
                out[name] = comm.all_gather(mine, axis=1, sizes=[s for _, s in self.ffn_partition])
                continue
            if name.startswith("mlp.fc1"):
                g = 2 if cfg.activation == "swiglu" else 1
                blocks = comm.all_gather(mine, sizes=[g * s for _, s in self.ffn_partition])
                if g == 2:
                    o, gates, ups = 0, [], []
                    for _, s in self.ffn_partition:
                        gates.append(blocks[o:o + s])
                        ups.append(blocks[o + s:o + 2 * s])
                        o += 2 * s
                    blocks = np.concatenate(gates + ups)
                out[name] = blocks
                continue
            # q/k/v weight or bias: rank-major head blocks
            is_q = name.startswith("attn.q")
            sizes = [int(h[1] if is_q else h[3]) * D for h in heads]
            blocks = comm.all_gather(mine, sizes=sizes)
            full = np.zeros(shape, np.float32)
            o = 0
            for h in heads:
                first, count = (int(h[0]), int(h[1])) if is_q else (int(h[2]), int(h[3]))
                full[first * D:(first + count) * D] = blocks[o:o + count * D]
                o += count * D
            out[name] = full
        return out

    # ---------------------------------------------------------------- compute
    def cache(self, batch: int, max_len: int) -> None:
        """(Re)allocate the KV cache: batch sequences of up to max_len tokens (this rank's KV heads)."""
        self._c.cache(batch, max_len)  # integers in [1, 2**31 - 1] whose K/V fit (checked in C)

    def forward(self, x: np.ndarray, pos0=None, key_mask=None, use_cache: bool = False,
                need_backward: bool = True) -> np.ndarray:
        """y (B, T, hidden) from x (B, T, hidden); pos0[B] the position of each sequence's first
        token (decoding), key_mask (B, T) of tokens to attend to (padding)."""
        x32 = as_float32(x, "x", "TransformerBlock")
        if x32.ndim != 3 or x32.shape[-1] != self.config.hidden:
            raise ValueError(f"TransformerBlock: x must have shape (B, T, {self.config.hidden}), got {x.shape}")
        B, T, C = x32.shape
        p = None if pos0 is None else positions0(pos0, B, T, "TransformerBlock")
        m = None if key_mask is None else np.ascontiguousarray(np.asarray(key_mask).reshape(B, T) != 0, np.uint8).reshape(-1)
        y = self._c.forward(x32.reshape(B * T, C), B, T, pos0=p, key_mask=m, use_cache=use_cache,
                            need_backward=need_backward)
        return y.reshape(B, T, C)

    __call__ = forward

    def backward(self, dy: np.ndarray) -> np.ndarray:
        d = as_float32(dy, "dy", "TransformerBlock")
        if d.ndim < 1 or d.shape[-1] != self.config.hidden:
            raise ValueError(f"TransformerBlock: dy must have shape (B, T, {self.config.hidden}), got {d.shape}")
        shape = d.shape
        return self._c.backward(d.reshape(-1, self.config.hidden)).reshape(shape)

    def __repr__(self):
        return (f"TransformerBlock(hidden={self.config.hidden}, heads {self.q0}:{self.q0 + self.nq} and kv heads "
                f"{self.k0}:{self.k0 + self.nk} on rank {self.comm.rank})")


class ParallelAttention(TransformerBlock):
    """Attention alone, heads split over the ranks (Megatron): fused QKV projection
    (column-parallel), rotary positions when config.positions == "rope", causal or
    bidirectional softmax attention with a padding mask, grouped-query heads, a KV
    cache, and the row-parallel output projection: y = attn(x) with one all-reduce in
    forward and one (at the QKV input) in backward.  No norms, MLP or residual (those
    are TransformerBlock's).  Parameters: attn.q/k/v/out weights (and biases)."""

    _attention_only = True

    def __repr__(self):
        return (f"ParallelAttention(hidden={self.config.hidden}, heads {self.q0}:{self.q0 + self.nq} and kv heads "
                f"{self.k0}:{self.k0 + self.nk} on rank {self.comm.rank})")
