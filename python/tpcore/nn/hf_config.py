"""Hugging Face config.json of the decoder families (Llama 2/3.x, Mistral, Qwen 2/2.5/3,
Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE) -> the keyword arguments of tpcore's Config.

Each field is read as transformers 5.25 reads it (its configuration_*.py and
modeling_*.py): a field the file lacks takes that family's class default (Mistral's
sliding_window 4096, Qwen3's head_dim 128, Gemma 2's soft-caps 50 and 30...), the rotary
parameters come from the old ``rope_theta`` / ``rope_scaling`` fields or transformers 5's
``rope_parameters`` (Gemma 3: per layer type), and anything tpcore does not implement (an
architecture, a rope type, a feature flag) is a CheckpointError naming the field, what is
supported and what was found, before anything is allocated.  config.py's
Config.from_hf_dict calls `decoder_fields`; models/hf.py's to_hf writes the other way with
`hf_config_dict`.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

from tpcore.io.checks import MISSING, ConfigFields, type_name

DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3", "mixtral", "qwen3_moe")
SUPPORTED = ("gpt2", "bert") + DECODERS
SUPPORTED_ROPE = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")   # Config.ROPE_TYPES
GEMMA = ("gemma2", "gemma3_text")

# transformers 5.25's class defaults of the fields tpcore reads (a config.json may omit any of them)
_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "llama": dict(num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-6, max_position_embeddings=2048,
                  tie_word_embeddings=False, rope_theta=10000.0),
    "mistral": dict(num_key_value_heads=8, head_dim=None, rms_norm_eps=1e-6, max_position_embeddings=131072,
                    tie_word_embeddings=False, rope_theta=10000.0, sliding_window=4096),
    "qwen2": dict(num_key_value_heads=32, head_dim=None, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  tie_word_embeddings=False, rope_theta=10000.0, sliding_window=4096),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  tie_word_embeddings=False, rope_theta=10000.0, sliding_window=4096),
    "gemma2": dict(num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=8192,
                   tie_word_embeddings=True, rope_theta=10000.0, sliding_window=4096, query_pre_attn_scalar=256,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=131072,
                        tie_word_embeddings=True, rope_theta=1000000.0, sliding_window=4096,
                        query_pre_attn_scalar=256, attn_logit_softcapping=None, final_logit_softcapping=None),
    "phi3": dict(num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-5, max_position_embeddings=4096,
                 tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None),
    "mixtral": dict(num_key_value_heads=8, head_dim=None, rms_norm_eps=1e-5, max_position_embeddings=131072,
                    tie_word_embeddings=False, rope_theta=1000000.0, sliding_window=None, num_local_experts=8,
                    num_experts_per_tok=2, router_aux_loss_coef=0.001),
    "qwen3_moe": dict(num_key_value_heads=4, head_dim=None, rms_norm_eps=1e-6, max_position_embeddings=32768,
                      tie_word_embeddings=False, rope_theta=10000.0, sliding_window=4096, num_local_experts=128,
                      num_experts_per_tok=8, router_aux_loss_coef=0.001, moe_intermediate_size=768),
}
# the sizes a config.json must give, except where transformers fills them in and published files rely on
# it (Gemma 3's text_config often gives only a few fields)
_SIZES = {"gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                              num_attention_heads=8)}
_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
         "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def _short(v, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n - 3] + "..."


def _absent(f: ConfigFields, key: str) -> bool:
    return f.get(key, None) is None


def _num_or_none(f: ConfigFields, key: str, default) -> Optional[float]:
    """A number > 0, or None (absent: default; null or 0: none)."""
    v = f.get(key, default)
    if v is None or v == 0:
        return None
    return f.num(key, default)


def decoder_fields(c: Dict[str, Any], source: str) -> Dict[str, Any]:
    """Config keyword arguments of a decoder family's config.json (model_type in DECODERS;
    gemma3: its text_config), every field checked as the module docstring says."""
    f = ConfigFields(c, source)
    mt = f.str("model_type", MISSING, SUPPORTED, " (other model types are not supported)")
    if mt == "gemma3":   # the multimodal config: its language model only (the vision tower is unused)
        tc = f.get("text_config", MISSING)
        f = ConfigFields(tc, f"{source} text_config")
        mt = f.str("model_type", "gemma3_text", ("gemma3_text",))
        if "tie_word_embeddings" not in tc and "tie_word_embeddings" in c:
            f = ConfigFields(dict(tc, tie_word_embeddings=c["tie_word_embeddings"]), f"{source} text_config")
    dflt = _DEFAULTS[mt]
    gemma = mt in GEMMA
    if gemma:
        f.str("hidden_activation", "gelu_pytorch_tanh", _TANH_GELU, " (Gemma's GeGLU is tanh-approximated)")
        activation = "geglu"
        if f.bool("use_bidirectional_attention", False):
            raise f.fail("use_bidirectional_attention", "false (bidirectional Gemma is not supported)", True)
    else:
        f.str("hidden_act", "silu", ("silu", "swish"), f" ({mt} with another activation is not supported)")
        activation = "swiglu"
    size = _SIZES.get(mt, {})

    def sized(key):
        return f.int(key, size.get(key, MISSING))
    C, H = sized("hidden_size"), sized("num_attention_heads")
    head_dim = f.int("head_dim", dflt["head_dim"], null=True) if mt != "phi3" or not _absent(f, "head_dim") else None
    if head_dim is None and C % H:
        raise f.fail("num_attention_heads", f"a divisor of hidden_size ({C}) (or a head_dim)", H)
    kv = f.int("num_key_value_heads", dflt["num_key_value_heads"], null=True) or H
    if H % kv:
        raise f.fail("num_key_value_heads", f"a divisor of num_attention_heads ({H})", kv)
    L = sized("num_hidden_layers")
    max_pos = f.int("max_position_embeddings", dflt["max_position_embeddings"])
    kw = dict(vocab_size=sized("vocab_size"), hidden=C, layers=L, heads=H, kv_heads=kv, head_dim=head_dim,
              ffn_hidden=None if mt == "qwen3_moe" else sized("intermediate_size"),   # (MoE: _moe's)
              norm="rmsnorm", eps=f.num("rms_norm_eps", dflt["rms_norm_eps"]),
              activation=activation, positions="rope", max_positions=max_pos, causal=True, pre_norm=True,
              bias=False, tie_embeddings=f.bool("tie_word_embeddings", dflt["tie_word_embeddings"]), model_type=mt)
    kw.update(_biases(f, mt))
    kw.update(_windows(f, mt, L))
    kw.update(_rope(f, mt, head_dim or C // H, max_pos))
    if mt in ("qwen3", "qwen3_moe", "gemma3_text"):
        kw["qk_norm"] = True
    if gemma:
        kw.update(post_norms=True, norm_unit_offset=True, embed_scale=math.sqrt(C),
                  attn_scale=f.num("query_pre_attn_scalar", dflt["query_pre_attn_scalar"]) ** -0.5,
                  attn_softcap=_num_or_none(f, "attn_logit_softcapping", dflt["attn_logit_softcapping"]),
                  final_softcap=_num_or_none(f, "final_logit_softcapping", dflt["final_logit_softcapping"]))
    if mt in ("mixtral", "qwen3_moe"):
        kw.update(_moe(f, mt))
    return kw


_ATTN_BIAS = ("llama", "qwen3", "qwen3_moe") + GEMMA   # attention_bias on q, k, v and o


def _biases(f: ConfigFields, mt: str) -> Dict[str, bool]:
    """Biases per part as each family's modeling code has them (a field a family's code does
    not read is ignored, as transformers does; a bias tensor in its checkpoint is refused)."""
    if mt == "qwen2":       # q/k/v always biased, o never (modeling_qwen2.py)
        return dict(qkv_bias=True, out_bias=False, mlp_bias=False)
    ab = f.bool("attention_bias", False) if mt in _ATTN_BIAS else False
    mb = f.bool("mlp_bias", False) if mt == "llama" else False
    return dict(qkv_bias=ab, out_bias=ab, mlp_bias=mb)


def _windows(f: ConfigFields, mt: str, L: int) -> Dict[str, Any]:
    """sliding_window and layer_types as transformers' configs derive them."""
    dflt = _DEFAULTS[mt]
    if mt == "llama":
        return {}
    w = f.int("sliding_window", dflt["sliding_window"], lo=0, null=True) or None
    if mt in ("qwen2", "qwen3", "qwen3_moe") and not f.bool("use_sliding_window", False):
        w = None
    types = f.get("layer_types", None)
    if types is not None:
        if not (isinstance(types, list) and len(types) == L
                and all(t in ("full_attention", "sliding_attention") for t in types)):
            raise f.fail("layer_types", f"a list of {L} 'full_attention' / 'sliding_attention'", type_name(types))
        if mt in ("mistral", "phi3", "mixtral", "qwen3_moe") and any(t != "full_attention" for t in types):
            raise f.fail("layer_types", f"none ({mt} windows every layer by sliding_window; transformers' "
                         f"{_ARCH[mt]} ignores layer_types)", _short(types))
    elif mt in ("qwen2", "qwen3"):
        lo = f.int("max_window_layers", 28, lo=0)
        types = ["sliding_attention" if w is not None and i >= lo else "full_attention" for i in range(L)]
    elif mt == "gemma2":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    elif mt == "gemma3_text":
        n = f.int("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(L)]
    if w is None or types is None or mt in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        return dict(sliding_window=w)
    if "sliding_attention" not in types:
        return dict(sliding_window=None)
    if "full_attention" not in types:     # every layer sliding: Config's layer_types None says it
        return dict(sliding_window=w)
    return dict(sliding_window=w, layer_types=tuple(types))


def _rope_dict(f: ConfigFields, key: str) -> Dict[str, Any]:
    v = f.get(key, None)
    if v is not None and not isinstance(v, dict):
        raise f.fail(key, "an object or null", type_name(v))
    return dict(v or {})


def _rope(f: ConfigFields, mt: str, head_dim: int, max_pos: int) -> Dict[str, Any]:
    """rope_theta, rope_scaling (None: plain) and rope_local_theta (Gemma 3) from
    rope_scaling / rope_theta (old config.json) or rope_parameters (transformers 5)."""
    rs, rp = _rope_dict(f, "rope_scaling"), _rope_dict(f, "rope_parameters")
    nested = [k for k in ("full_attention", "sliding_attention") if k in rp]
    top_theta = f.num("rope_theta", _DEFAULTS[mt]["rope_theta"])
    out: Dict[str, Any] = {}
    if nested:
        if mt != "gemma3_text":
            raise f.fail("rope_parameters", f"one set of rotary parameters ({mt} has no per-layer-type rope)",
                         _short(rp))
        for k in rp:
            if k not in ("full_attention", "sliding_attention"):
                raise f.fail(f"rope_parameters.{k}", "only full_attention and sliding_attention", _short(rp[k]))
        full = dict(rp.get("full_attention") or {}, **rs)
        local = dict(rp.get("sliding_attention") or {})
    else:
        full = rs or rp
        local = {}
    if mt == "gemma3_text":
        lf = ConfigFields(local, f"{f.source} rope_parameters.sliding_attention")
        lt = lf.get("rope_type", lf.get("type", "default"))
        if lt != "default":
            raise lf.fail("rope_type", "'default' (scaled rope on Gemma 3's sliding layers is not supported)", lt)
        out["rope_local_theta"] = lf.num("rope_theta", f.num("rope_local_base_freq", 10000.0))
    where = "rope_scaling" if rs else "rope_parameters.full_attention" if nested else "rope_parameters"
    pf = ConfigFields(full, f"{f.source} {where}")
    out["rope_theta"] = pf.num("rope_theta", top_theta)
    kind = pf.get("rope_type", pf.get("type", "default"))
    if mt == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"   # as Phi3Config reads them
    if kind not in SUPPORTED_ROPE:
        raise pf.fail("rope_type", f"one of {', '.join(SUPPORTED_ROPE)} (other rope scalings are not supported)",
                      _short(kind))
    prf = pf.get("partial_rotary_factor", f.get("partial_rotary_factor", 1.0))
    if prf != 1.0:
        raise pf.fail("partial_rotary_factor", "1.0 (partial rotary embeddings are not supported)", _short(prf))
    if kind == "default":
        out["rope_scaling"] = None
        return out
    sc = {k: v for k, v in full.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    sc["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope"):
        if mt == "phi3" and not _absent(f, "original_max_position_embeddings"):
            sc["original_max_position_embeddings"] = f.int("original_max_position_embeddings")
        sc.setdefault("original_max_position_embeddings", max_pos)
    _check_scaling(ConfigFields(sc, f"{f.source} {where}"), kind, head_dim)
    out["rope_scaling"] = sc
    return out


_SCALING_NUMS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "longrope": ()}


def _check_scaling(sf: ConfigFields, kind: str, head_dim: int) -> None:
    """The fields a rope scaling needs, with their types (the values' math is tpcore.nn.rope's)."""
    for key in _SCALING_NUMS[kind]:
        sf.num(key)
    if kind in ("llama3", "yarn", "longrope"):
        sf.int("original_max_position_embeddings")
    for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if key in sf.d and sf.d[key] is not None:
            sf.num(key, positive=key not in ("mscale", "mscale_all_dim"))
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            v = sf.get(key)
            if not (isinstance(v, list) and len(v) == head_dim // 2
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                            for x in v)):
                raise sf.fail(key, f"a list of {head_dim // 2} numbers > 0 (head_dim / 2)", type_name(v))
        if "factor" in sf.d and sf.d["factor"] is not None:
            sf.num("factor")


