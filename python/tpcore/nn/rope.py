"""Rotary frequencies of a `Config`: Hugging Face's rope scalings as tables for the rope kernel.

`rope_frequencies(cfg, seq_len=None, local=False)` gives ``(inv_freq, factor)``: the float32
table ``inv_freq[i]`` (``head_dim // 2`` values; the pair ``(i, i + head_dim/2)`` of every
head turns by ``float32(pos) * inv_freq[i]``) and the factor that multiplies cos and sin
(YaRN's and LongRoPE's attention factor; 1 for the others), the two arguments the rope
kernel takes (``tp_rope_apply``, ``tpcore._C.rope_apply``).  They are those of transformers
5.25 (``transformers/modeling_rope_utils.py``: ``ROPE_INIT_FUNCTIONS`` and the
``dynamic_rope_update`` of the forward), step by step in float32 where transformers computes
in float32 tensors and in Python floats where it computes in Python floats:

=========  ============================================================================
default    ``1 / theta^(2i/D)`` (``cfg.rope_theta``)
linear     the default divided by ``factor``
llama3     Llama 3.1: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
           ``original_max_position_embeddings`` (default: ``cfg.max_positions``)
dynamic    NTK: the base grows to ``theta ((factor seq_len / max) - (factor - 1))^(D/(D-2))``
           once ``seq_len > cfg.max_positions`` (``max`` = ``cfg.max_positions``), computed
           as transformers' forward computes it at that seq_len
yarn       ``factor`` (None: ``max_positions / original``), ``beta_fast`` (32),
           ``beta_slow`` (1), ``truncate`` (True), ``attention_factor`` or ``mscale`` /
           ``mscale_all_dim``, ``original_max_position_embeddings``
longrope   ``short_factor`` / ``long_factor`` (``D/2`` each; the long ones once
           ``seq_len > original_max_position_embeddings``), ``attention_factor`` (or from
           ``factor``, itself ``max_positions / original`` when absent)
=========  ============================================================================

The fields are read from ``cfg.rope_scaling`` (Hugging Face's dict, keys as Hugging Face
writes them: ``rope_type`` or the older ``type``; a ``rope_theta`` there must agree with
``cfg.rope_theta``; a Phi-3 config's top-level ``original_max_position_embeddings`` belongs
in the dict, as transformers' ``standardize_rope_params`` moves it), ``cfg.rope_theta``,
``cfg.max_positions`` (``max_position_embeddings``) and ``cfg.head_dim``.  ``local=True``
asks for a sliding layer's table: Gemma 3's ``cfg.rope_local_theta`` when set (plain rotary,
no scaling), else the global one.  A rope type outside `ROPE_TYPES`, a missing or bad field,
a per-layer-type (nested) dict or a ``partial_rotary_factor`` other than 1 is a ValueError
naming the field and what is supported.

``seq_len`` is the largest position of the forward + 1; the tables of ``dynamic`` and
``longrope`` depend on it (`depends_on_length`), the others do not.  transformers'
dynamic rope keeps the longest table it has grown to until a forward falls back below
``max_position_embeddings``; here the table is always that of the forward's own seq_len
(transformers' at a fresh start).

Every step but one is transformers' own, bit for bit: the powers ``theta^e`` are correctly
rounded to float32 here (float64 ``pow`` rounded once), while torch's CPU ``pow`` on float32
vectors (SLEEF, within 1 ulp; its scalar tail is glibc's, correctly rounded) rounds about
one in 60 of them the other way; those elements (and only those) differ by 1 ulp, 2 after
the steps that follow (tests/nn/test_rope_scaling.py checks both: bit for bit with torch's
powers substituted, and at most 2 ulp, equal wherever the two powers agree).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np

from tpcore.utils.args import shown

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
LENGTH_DEPENDENT = ("dynamic", "longrope")
# the per-layer-type keys of transformers' nested rope_parameters (Gemma 3)
_NESTED_KEYS = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")

_f32 = np.float32


def _pow32(base: np.float32, exps: np.ndarray) -> np.ndarray:
    """float32 base ** float32 exps, each correctly rounded to float32."""
    return (np.float64(base) ** exps.astype(np.float64)).astype(np.float32)


def _recip32(x: np.ndarray) -> np.ndarray:
    """torch's ``c / t`` for a Python number c: ``t.reciprocal() * c`` (two float32 roundings)."""
    return (_f32(1.0) / x).astype(np.float32)


