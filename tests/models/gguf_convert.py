"""Test helper: tiny random transformers models of the model families, and their GGUF files
written with the `gguf` package's writer the way llama.cpp's convert_hf_to_gguf.py lays
them out (written here from llama.cpp's conventions, not from tpcore's reader):

- the llama architecture (Llama 3, Mistral, Mixtral): attn_q / attn_k rows permuted within
  each head (LlamaModel.permute), Llama 3's llama3 rope scaling as the rope_freqs tensor
  (LlamaModel.generate_extra_tensors), Mistral's window as llama.attention.sliding_window,
  Mixtral's experts stacked in ffn_{gate,up,down}_exps (E, rows, cols) with the router as
  ffn_gate_inp;
- Gemma 2/3: every "norm.weight" stored as 1 + w (Gemma2Model / Gemma3Model.modify_tensors),
  the soft-caps and window as keys, no lm_head (tied);
- Phi-3: the fused qkv_proj as attn_qkv and gate_up_proj as ffn_up, as they are;
- Qwen2 (Q/K/V biases), Qwen3 (attn_q_norm / attn_k_norm), Qwen3-MoE (experts as Mixtral).

`expected_tpcore` gives the same model's tensors under tpcore's full names (the brief's
contract), with the documented transforms (tpcore holds Gemma's norms as 1 + w).
"""
import math

import numpy as np

import gguf  # noqa: F401  (the writer: gguf.GGUFWriter)