def _moe(f: ConfigFields, mt: str) -> Dict[str, Any]:
    dflt = _DEFAULTS[mt]
    # transformers maps num_experts onto num_local_experts (attribute_map) for both families
    key = "num_experts" if "num_experts" in f.d and "num_local_experts" not in f.d else "num_local_experts"
    E = f.int(key, dflt["num_local_experts"])
    k = f.int("num_experts_per_tok", dflt["num_experts_per_tok"], hi=E)
    kw = dict(experts=E, experts_per_token=k,
              router_aux_loss_coef=f.num("router_aux_loss_coef", dflt["router_aux_loss_coef"], positive=False))
    if kw["router_aux_loss_coef"] < 0:
        raise f.fail("router_aux_loss_coef", "a number >= 0", kw["router_aux_loss_coef"])
    if mt == "mixtral":
        jitter = f.num("router_jitter_noise", 0.0, positive=False)
        if jitter != 0:
            raise f.fail("router_jitter_noise", "0 (the router's training-time jitter is not supported)", jitter)
        kw["norm_topk_prob"] = True      # MixtralTopKRouter always renormalizes
    else:
        kw["norm_topk_prob"] = f.bool("norm_topk_prob", False)
        kw["ffn_hidden"] = f.int("moe_intermediate_size", dflt["moe_intermediate_size"])
        if f.int("decoder_sparse_step", 1) != 1:
            raise f.fail("decoder_sparse_step", "1 (every layer sparse; dense layers between are not supported)",
                         f.get("decoder_sparse_step"))
        if f.get("mlp_only_layers", None):
            raise f.fail("mlp_only_layers", "[] (dense layers among the sparse ones are not supported)",
                         _short(f.get("mlp_only_layers")))
    return kw