def _exponents(dim: int) -> np.ndarray:
    """``torch.arange(0, dim, 2).float() / dim`` in float32."""
    return (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / _f32(dim)).astype(np.float32)


def _default(base: Any, dim: int) -> np.ndarray:
    """``1.0 / (base ** (arange(0, dim, 2).float() / dim))``, base cast to float32."""
    return _recip32(_pow32(_f32(base), _exponents(dim)))


def _bad(field: str, expected: str, found: Any) -> ValueError:
    return ValueError(f"rope_frequencies: rope_scaling's {field} must be {expected}, got {shown(found)}")


def _num(p: Dict[str, Any], key: str, *, required: bool = True, default: Any = None, positive: bool = True,
         allow_none: bool = False) -> Any:
    """p[key] as a finite float (> 0 when positive); missing: an error when required, else default."""
    if key not in p or (p[key] is None and not allow_none and not required):
        if required:
            raise ValueError(f"rope_frequencies: rope_scaling of rope_type {_kind(p)!r} needs the field {key!r} "
                             f"(it has {sorted(p)})")
        return default
    v = p[key]
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
        raise _bad(key, "a finite number", v)
    if positive and not v > 0:
        raise _bad(key, "> 0", v)
    return v


def _kind(p: Dict[str, Any]) -> str:
    return p.get("rope_type", p.get("type", "default"))


def _params(cfg: Any, local: bool) -> Tuple[str, Dict[str, Any], float]:
    """(rope type, the scaling dict, theta) of the layers `local` names."""
    if local and getattr(cfg, "rope_local_theta", None) is not None:
        return "default", {}, float(cfg.rope_local_theta)
    theta = getattr(cfg, "rope_theta", None)
    p = getattr(cfg, "rope_scaling", None)
    if p is None:
        p = {}
    if not isinstance(p, dict):
        raise TypeError(f"rope_frequencies: cfg.rope_scaling must be a dict or None, got {shown(p)}")
    if any(k in p and isinstance(p[k], dict) for k in _NESTED_KEYS):
        raise ValueError(f"rope_frequencies: rope_scaling holds rope parameters per layer type ({sorted(p)}); "
                         f"give the full-attention layers' dict as rope_scaling and the sliding layers' plain "
                         f"base as rope_local_theta")
    kind = _kind(p)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_frequencies: rope_scaling's rope_type {kind!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    if "rope_theta" in p and p["rope_theta"] is not None:
        t = _num(p, "rope_theta")
        if theta is not None and float(t) != float(theta):
            raise ValueError(f"rope_frequencies: rope_scaling's rope_theta ({t}) differs from cfg.rope_theta "
                             f"({theta})")
        theta = t
    if isinstance(theta, bool) or not isinstance(theta, (int, float, np.integer, np.floating)) or \
            not math.isfinite(theta) or not theta > 0:
        raise ValueError(f"rope_frequencies: cfg.rope_theta must be a finite number > 0, got {shown(theta)}")
    prf = p.get("partial_rotary_factor", 1.0)
    if prf is not None and prf != 1.0:
        raise ValueError(f"rope_frequencies: rope_scaling's partial_rotary_factor must be 1 (rotary on the whole "
                         f"head; supported: 1), got {shown(prf)}")
    return kind, p, float(theta)


