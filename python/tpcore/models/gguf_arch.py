"""The architectures of GGUF files: llama.cpp's metadata keys as a tpcore `Config`, its
tensor names as tpcore's (`tpcore.models.gguf` reads the file and hands the tensors out).

Architectures (general.architecture) and what their files hold, as llama.cpp's
convert_hf_to_gguf.py writes them:

- llama (Llama 1-3, Mistral, Mixtral; "mistral" too): attn_q / attn_k rows permuted within
  each head (llama.cpp rotates adjacent pairs; put back by `unpermute_rows`).  Llama 3's
  rope scaling is the `rope_freqs` tensor (a factor per frequency): its llama3 parameters
  are recovered and checked to give those factors again (`llama3_scaling`), else refused.
  `{arch}.attention.sliding_window` (Mistral) -> sliding_window on every layer.
  `{arch}.expert_count` / `expert_used_count` (Mixtral): the router ffn_gate_inp (E, C) and
  the experts stacked in 3-D tensors ffn_gate_exps / ffn_up_exps (E, F, C) and
  ffn_down_exps (E, C, F), handed out per expert as blocks.{i}.moe.experts.{e}.fc1 =
  [gate; up] and .fc2, the router as blocks.{i}.moe.router.
- qwen2: biases on Q, K, V (qkv_bias); qwen3: attn_q_norm / attn_k_norm (qk_norm);
  qwen3moe: qwen3 with experts (expert_feed_forward_length wide, top-k renormalized as
  llama.cpp does).
- gemma2, gemma3: the converter stores every norm weight as 1 + w, which is what tpcore
  holds with norm_unit_offset (nothing is added here); post_attention_norm /
  post_ffw_norm (post_norms), GeGLU, embeddings scaled by sqrt(hidden); gemma2's soft-caps
  (`{arch}.attn_logit_softcapping`, `final_logit_softcapping`) and alternating sliding
  layers; gemma3's 5 sliding : 1 global layers (`attention.sliding_window_pattern`, 6
  when absent, as llama.cpp; no `attention.sliding_window`, or 0: every layer global),
  local rotary base `rope.freq_base_swa` (10000 when absent) and QK-norm.  The attention
  scale: `attention.scale`, else llama.cpp's (head_dim ** -0.5; the 27B models, 46 resp.
  62 layers: (hidden / heads) ** -0.5).
- phi3: the fused attn_qkv (q, k, v rows in that order) cut into attn.q/k/v, and the fused
  ffn_up ([gate; up], 2F rows) taken as mlp.fc1 whole; longrope's rope_factors_long /
  rope_factors_short tensors as HF's longrope dict.
- gpt2.

Every key tpcore cannot honour (another architecture, rope scaling type, partial rotary
dimensions, experts where the architecture has none, shared experts...) is refused by
name, with what is supported, before anything is sized by the file.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from tpcore.io.formats import bad

__all__ = ["ARCHS", "PERMUTED", "Meta", "config_kwargs", "layout", "llama3_scaling"]

_MISSING = object()
_INTS = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
ARCHS = ("llama", "mistral", "gpt2", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
PERMUTED = ("llama", "mistral")   # llama.cpp permutes these archs' attn_q / attn_k rows
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "gpt2": "gpt2", "qwen2": "qwen2", "qwen3": "qwen3",
                "qwen3moe": "qwen3_moe", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
_MOE = ("llama", "mistral", "qwen3moe")
_ROPE_SCALINGS = ("none", "linear", "yarn")
# llama.cpp's 27B Gemmas (by layer count) scale the scores by (hidden / heads) ** -0.5
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


class Meta:
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

    def bools(self, key, default=_MISSING):
        f = self._field(key, default)
        if f is None:
            return default
        if self._kind(f) != ["ARRAY", "BOOL"]:
            raise bad(self.path, f"metadata key {key!r}", "an array of booleans",
                      f"a value of type {'/'.join(self._kind(f))}")
        return [bool(x) for x in f.contents()]

    def floats(self, key, default=_MISSING):
        f = self._field(key, default)
        if f is None:
            return default
        kinds = self._kind(f)
        if len(kinds) != 2 or kinds[0] != "ARRAY" or kinds[1] not in ("FLOAT32", "FLOAT64"):
            raise bad(self.path, f"metadata key {key!r}", "an array of numbers", f"a value of type {'/'.join(kinds)}")
        return [float(x) for x in f.contents()]

    def has(self, key) -> bool:
        return key in self.fields


def llama3_scaling(factors: np.ndarray, theta: float, dim: int) -> Optional[Dict[str, Any]]:
    """Hugging Face's llama3 rope_scaling dict that gives llama.cpp's rope_freqs factors
    (HF's inv_freq = plain inv_freq / factor, per frequency), or None: all factors 1.

    HF's llama3 factor of a frequency of wavelength w depends on (factor, a, b) only:
    1 where s = a / w - b > 1, factor where s < 0, 1 / ((1 - s) / factor + s) between,
    with a = original_max_position_embeddings / (high - low), b = low / (high - low).
    a and b are solved from the factors between 1 and factor (low_freq_factor taken as
    1, the others follow); then the dict's factors are computed again as HF computes them
    and must equal the file's (relative 1e-5), else ValueError."""
    f = np.asarray(factors, np.float64)
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    wl = 2 * math.pi / theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    top = float(f.max())
    if not np.all(f > 0) or top <= 1:
        raise ValueError("the factors are not those of llama3 rope scaling (positive, the largest above 1)")
    mid = (f > 1 + 1e-6) & (f < top * (1 - 1e-6))
    s = (1 / f[mid] - 1 / top) / (1 - 1 / top)
    b = 1 / 3                                         # Llama 3's low 1, high 4 when the factors leave it open
    if mid.sum() >= 2:
        (a, b), *_ = np.linalg.lstsq(np.stack([1 / wl[mid], -np.ones(mid.sum())], 1), s, rcond=None)
    elif mid.sum() == 1:
        a = float((s[0] + b) * wl[mid][0])
    else:                                             # a step from 1 to factor: a between the two
        ones, tops = np.flatnonzero(f <= 1 + 1e-6), np.flatnonzero(f >= top * (1 - 1e-6))
        lo = (1 + b) * wl[ones].max() if ones.size else 0.0
        hi = b * wl[tops].min()
        a = math.sqrt(lo * hi) if lo > 0 else hi / 2
    if not (a > 0 and b > 0):
        raise ValueError("the factors are not those of llama3 rope scaling (no smooth band that fits)")
    high, orig = 1 + 1 / b, a / b
    high, orig = (round(x) if abs(x - round(x)) < 1e-6 * x else float(x) for x in (high, orig))
    d = {"rope_type": "llama3", "factor": top, "low_freq_factor": 1.0, "high_freq_factor": float(high),
         "original_max_position_embeddings": orig}
    smooth = np.clip((orig / wl - 1.0) / (high - 1.0), 0, 1)
    again = np.where(wl < orig / high, 1.0, np.where(wl > orig, top, 1 / ((1 - smooth) / top + smooth)))
    if not np.allclose(again, f, rtol=1e-5, atol=0):
        raise ValueError(f"no llama3 rope scaling gives these factors (the closest, {d}, is "
                         f"{float(np.max(np.abs(again / f - 1))):.2g} off)")
    return d


def _rope_scaling(m: Meta, a: str, D: int, theta: float, ctx: int, by_name, vector) -> Tuple[Any, Dict]:
    """(Hugging Face's rope_scaling dict or None, {consumed tensor: shape}) from the
    `{a}.rope.scaling.*` keys and the factor tensors (rope_freqs; phi3's longrope)."""
    kind = m.str(f"{a}.rope.scaling.type", "none") or "none"
    supported = (f"one of {', '.join(_ROPE_SCALINGS)} (Llama 3's scaling is the rope_freqs tensor, Phi-3's "
                 f"longrope the rope_factors_long/short tensors)")
    if kind not in _ROPE_SCALINGS:
        raise bad(m.path, f"metadata key '{a}.rope.scaling.type'", supported, kind)
    linear = m.num(f"{a}.rope.scale_linear", None)
    factor = m.num(f"{a}.rope.scaling.factor", linear)
    for key in (f"{a}.rope.scaling.attn_factor", f"{a}.rope.scaling.yarn_log_multiplier"):
        if m.has(key) and not (kind == "none" and a == "phi3" and key.endswith("attn_factor")):
            raise bad(m.path, f"metadata key {key!r}", "no such key (tpcore's yarn takes Hugging Face's default "
                      "attention factor)", m.num(key, positive=False))
    consumed: Dict[str, Tuple[int, ...]] = {}
    out = None
    if kind == "linear" or (kind == "none" and linear not in (None, 1.0)):
        if factor is None:
            raise bad(m.path, f"metadata key '{a}.rope.scaling.factor'", "the linear scaling factor", "no such key")
        out = {"rope_type": "linear", "factor": factor}
    elif kind == "yarn":
        out = {"rope_type": "yarn", "factor": m.num(f"{a}.rope.scaling.factor"),
               "original_max_position_embeddings": m.int(f"{a}.rope.scaling.original_context_length")}
        for k in ("beta_fast", "beta_slow"):
            v = m.num(f"{a}.rope.scaling.yarn_{k}", None)
            if v is not None:
                out[k] = v
    if "rope_freqs.weight" in by_name:
        if out is not None:
            raise bad(m.path, "tensor 'rope_freqs.weight'", f"no rope_freqs with {a}.rope.scaling.type={kind}",
                      "both")
        consumed["rope_freqs.weight"] = (D // 2,)
        try:
            out = llama3_scaling(vector("rope_freqs.weight", (D // 2,)), theta, D)
        except ValueError as e:
            raise bad(m.path, "tensor 'rope_freqs.weight'", "llama3 rope scaling factors", str(e)) from e
    if a == "phi3" and ("rope_factors_long.weight" in by_name or "rope_factors_short.weight" in by_name):
        if out is not None:
            raise bad(m.path, "tensor 'rope_factors_long.weight'", f"no longrope with {out['rope_type']}", "both")
        for n in ("rope_factors_long.weight", "rope_factors_short.weight"):
            consumed[n] = (D // 2,)
        orig = m.int(f"{a}.rope.scaling.original_context_length")
        out = {"rope_type": "longrope", "original_max_position_embeddings": orig, "factor": ctx / orig,
               "long_factor": [float(x) for x in vector("rope_factors_long.weight", (D // 2,))],
               "short_factor": [float(x) for x in vector("rope_factors_short.weight", (D // 2,))]}
        af = m.num(f"{a}.rope.scaling.attn_factor", None)
        if af is not None:
            out["attention_factor"] = af
    return out, consumed


def _layer_types(m: Meta, a: str, L: int) -> Tuple[str, ...]:
    """Gemma's sliding / global layers: gemma2 alternates (layer 0 sliding); gemma3's
    `attention.sliding_window_pattern` n (6 when absent, as llama.cpp): layer i slides
    unless (i + 1) % n == 0; or an array of booleans, one per layer (true: sliding)."""
    key = f"{a}.attention.sliding_window_pattern"
    f = m.fields.get(key)
    if f is not None and list(f.kinds)[:1] == ["ARRAY"]:
        flags = m.bools(key)
        if len(flags) != L:
            raise bad(m.path, f"metadata key {key!r}", f"{L} entries (one per layer)", f"{len(flags)} entries")
        return tuple("sliding_attention" if s else "full_attention" for s in flags)
    n = m.int(key, 2 if a == "gemma2" else 6)
    return tuple("sliding_attention" if (i + 1) % n else "full_attention" for i in range(L))


def _experts(m: Meta, a: str, by_name) -> Dict[str, Any]:
    """The MoE fields ({} for a dense model); refused where the architecture has none here."""
    E = m.int(f"{a}.expert_count", 0, lo=0)
    if not E:
        return {}
    if a not in _MOE:
        raise bad(m.path, f"metadata key '{a}.expert_count'",
                  f"0 (experts are supported in {', '.join(_MOE)} files only)", E)
    for key in (f"{a}.expert_shared_count", f"{a}.leading_dense_block_count"):
        if m.int(key, 0, lo=0):
            raise bad(m.path, f"metadata key {key!r}", "0 (shared experts, dense leading layers are not supported)",
                      m.int(key, 0, lo=0))
    gating = m.int(f"{a}.expert_gating_func", 1, lo=0)
    if gating != 1:
        raise bad(m.path, f"metadata key '{a}.expert_gating_func'", "1 (softmax; others are not supported)", gating)
    # the count sizes loops: it must be the experts the file holds (blk.0's stacked gate)
    t = by_name.get("blk.0.ffn_gate_exps.weight")
    if t is None or len(t.shape) != 3 or t.shape[0] != E:
        raise bad(m.path, f"metadata key '{a}.expert_count'", "the experts of blk.0.ffn_gate_exps.weight",
                  f"{E}, the tensor {'missing' if t is None else f'of shape {t.shape}'}")
    k = m.int(f"{a}.expert_used_count")
    if k > E:
        raise bad(m.path, f"metadata key '{a}.expert_used_count'", f"at most expert_count ({E})", k)
    norm = m.bool(f"{a}.expert_weights_norm", True)
    out = dict(experts=E, experts_per_token=k, norm_topk_prob=norm)
    if m.has(f"{a}.expert_feed_forward_length"):
        out["ffn_hidden"] = m.int(f"{a}.expert_feed_forward_length")
    elif a == "qwen3moe":     # llama.cpp's fallback: feed_forward_length / expert_used_count
        out["ffn_hidden"] = max(1, m.int(f"{a}.feed_forward_length") // k)
    return out


def _dims(m: Meta, a: str) -> Tuple[int, int, int, int]:
    """(hidden, heads, kv heads, head width), checked against each other."""
    C, H = m.int(f"{a}.embedding_length"), m.int(f"{a}.attention.head_count")
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
    return C, H, kv, D


def config_kwargs(m: Meta, a: str, n_tokens: Optional[int], by_name: Dict[str, Any],
                  vector: Callable[[str, Tuple[int, ...]], np.ndarray]) -> Tuple[Dict[str, Any], Dict]:
    """(the Config fields the metadata describes, tie_embeddings aside: the tensors say;
    {GGUF tensor the config consumed (rope factors): its shape}).  vector(name, shape): a
    1-D F32 tensor's values, its shape and type checked first."""
    if a not in ARCHS:
        raise bad(m.path, "metadata key 'general.architecture'", f"one of {', '.join(ARCHS)}", a)
    vocab = m.int(f"{a}.vocab_size", None)
    if vocab is None:
        if n_tokens is None:
            raise bad(m.path, f"metadata key '{a}.vocab_size'", "the vocabulary size (or tokenizer.ggml.tokens)",
                      "neither key in the file")
        vocab = n_tokens
    base = dict(vocab_size=vocab, layers=m.int(f"{a}.block_count"), max_positions=m.int(f"{a}.context_length", 2048),
                model_type=_MODEL_TYPES[a])
    if a == "gpt2":
        C, H = m.int(f"{a}.embedding_length"), m.int(f"{a}.attention.head_count")
        if C % H:
            raise bad(m.path, f"metadata key '{a}.attention.head_count'", f"a divisor of {a}.embedding_length ({C})", H)
        return dict(base, hidden=C, heads=H, ffn_hidden=m.int(f"{a}.feed_forward_length"), norm="layernorm",
                    eps=m.num(f"{a}.attention.layer_norm_epsilon", 1e-5), activation="gelu_tanh",
                    positions="learned", bias=True, kv_heads=H), {}
    C, H, kv, D = _dims(m, a)
    theta = m.num(f"{a}.rope.freq_base", 10000.0)
    kw = dict(base, hidden=C, heads=H, kv_heads=kv, head_dim=D if D * H != C else None, norm="rmsnorm",
              eps=m.num(f"{a}.attention.layer_norm_rms_epsilon", positive=False), activation="swiglu",
              positions="rope", rope_theta=theta, bias=False)
    kw["rope_scaling"], consumed = _rope_scaling(m, a, D, theta, kw["max_positions"], by_name, vector)
    kw.update(_experts(m, a, by_name))            # (qwen3moe: ffn_hidden, the experts' width)
    if "ffn_hidden" not in kw:
        kw["ffn_hidden"] = m.int(f"{a}.feed_forward_length")
    window = m.int(f"{a}.attention.sliding_window", 0, lo=0) or None
    if a in ("llama", "mistral", "phi3"):
        kw["sliding_window"] = window
    if a in ("llama", "mistral") and (kw.get("experts") or window):
        kw["model_type"] = "mixtral" if kw.get("experts") else "mistral"   # Hugging Face's model_type
    if a == "qwen2":
        kw["qkv_bias"] = True
    if a in ("qwen3", "qwen3moe", "gemma3"):
        kw["qk_norm"] = True
    if a in ("gemma2", "gemma3"):
        scale = m.num(f"{a}.attention.scale", None)
        if scale is None and kw["layers"] == _GEMMA_27B_LAYERS[a]:
            scale = (C / H) ** -0.5
        kw.update(activation="geglu", post_norms=True, norm_unit_offset=True, embed_scale=math.sqrt(C),
                  attn_scale=scale if scale is not None and not math.isclose(scale, D ** -0.5) else None,
                  attn_softcap=m.num(f"{a}.attn_logit_softcapping", None),
                  final_softcap=m.num(f"{a}.final_logit_softcapping", None))
        if a == "gemma2" or window:   # gemma3 without a window (or 0): every layer global, as llama.cpp
            kw.update(sliding_window=window or 4096, layer_types=_layer_types(m, a, kw["layers"]))
            if a == "gemma3":
                kw["rope_local_theta"] = m.num(f"{a}.rope.freq_base_swa", 10000.0)
    return kw, consumed


def layout(cfg, arch: str, untied: bool):
    """{tpcore name: [(GGUF tensor, first row, rows, permute heads or 0, expert or None)]}
    and {GGUF name: the shape the config implies, outermost first}: everything tpcore reads."""
    C, V, F, L = cfg.hidden, cfg.vocab_size, cfg.ffn_hidden, cfg.layers
    H, Hk, D, E = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.experts
    src: Dict[str, list] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}

    def one(ours, theirs, shape, heads=0, first=0, rows=None, expert=None):
        shapes[theirs] = shape
        n = (shape[0] if expert is None else shape[1]) if rows is None else rows
        src.setdefault(ours, []).append((theirs, first, n, heads, expert))
    one("wte.weight", "token_embd.weight", (V, C))
    if untied:
        one("lm_head.weight", "output.weight", (V, C))
    if arch == "gpt2":
        _gpt2_layout(cfg, one)
        return src, shapes
    perm = arch in PERMUTED
    one("final_norm.weight", "output_norm.weight", (C,))
    for i in range(L):
        q, p = f"blocks.{i}.", f"blk.{i}."
        one(q + "norm1.weight", p + "attn_norm.weight", (C,))
        if arch == "phi3":
            for j, (n, rows) in enumerate((("q", H * D), ("k", Hk * D), ("v", Hk * D))):
                one(q + f"attn.{n}.weight", p + "attn_qkv.weight", ((H + 2 * Hk) * D, C),
                    first=(0, H * D, (H + Hk) * D)[j], rows=rows)
        else:
            one(q + "attn.q.weight", p + "attn_q.weight", (H * D, C), heads=H if perm else 0)
            one(q + "attn.k.weight", p + "attn_k.weight", (Hk * D, C), heads=Hk if perm else 0)
            one(q + "attn.v.weight", p + "attn_v.weight", (Hk * D, C))
        if cfg.qkv_bias:
            for n, rows in (("q", H * D), ("k", Hk * D), ("v", Hk * D)):
                one(q + f"attn.{n}.bias", p + f"attn_{n}.bias", (rows,))
        if cfg.qk_norm:
            one(q + "attn.q_norm.weight", p + "attn_q_norm.weight", (D,))
            one(q + "attn.k_norm.weight", p + "attn_k_norm.weight", (D,))
        one(q + "attn.out.weight", p + "attn_output.weight", (C, H * D))
        one(q + "norm2.weight", p + "ffn_norm.weight", (C,))
        if cfg.post_norms:
            one(q + "attn_post_norm.weight", p + "post_attention_norm.weight", (C,))
            one(q + "mlp_post_norm.weight", p + "post_ffw_norm.weight", (C,))
        if E:
            one(q + "moe.router.weight", p + "ffn_gate_inp.weight", (E, C))
            for e in range(E):
                x = q + f"moe.experts.{e}."
                one(x + "fc1.weight", p + "ffn_gate_exps.weight", (E, F, C), expert=e)
                one(x + "fc1.weight", p + "ffn_up_exps.weight", (E, F, C), expert=e)
                one(x + "fc2.weight", p + "ffn_down_exps.weight", (E, C, F), expert=e)
        elif arch == "phi3":
            one(q + "mlp.fc1.weight", p + "ffn_up.weight", (2 * F, C))   # fused [gate; up], as tpcore's fc1
            one(q + "mlp.fc2.weight", p + "ffn_down.weight", (C, F))
        else:
            one(q + "mlp.fc1.weight", p + "ffn_gate.weight", (F, C))
            one(q + "mlp.fc1.weight", p + "ffn_up.weight", (F, C))
            one(q + "mlp.fc2.weight", p + "ffn_down.weight", (C, F))
    return src, shapes


def _gpt2_layout(cfg, one) -> None:
    C, F = cfg.hidden, cfg.ffn_hidden
    one("wpe.weight", "position_embd.weight", (cfg.max_positions, C))
    for w in ("weight", "bias"):
        one(f"final_norm.{w}", f"output_norm.{w}", (C,))
    for i in range(cfg.layers):
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