def hf_config_dict(cfg) -> Tuple[Dict[str, Any], str]:
    """The config.json transformers reads back to cfg (a decoder family's Config), and the
    architecture's family; transformers 5's rope_parameters and the older rope_theta /
    rope_scaling fields are both written."""
    mt = cfg.model_type
    if mt not in _ARCH:
        raise ValueError(f"to_hf: model_type {mt!r} has no Hugging Face config here (one of {', '.join(_ARCH)}, "
                         f"gpt2, bert)")
    d: Dict[str, Any] = {
        "model_type": mt, "architectures": [_ARCH[mt]], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_hidden, "rms_norm_eps": cfg.eps,
        "max_position_embeddings": cfg.max_positions, "tie_word_embeddings": cfg.tie_embeddings,
        "pad_token_id": None}   # (tpcore keeps no token ids here; a class default may lie outside the vocabulary)
    if mt == "phi3":
        del d["head_dim"]
    if mt in GEMMA:
        d["hidden_activation"] = "gelu_pytorch_tanh"
        d["query_pre_attn_scalar"] = _int_if_whole(cfg.attn_scale ** -2 if cfg.attn_scale else cfg.head_dim)
        d["attn_logit_softcapping"] = cfg.attn_softcap
        d["final_logit_softcapping"] = cfg.final_softcap
    else:
        d["hidden_act"] = "silu"
    if mt in _ATTN_BIAS:
        d["attention_bias"] = cfg.qkv_bias
    if mt == "llama":
        d["mlp_bias"] = cfg.mlp_bias
    if mt != "llama":
        d["sliding_window"] = cfg.sliding_window
    if mt in ("qwen2", "qwen3", "qwen3_moe"):
        d["use_sliding_window"] = cfg.sliding_window is not None
        d["max_window_layers"] = 0
    if cfg.layer_types is not None:
        d["layer_types"] = list(cfg.layer_types)
    elif mt in ("qwen2", "qwen3") + GEMMA:
        d["layer_types"] = ["sliding_attention" if cfg.sliding(i) else "full_attention" for i in range(cfg.layers)]
    rope = dict(cfg.rope_scaling or {"rope_type": "default"}, rope_theta=cfg.rope_theta)
    if mt == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        d["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        d["rope_local_base_freq"] = local["rope_theta"]
    else:
        d["rope_parameters"] = rope
    d["rope_theta"] = cfg.rope_theta
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    if mt == "phi3" and cfg.rope_scaling and "original_max_position_embeddings" in cfg.rope_scaling:
        d["original_max_position_embeddings"] = cfg.rope_scaling["original_max_position_embeddings"]
    if cfg.experts:
        d["num_experts" if mt == "qwen3_moe" else "num_local_experts"] = cfg.experts
        d["num_experts_per_tok"] = cfg.experts_per_token
        d["router_aux_loss_coef"] = cfg.router_aux_loss_coef
        if mt == "qwen3_moe":
            d.update(moe_intermediate_size=cfg.ffn_hidden, norm_topk_prob=cfg.norm_topk_prob,
                     decoder_sparse_step=1, mlp_only_layers=[])
    return d, mt


def _int_if_whole(x: float):
    r = round(x)
    return int(r) if abs(x - r) <= 1e-9 * max(1.0, abs(x)) else x
