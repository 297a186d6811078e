"""The shape of a Transformer: `Config` (GPT-2, Llama, BERT; read from a Hugging Face
config.json by `Config.from_hf`), the names its fields take (`NORMS`, `POSITIONS`,
`ACTIVATIONS`), and `head_partition`, its query heads per rank."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional, Sequence, Tuple

from tpcore.utils.args import bool_arg, int_arg, real_arg, shown
from tpcore.io.formats import MISSING, CheckpointError, ConfigFields, bad, read_json_object
from tpcore.nn.hf_config import DECODERS, SUPPORTED, SUPPORTED_ROPE, decoder_fields
from tpcore.nn.partition import partition

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope", "none")
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "swiglu", "geglu")
GATED = ("swiglu", "geglu")   # fc1 holds [gate; up] (2 * ffn_hidden rows)
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = SUPPORTED_ROPE


@dataclasses.dataclass
class Config:
    """The shape of a decoder (GPT-2, Llama family) or encoder (BERT) Transformer.

    A dataclass; every field is checked at construction (and by `validate`).
    `Config.from_hf` reads a Hugging Face config.json.

    Parameters
    ----------
    vocab_size : int, default 50257
        Token ids, >= 1.
    hidden : int, default 768
        The model width, >= 1.
    layers : int, default 12
        Transformer blocks, >= 1.
    heads : int, default 12
        Query heads, >= 1 (split over the ranks in whole heads).
    kv_heads : int, optional
        Key/value heads (grouped-query attention); heads must be a multiple.  Default
        None: heads (multi-head attention).
    ffn_hidden : int, optional
        The MLP's inner width.  Default None: 4 * hidden.
    head_dim : int, optional
        The width of a head.  Default None: hidden // heads (hidden must divide).
    norm : {"layernorm", "rmsnorm"}, default "layernorm"
    eps : float, default 1e-5
        The norms' epsilon, >= 0.
    activation : {"gelu", "gelu_tanh", "silu", "relu", "swiglu", "geglu"}, default "gelu_tanh"
        swiglu: silu(gate) * up (Llama); geglu: gelu_tanh(gate) * up (Gemma).
    positions : {"learned", "rope", "none"}, default "learned"
        Learned position embeddings (GPT-2, BERT), rotary (Llama; head_dim even), or none.
    max_positions : int, default 1024
        The longest sequence (learned positions' table size), >= 1.
    rope_theta : float, default 10000.0
        The rotary base, > 0 (with positions="rope").
    causal : bool, default True
        False: a bidirectional encoder (BERT).
    pre_norm : bool, default True
        False: post-norm blocks (BERT).
    bias : bool, default True
        Biases on the linear layers (Llama: False).
    tie_embeddings : bool, default True
        The LM head is the token embedding (GPT-2).
    type_vocab_size : int, default 0
        BERT's token types (0: none).
    final_norm : bool, default True
        A norm after the last block (pre-norm models).
    embedding_norm : bool, default False
        A norm after the embeddings (BERT).
    sliding_window : int, optional
        A query sees only the keys of its last `sliding_window` positions (itself
        included) on the layers `layer_types` makes sliding (Mistral: all of them); their
        KV cache holds only the window.  Default None: no window.
    model_type : str, default "gpt2"
        The Hugging Face model_type it came from.
    qkv_bias, out_bias, mlp_bias : bool, optional
        Biases on the Q/K/V projections, the attention output projection and the MLP's
        (Qwen2: only qkv_bias).  Default None: `bias`.
    qk_norm : bool, default False
        A per-head norm (`norm`, weight head_dim) on Q and K before the rotary embedding
        (Qwen3, Gemma 3).
    post_norms : bool, default False
        Norms on the attention and MLP outputs before their residual adds (Gemma 2/3:
        ``attn_post_norm``, ``mlp_post_norm``; ``norm2`` is then the pre-MLP norm).
    norm_unit_offset : bool, default False
        The checkpoint stores an RMSNorm weight w that scales by (1 + w) (Gemma); tpcore
        holds 1 + w (loading adds 1, saving subtracts it).
    attn_scale : float, optional
        The scale of the attention scores.  Default None: head_dim ** -0.5 (Gemma:
        query_pre_attn_scalar ** -0.5).
    attn_softcap, final_softcap : float, optional
        > 0: attention scores (before the mask), resp. the logits, become
        cap * tanh(x / cap) (Gemma 2).  Default None: none.
    embed_scale : float, optional
        The token embedding's rows are multiplied by it (Gemma: sqrt(hidden)).
    layer_types : tuple of str, optional
        Per layer "full_attention" or "sliding_attention" (Gemma 2/3).  Default None:
        every layer sliding when sliding_window is set, else full.
    rope_scaling : dict, optional
        Hugging Face's rope scaling (``rope_type`` in ROPE_TYPES and its fields:
        linear, dynamic, yarn, longrope, llama3); tpcore.nn.rope turns it into the rotary
        frequencies.  Default None: plain RoPE with rope_theta.
    rope_local_theta : float, optional
        The sliding layers' rotary base, without rope_scaling (Gemma 3).  Default None:
        rope_theta and rope_scaling on every layer.
    experts, experts_per_token : int, default 0
        A sparse MoE MLP (Mixtral, Qwen3-MoE): experts of ffn_hidden columns each, each
        token routed to its top experts_per_token.  0: a dense MLP.
    norm_topk_prob : bool, default True
        The top-k routing weights renormalized to sum to 1 (Mixtral).
    router_aux_loss_coef : float, default 0.0
        The weight of the router's load-balancing loss in `loss` (transformers'
        output_router_logits training).

    Raises
    ------
    TypeError
        A field of the wrong type (an int given as a float, a bool as a string...).
    ValueError
        A field out of range or inconsistent (hidden not a multiple of heads without
        head_dim, heads not a multiple of kv_heads, an odd head_dim with rope...).
    """
    vocab_size: int = 50257
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: Optional[int] = None          # None: = heads (multi-head attention)
    ffn_hidden: Optional[int] = None        # None: 4 * hidden
    head_dim: Optional[int] = None          # None: hidden // heads
    norm: str = "layernorm"                 # "layernorm" | "rmsnorm"
    eps: float = 1e-5
    activation: str = "gelu_tanh"           # gelu, gelu_tanh, silu, relu, swiglu, geglu
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
    sliding_window: Optional[int] = None    # keys of the last sliding_window positions only (sliding layers)
    model_type: str = "gpt2"
    qkv_bias: Optional[bool] = None         # None: bias
    out_bias: Optional[bool] = None         # None: bias
    mlp_bias: Optional[bool] = None         # None: bias
    qk_norm: bool = False                   # per-head norm of Q and K before rotary (Qwen3, Gemma 3)
    post_norms: bool = False                # norms after attention and MLP, before the residuals (Gemma 2/3)
    norm_unit_offset: bool = False          # the checkpoint's norms scale by (1 + w) (Gemma): tpcore holds 1 + w
    attn_scale: Optional[float] = None      # None: head_dim ** -0.5
    attn_softcap: Optional[float] = None    # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: Optional[float] = None   # logits -> cap * tanh(logits / cap) (Gemma 2)
    embed_scale: Optional[float] = None     # token embeddings times it (Gemma: sqrt(hidden))
    layer_types: Optional[Tuple[str, ...]] = None  # per layer: "full_attention" | "sliding_attention"
    rope_scaling: Optional[Dict[str, Any]] = None  # Hugging Face's rope scaling dict (rope_type in ROPE_TYPES)
    rope_local_theta: Optional[float] = None       # the sliding layers' rotary base, unscaled (Gemma 3)
    experts: int = 0                        # MoE: experts per layer (0: dense MLP)
    experts_per_token: int = 0              # MoE: top-k
    norm_topk_prob: bool = True             # MoE: renormalize the top-k weights
    router_aux_loss_coef: float = 0.0       # MoE: the load-balancing loss's weight in loss()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "layers", "heads"):
            setattr(self, name, int_arg(getattr(self, name), "Config", name, lo=1))
        for name in ("kv_heads", "ffn_hidden", "head_dim"):  # None: derived below
            if getattr(self, name) is not None:
                setattr(self, name, int_arg(getattr(self, name), "Config", name, lo=1,
                                            expected="an integer >= 1 (or None: derived)"))
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
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"Config: activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"Config: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        self.max_positions = int_arg(self.max_positions, "Config", "max_positions", lo=1)
        self.type_vocab_size = int_arg(self.type_vocab_size, "Config", "type_vocab_size", lo=0)
        if self.sliding_window is not None:
            self.sliding_window = int_arg(self.sliding_window, "Config", "sliding_window", lo=1,
                                          expected="an integer >= 1 (or None: no window)")
        # eps >= 0 as torch's LayerNorm takes it: a negative eps gives NaN for rows of small variance
        self.eps = real_arg(self.eps, "Config", "eps", lo=0)
        if self.positions == "rope":
            self.rope_theta = real_arg(self.rope_theta, "Config", "rope_theta", lo=0, lo_open=True)
            if self.head_dim % 2:
                raise ValueError(f"Config: rotary positions need an even head_dim, got {self.head_dim}")
        for name in ("causal", "pre_norm", "bias", "tie_embeddings", "final_norm", "embedding_norm"):
            setattr(self, name, bool_arg(getattr(self, name), "Config", name))
        if not isinstance(self.model_type, str):
            raise TypeError(f"Config: model_type must be a string, got {shown(self.model_type)}")
        self._check_families()

    def _check_families(self) -> None:
        """The fields of the model families beyond GPT-2 / Llama / BERT."""
        for name in ("qkv_bias", "out_bias", "mlp_bias"):
            v = getattr(self, name)
            setattr(self, name, self.bias if v is None else bool_arg(v, "Config", name))
        for name in ("qk_norm", "post_norms", "norm_unit_offset", "norm_topk_prob"):
            setattr(self, name, bool_arg(getattr(self, name), "Config", name))
        for name in ("attn_scale", "attn_softcap", "final_softcap", "embed_scale", "rope_local_theta"):
            if getattr(self, name) is not None:
                setattr(self, name, real_arg(getattr(self, name), "Config", name, lo=0, lo_open=True))
        if self.layer_types is not None:
            if isinstance(self.layer_types, (str, bytes)) or not isinstance(self.layer_types, Sequence):
                raise TypeError(f"Config: layer_types must be a sequence of {LAYER_TYPES}, got "
                                f"{shown(self.layer_types)}")
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.layers:
                raise ValueError(f"Config: layer_types has {len(self.layer_types)} entries for {self.layers} layers")
            for i, t in enumerate(self.layer_types):
                if t not in LAYER_TYPES:
                    raise ValueError(f"Config: layer_types[{i}] must be one of {LAYER_TYPES}, got {t!r}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("Config: layer_types has sliding layers but sliding_window is None")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise TypeError(f"Config: rope_scaling must be a dict, got {shown(self.rope_scaling)}")
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"Config: rope_scaling's rope_type {kind!r} is not supported (supported: "
                                 f"{', '.join(ROPE_TYPES)})")
            if self.positions != "rope":
                raise ValueError("Config: rope_scaling needs positions='rope'")
        self.experts = int_arg(self.experts, "Config", "experts", lo=0)
        self.experts_per_token = int_arg(self.experts_per_token, "Config", "experts_per_token", lo=0,
                                         hi=max(self.experts, 0))
        if self.experts and not self.experts_per_token:
            raise ValueError("Config: a MoE (experts > 0) needs experts_per_token >= 1")
        self.router_aux_loss_coef = real_arg(self.router_aux_loss_coef, "Config", "router_aux_loss_coef", lo=0)

    def sliding(self, layer: int) -> bool:
        """Whether a layer attends through the sliding window.

        Parameters
        ----------
        layer : int
            The layer's index, in [0, layers).

        Returns
        -------
        bool
            True when sliding_window is set and layer_types makes it a sliding layer (or
            layer_types is None).
        """
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def validate(self) -> "Config":
        """Check the fields again (a Config is mutable: cfg.eps = -1 after construction).

        Returns
        -------
        Config
            self, with the derived fields filled in.

        Raises
        ------
        TypeError, ValueError
            As the constructor.
        """
        self.__post_init__()
        return self

    @classmethod
    def from_hf(cls, path: str) -> "Config":
        """The Config of a Hugging Face checkpoint (GPT-2, BERT, or a decoder family of
        tpcore.nn.hf_config: Llama, Mistral, Qwen 2/3, Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE).

        Parameters
        ----------
        path : str
            The checkpoint's directory, or its config.json.

        Returns
        -------
        Config

        Raises
        ------
        CheckpointError
            A malformed file or field (a ValueError), naming it.
        OSError
            The file cannot be read.
        """
        p = os.path.join(path, "config.json") if os.path.isdir(path) else path
        return cls.from_hf_dict(read_json_object(p), source=p)

    @classmethod
    def from_hf_dict(cls, c: Dict[str, Any], source: str = "config.json") -> "Config":
        """The Config of a Hugging Face config.json already parsed.

        Parameters
        ----------
        c : dict
            The parsed config.json: model_type "gpt2", "bert", or one of the decoder
            families tpcore.nn.hf_config reads (llama, mistral, qwen2, qwen3, gemma2,
            gemma3_text, gemma3 (its text_config), phi3, mixtral, qwen3_moe).
        source : str, default "config.json"
            Where it came from, for the messages.

        Returns
        -------
        Config

        Raises
        ------
        CheckpointError
            A bad field (type, range, consistency; a ValueError) naming source, the field,
            what was expected and what was found.
        """
        f = ConfigFields(c, source)
        mt = f.str("model_type", MISSING, SUPPORTED, " (other model types are not supported)")

        def heads_divide(hidden_key, heads_key):
            C, H = f.int(hidden_key), f.int(heads_key)
            if C % H:
                raise f.fail(heads_key, f"a divisor of {hidden_key} ({C})", H)
            return C, H
        if mt == "gpt2":
            for key, want in (("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
                              ("scale_attn_weights", True)):
                if f.bool(key, want) != want:
                    raise f.fail(key, f"{str(want).lower()} (GPT-2 with {key}={str(not want).lower()} is not "
                                 f"supported)", f.get(key))
            C, H = heads_divide("n_embd", "n_head")
            kw = dict(vocab_size=f.int("vocab_size"), hidden=C, layers=f.int("n_layer"), heads=H,
                      ffn_hidden=f.int("n_inner", None, null=True) or 4 * C, norm="layernorm",
                      eps=f.num("layer_norm_epsilon", 1e-5),
                      activation=_hf_act(f.str("activation_function", "gelu_new", tuple(_HF_ACTS))),
                      positions="learned", max_positions=f.int("n_positions", 1024), causal=True, pre_norm=True,
                      bias=True, tie_embeddings=f.bool("tie_word_embeddings", True), model_type="gpt2")
        elif mt in DECODERS:
            kw = decoder_fields(c, source)
        else:  # bert
            C, H = heads_divide("hidden_size", "num_attention_heads")
            f.str("position_embedding_type", "absolute", ("absolute",), " (relative positions are not supported)")
            kw = dict(vocab_size=f.int("vocab_size"), hidden=C, layers=f.int("num_hidden_layers"), heads=H,
                      ffn_hidden=f.int("intermediate_size"), norm="layernorm", eps=f.num("layer_norm_eps", 1e-12),
                      activation=_hf_act(f.str("hidden_act", "gelu", tuple(_HF_ACTS))), positions="learned",
                      max_positions=f.int("max_position_embeddings", 512), causal=False, pre_norm=False, bias=True,
                      tie_embeddings=True, type_vocab_size=f.int("type_vocab_size", 2), final_norm=False,
                      embedding_norm=True, model_type="bert")
        try:
            return cls(**kw)
        except ValueError as e:
            if isinstance(e, CheckpointError):
                raise
            raise bad(source, "config", "a consistent configuration", str(e)) from e


_HF_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu",
            "relu": "relu", "silu": "silu", "swish": "silu"}


def _hf_act(name: str) -> str:
    if name not in _HF_ACTS:
        raise ValueError(f"activation {name!r} is not supported")
    return _HF_ACTS[name]


def head_partition(cfg: Config, world: int, weights: Optional[Sequence[float]] = None) -> list:
    """Query heads per rank, in whole heads (weights for mismatched devices)."""
    return [s for _, s in partition(cfg.heads, world, weights=weights)]