FAMILIES = ("llama3", "mistral", "mixtral", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
ARCH = {"llama3": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
        "qwen3moe": "qwen3moe", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}


def hf_config(family, **over):
    """A tiny transformers config: vocabulary and FFN sizes that divide nothing, GQA
    (over: fields replaced)."""
    import transformers as T
    base = dict(vocab_size=101, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    cls, kw = {
        "llama3": (T.LlamaConfig, dict(rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0, head_dim=16,
                                       tie_word_embeddings=True)),
        "mistral": (T.MistralConfig, dict(sliding_window=8, rope_theta=1e4)),
        "mixtral": (T.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
        "qwen2": (T.Qwen2Config, dict(tie_word_embeddings=True)),
        "qwen3": (T.Qwen3Config, dict(head_dim=12, rope_theta=1e6)),
        "qwen3moe": (T.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                            norm_topk_prob=True, head_dim=12)),
        "gemma2": (T.Gemma2Config, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
        "gemma3": (T.Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                            num_hidden_layers=6)),
        "phi3": (T.Phi3Config, dict(sliding_window=16, original_max_position_embeddings=64)),
    }[family]
    return cls(**{**base, **kw, **over})


def hf_model(family, seed=0, **over):
    """The transformers model, float32, every parameter random (norms and biases non-zero)."""
    import torch
    import transformers as T
    torch.manual_seed(seed)
    cfg = hf_config(family, **over)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            gemma_norm = family.startswith("gemma") and "norm" in name
            p.copy_(1 + 0.1 * r if "norm" in name and not gemma_norm else (0.1 if gemma_norm else 0.15) * r)
    return model, cfg


def _dims(cfg):
    H, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    return H, Hk, D


def llamacpp_permute(w, n_head):
    """llama.cpp's LlamaModel.permute of q_proj / k_proj rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg):
    """LlamaModel.generate_extra_tensors: rope_freqs (a factor per frequency)."""
    rs = cfg.rope_parameters
    base, dim = rs["rope_theta"], _dims(cfg)[2]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _keys(w, family, cfg, tokenizer=None):
    a = ARCH[family]
    H, Hk, D = _dims(cfg)
    u, f = w.add_uint32, w.add_float32
    u(f"{a}.context_length", cfg.max_position_embeddings)
    u(f"{a}.embedding_length", cfg.hidden_size)
    u(f"{a}.block_count", cfg.num_hidden_layers)
    u(f"{a}.feed_forward_length", cfg.intermediate_size)
    u(f"{a}.attention.head_count", H)
    u(f"{a}.attention.head_count_kv", Hk)
    f(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    rp = cfg.rope_parameters
    theta = rp["full_attention"]["rope_theta"] if family == "gemma3" else rp["rope_theta"]
    f(f"{a}.rope.freq_base", theta)
    if D * H != cfg.hidden_size or family.startswith("gemma"):
        u(f"{a}.attention.key_length", D)
        u(f"{a}.attention.value_length", D)
    u(f"{a}.rope.dimension_count", D)
    u(f"{a}.vocab_size", cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        u(f"{a}.attention.sliding_window", cfg.sliding_window)
    if family in ("mixtral", "qwen3moe"):
        u(f"{a}.expert_count", getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        u(f"{a}.expert_used_count", cfg.num_experts_per_tok)
        if family == "qwen3moe":
            u(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size)
    if family == "gemma2":
        f(f"{a}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        f(f"{a}.final_logit_softcapping", cfg.final_logit_softcapping)
    if tokenizer is not None:            # tokenizer(w): the tokenizer's keys
        tokenizer(w)
        return
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.padding_token_id", 0)


def write_gguf(path, family, model, cfg, qtype=None, tokenizer=None):
    """The model as llama.cpp's converter writes it (F32; qtype: the 2-D/3-D matrices
    quantized with gguf's reference quantizer, e.g. Q8_0; tokenizer(writer): writes the
    tokenizer's keys instead of a placeholder vocabulary).  Returns {GGUF name: the
    float64 values stored} (dequantized where quantized)."""
    import gguf.quants
    a = ARCH[family]
    H, Hk, D = _dims(cfg)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(path, a)
    _keys(w, family, cfg, tokenizer)
    gemma = family.startswith("gemma")
    stored = {}

    def add(name, arr):
        arr = np.ascontiguousarray(arr, np.float32)
        if gemma and name.endswith("norm.weight"):
            arr = arr + 1                          # Gemma*Model.modify_tensors: the norms as 1 + w
        if qtype is not None and arr.ndim >= 2 and arr.shape[-1] % 32 == 0:
            raw = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(raw, qtype).astype(np.float64)
        else:
            w.add_tensor(name, arr)
            stored[name] = arr.astype(np.float64)
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if family == "llama3":
        add("rope_freqs.weight", llama3_rope_factors(cfg))
    for i in range(cfg.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", sd[h + "input_layernorm.weight"])
        if family == "phi3":
            add(b + "attn_qkv.weight", sd[h + "self_attn.qkv_proj.weight"])
        else:
            q, k = sd[h + "self_attn.q_proj.weight"], sd[h + "self_attn.k_proj.weight"]
            if a == "llama":
                q, k = llamacpp_permute(q, H), llamacpp_permute(k, Hk)
            add(b + "attn_q.weight", q)
            add(b + "attn_k.weight", k)
            add(b + "attn_v.weight", sd[h + "self_attn.v_proj.weight"])
        if family == "qwen2":
            for n in "qkv":
                add(b + f"attn_{n}.bias", sd[h + f"self_attn.{n}_proj.bias"])
        if h + "self_attn.q_norm.weight" in sd:
            add(b + "attn_q_norm.weight", sd[h + "self_attn.q_norm.weight"])
            add(b + "attn_k_norm.weight", sd[h + "self_attn.k_norm.weight"])
        add(b + "attn_output.weight", sd[h + "self_attn.o_proj.weight"])
        if gemma:
            add(b + "post_attention_norm.weight", sd[h + "post_attention_layernorm.weight"])
            add(b + "ffn_norm.weight", sd[h + "pre_feedforward_layernorm.weight"])
            add(b + "post_ffw_norm.weight", sd[h + "post_feedforward_layernorm.weight"])
        else:
            add(b + "ffn_norm.weight", sd[h + "post_attention_layernorm.weight"])
        if family in ("mixtral", "qwen3moe"):
            gu, F = sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.down_proj"].shape[2]
            add(b + "ffn_gate_inp.weight", sd[h + "mlp.gate.weight"])
            add(b + "ffn_gate_exps.weight", gu[:, :F])
            add(b + "ffn_up_exps.weight", gu[:, F:])
            add(b + "ffn_down_exps.weight", sd[h + "mlp.experts.down_proj"])
        elif family == "phi3":
            add(b + "ffn_up.weight", sd[h + "mlp.gate_up_proj.weight"])
            add(b + "ffn_down.weight", sd[h + "mlp.down_proj.weight"])
        else:
            for n in ("gate", "up", "down"):
                add(b + f"ffn_{n}.weight", sd[h + f"mlp.{n}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def expected_tpcore(family, model, cfg):
    """The model's tensors under tpcore's full names (float64): Hugging Face's rows, fc1 =
    [gate; up], Gemma's norms as 1 + w."""
    sd = {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}
    H, Hk, D = _dims(cfg)
    gemma = family.startswith("gemma")

    def nrm(x):
        return x + 1 if gemma else x
    out = {"wte.weight": sd["model.embed_tokens.weight"], "final_norm.weight": nrm(sd["model.norm.weight"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        h, o = f"model.layers.{i}.", f"blocks.{i}."
        out[o + "norm1.weight"] = nrm(sd[h + "input_layernorm.weight"])
        if family == "phi3":
            qkv = sd[h + "self_attn.qkv_proj.weight"]
            out[o + "attn.q.weight"], out[o + "attn.k.weight"], out[o + "attn.v.weight"] = np.split(
                qkv, [H * D, (H + Hk) * D])
        else:
            for n in "qkv":
                out[o + f"attn.{n}.weight"] = sd[h + f"self_attn.{n}_proj.weight"]
        if family == "qwen2":
            for n in "qkv":
                out[o + f"attn.{n}.bias"] = sd[h + f"self_attn.{n}_proj.bias"]
        if h + "self_attn.q_norm.weight" in sd:
            out[o + "attn.q_norm.weight"] = nrm(sd[h + "self_attn.q_norm.weight"])
            out[o + "attn.k_norm.weight"] = nrm(sd[h + "self_attn.k_norm.weight"])
        out[o + "attn.out.weight"] = sd[h + "self_attn.o_proj.weight"]
        if gemma:
            out[o + "attn_post_norm.weight"] = nrm(sd[h + "post_attention_layernorm.weight"])
            out[o + "norm2.weight"] = nrm(sd[h + "pre_feedforward_layernorm.weight"])
            out[o + "mlp_post_norm.weight"] = nrm(sd[h + "post_feedforward_layernorm.weight"])
        else:
            out[o + "norm2.weight"] = sd[h + "post_attention_layernorm.weight"]
        if family in ("mixtral", "qwen3moe"):
            out[o + "moe.router.weight"] = sd[h + "mlp.gate.weight"]
            for e in range(sd[h + "mlp.gate.weight"].shape[0]):
                out[o + f"moe.experts.{e}.fc1.weight"] = sd[h + "mlp.experts.gate_up_proj"][e]
                out[o + f"moe.experts.{e}.fc2.weight"] = sd[h + "mlp.experts.down_proj"][e]
        elif family == "phi3":
            out[o + "mlp.fc1.weight"] = sd[h + "mlp.gate_up_proj.weight"]
            out[o + "mlp.fc2.weight"] = sd[h + "mlp.down_proj.weight"]
        else:
            out[o + "mlp.fc1.weight"] = np.concatenate([sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]])
            out[o + "mlp.fc2.weight"] = sd[h + "mlp.down_proj.weight"]
    return out