def _dims(cfg: Any) -> Tuple[int, int]:
    """(head_dim, max_positions) of cfg, checked."""
    dim, mpe = getattr(cfg, "head_dim", None), getattr(cfg, "max_positions", None)
    for name, v, lo in (("head_dim", dim, 2), ("max_positions", mpe, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"rope_frequencies: cfg.{name} must be an integer >= {lo}, got {shown(v)}")
    if dim % 2:
        raise ValueError(f"rope_frequencies: cfg.head_dim must be even, got {dim}")
    return int(dim), int(mpe)


def _original(p: Dict[str, Any], mpe: int) -> int:
    v = p.get("original_max_position_embeddings")
    if v is None:  # transformers' standardize_rope_params: setdefault(..., max_position_embeddings)
        return mpe
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise _bad("original_max_position_embeddings", "an integer >= 1", v)
    return int(v)


def _llama3(p: Dict[str, Any], theta: float, dim: int, mpe: int) -> np.ndarray:
    """transformers' _compute_llama3_parameters."""
    factor = _num(p, "factor")
    low, high = _num(p, "low_freq_factor"), _num(p, "high_freq_factor")
    if high <= low:  # transformers' _validate_llama3_rope_parameters warns; the smoothing divides by it
        raise _bad("high_freq_factor", f"> low_freq_factor ({low})", high)
    old = _original(p, mpe)
    inv = _default(theta, dim)
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = _recip32(inv) * _f32(2 * math.pi)
    scaled = np.where(wavelen > _f32(low_wavelen), inv / _f32(factor), inv).astype(np.float32)
    smooth = ((_recip32(wavelen) * _f32(old) - _f32(low)) / _f32(high - low)).astype(np.float32)
    smoothed = ((_f32(1) - smooth) * scaled / _f32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < _f32(high_wavelen)) & ~(wavelen > _f32(low_wavelen))
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _dynamic(p: Dict[str, Any], theta: float, dim: int, mpe: int, seq_len: Optional[int]) -> np.ndarray:
    """transformers' _compute_dynamic_ntk_parameters: at init (Python floats) while seq_len <=
    max_position_embeddings, else as dynamic_rope_update calls it (seq_len an int64 tensor:
    float32 steps)."""
    factor = _num(p, "factor")
    if seq_len is None or seq_len <= mpe:
        base: Any = theta * ((factor * mpe / mpe) - (factor - 1)) ** (dim / (dim - 2))
        if isinstance(base, complex) or not math.isfinite(base) or not base > 0:
            raise _bad("factor", "one that keeps the base finite and > 0", factor)
        return _default(base, dim)
    with np.errstate(all="ignore"):
        r = (_f32(factor) * _f32(seq_len) / _f32(mpe) - _f32(factor - 1)).astype(np.float32)
        grown = _f32(np.float64(r) ** (dim / (dim - 2)))  # torch: std::pow(float, double) for a 0-dim tensor
        base = _f32(theta) * grown
    if not (np.isfinite(base) and base > 0):
        raise _bad("factor", f"one that keeps the base finite and > 0 at seq_len {seq_len}", factor)
    return _default(base, dim)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: Dict[str, Any], theta: float, dim: int, mpe: int) -> Tuple[np.ndarray, float]:
    """transformers' _compute_yarn_parameters."""
    if "factor" not in p:
        raise ValueError("rope_frequencies: rope_scaling of rope_type 'yarn' needs the field 'factor' (None: "
                         f"max_positions / original_max_position_embeddings; it has {sorted(p)})")
    factor = _num(p, "factor", allow_none=True)
    attention = _num(p, "attention_factor", required=False, allow_none=True)
    mscale = _num(p, "mscale", required=False, positive=False, allow_none=True)
    mscale_all = _num(p, "mscale_all_dim", required=False, positive=False, allow_none=True)
    old = _original(p, mpe)
    if factor is None:
        factor = mpe / old
    if attention is None:
        attention = (float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
                     if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast = _num(p, "beta_fast", required=False, allow_none=True) or 32
    beta_slow = _num(p, "beta_slow", required=False, allow_none=True) or 1
    truncate = p.get("truncate", True)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: "Prevent singularity"
    pos_freqs = _pow32(_f32(theta), _exponents(dim))
    extrapolation = _recip32(pos_freqs)
    interpolation = _recip32((_f32(factor) * pos_freqs).astype(np.float32))
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - _f32(low)) / _f32(high - low), 0, 1).astype(np.float32)
    extra = (_f32(1) - ramp).astype(np.float32)
    inv = (interpolation * (_f32(1) - extra) + extrapolation * extra).astype(np.float32)
    return inv, float(attention)


def _longrope(p: Dict[str, Any], theta: float, dim: int, mpe: int, seq_len: Optional[int]) -> Tuple[np.ndarray, float]:
    """transformers' _compute_longrope_parameters (short factors at init; the forward's
    longrope_frequency_update takes the long ones once seq_len > original_max_position_embeddings)."""
    old = _original(p, mpe)
    factors = {}
    for key in ("short_factor", "long_factor"):
        v = p.get(key)
        if v is None:
            raise ValueError(f"rope_frequencies: rope_scaling of rope_type 'longrope' needs the field {key!r} "
                             f"({dim // 2} numbers; it has {sorted(p)})")
        try:
            a = np.asarray(v, dtype=np.float64)
        except (TypeError, ValueError):
            raise _bad(key, f"{dim // 2} numbers", v) from None
        if a.shape != (dim // 2,) or not np.all(np.isfinite(a)) or not np.all(a > 0):
            raise _bad(key, f"{dim // 2} finite numbers > 0 (head_dim / 2)", v)
        factors[key] = np.asarray(v, dtype=np.float32)
    factor = _num(p, "factor", required=False, allow_none=True)
    attention = _num(p, "attention_factor", required=False, allow_none=True)
    if factor is None:
        factor = mpe / old
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    ext = factors["long_factor" if seq_len and seq_len > old else "short_factor"]
    inv = _recip32((ext * _pow32(_f32(theta), _exponents(dim))).astype(np.float32))
    return inv, float(attention)


def rope_type(cfg: Any, local: bool = False) -> str:
    """The rope type of cfg's global layers (or of its sliding ones, `local`): one of `ROPE_TYPES`."""
    return _params(cfg, bool(local))[0]


def depends_on_length(cfg: Any, local: bool = False) -> bool:
    """Whether `rope_frequencies` of cfg changes with seq_len (dynamic and longrope): the model
    then recomputes the table for each forward's largest position."""
    return rope_type(cfg, local) in LENGTH_DEPENDENT


def rope_frequencies(cfg: Any, seq_len: Optional[int] = None, local: bool = False) -> Tuple[np.ndarray, float]:
    """The rotary table of a Config and the factor on cos and sin, as transformers computes them.

    Parameters
    ----------
    cfg : tpcore.nn.Config
        Reads rope_theta, rope_scaling, rope_local_theta, max_positions and head_dim.
    seq_len : int or None
        The forward's largest position + 1 (dynamic and longrope depend on it); None: the
        table transformers builds at init (for dynamic: at max_positions; for longrope: the
        short factors).
    local : bool
        The table of the sliding-window layers: rope_local_theta's plain rotary when set.

    Returns
    -------
    (inv_freq, factor) : (numpy.ndarray float32 of shape (head_dim // 2,), float)

    Raises
    ------
    ValueError
        An unsupported rope type (the message lists `ROPE_TYPES`), a missing or bad field
        (named), seq_len < 1.
    """
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)):
            raise TypeError(f"rope_frequencies: seq_len must be an integer >= 1 or None, got {shown(seq_len)}")
        if seq_len < 1:
            raise ValueError(f"rope_frequencies: seq_len must be >= 1, got {seq_len}")
        seq_len = int(seq_len)
    kind, p, theta = _params(cfg, bool(local))
    dim, mpe = _dims(cfg)
    factor = 1.0
    if kind == "default":
        inv = _default(theta, dim)
    elif kind == "linear":
        inv = (_default(theta, dim) / _f32(_num(p, "factor"))).astype(np.float32)
    elif kind == "llama3":
        inv = _llama3(p, theta, dim, mpe)
    elif kind == "dynamic":
        inv = _dynamic(p, theta, dim, mpe, seq_len)
    elif kind == "yarn":
        inv, factor = _yarn(p, theta, dim, mpe)
    else:
        inv, factor = _longrope(p, theta, dim, mpe, seq_len)
    if not (np.all(np.isfinite(inv)) and math.isfinite(factor) and factor > 0):
        raise ValueError(f"rope_frequencies: rope_scaling {p} gives non-finite frequencies or a factor <= 0 "
                         f"(factor {factor})")
    return np.ascontiguousarray(inv, dtype=np.float32), float(factor)
