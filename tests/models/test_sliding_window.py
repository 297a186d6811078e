"""Sliding-window attention against transformers' Mistral and Gemma 2: logits of sequences
longer than the window, and generation whose KV cache is a ring of two windows (prefill in
pieces of window + 1 tokens), at world sizes 1-3.  The cache's memory is the window's, not the
context's."""
import numpy as np
import pytest

import tpcore
from tpcore.models import TransformerLM
from tpcore.nn.config import Config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, C, L, H, HK, F, W = 67, 32, 3, 4, 2, 40, 5


def _mistral():
    torch.manual_seed(0)
    c = transformers.MistralConfig(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L,
                                   num_attention_heads=H, num_key_value_heads=HK, head_dim=C // H,
                                   max_position_embeddings=256, sliding_window=W, tie_word_embeddings=False)
    m = transformers.MistralForCausalLM(c).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.3)
    cfg = Config(vocab_size=V, hidden=C, layers=L, heads=H, kv_heads=HK, ffn_hidden=F, norm="rmsnorm",
                 eps=c.rms_norm_eps, activation="swiglu", positions="rope", max_positions=256,
                 rope_theta=float(c.rope_parameters["rope_theta"]), bias=False, tie_embeddings=False,
                 sliding_window=W, model_type="llama")
    return m, cfg


def _full(m, cfg):
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in m.state_dict().items()}
    out = {"wte.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"],
           "lm_head.weight": sd["lm_head.weight"]}
    for i in range(cfg.layers):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        out[q + "norm1.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "norm2.weight"] = sd[p + "post_attention_layernorm.weight"]
        for n in "qkv":
            out[q + f"attn.{n}.weight"] = sd[p + f"self_attn.{n}_proj.weight"]
        out[q + "attn.out.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[q + "mlp.fc1.weight"] = np.concatenate([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[q + "mlp.fc2.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


@pytest.fixture(scope="module")
def mistral():
    m, cfg = _mistral()
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, V, (2, 19))              # 19 > 3 windows
    m.generation_config.eos_token_id = None   # greedy to the end, as tpcore's generate without eos_token_id
    with torch.no_grad():
        logits = m(torch.tensor(tokens)).logits.numpy()
        gen = m.generate(torch.tensor(tokens[:, :13]), max_new_tokens=9, do_sample=False,
                         pad_token_id=0).numpy()[:, 13:]
    return cfg, _full(m, cfg), tokens, logits, gen


def _rank(comm, cfg, sd, tokens):
    model = TransformerLM(cfg, comm)
    model.load_state_dict_full(sd)
    logits = model.logits(tokens)
    out = model.generate(tokens[:, :13], max_new_tokens=9)   # max_len 22 > 2 windows: a ring of 10 rows
    mem = model.memory()
    return logits, np.asarray(out), mem["kv_cache"], [b.sliding_window for b in model.blocks]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_mistral_window_matches_transformers(mistral, world):
    cfg, sd, tokens, ref, gen = mistral
    with tpcore.Cluster(world) as cl:
        res = cl.run(_rank, cfg, sd, tokens)
    logits, out, kv, windows = res[0]
    assert windows == [W] * L
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert np.array_equal(out[:, -9:], gen), (out, gen)
    # the cache of every layer holds 2 windows per sequence, not the 22 positions
    heads_kv = {1: HK, 2: 1, 3: 1}[world]
    assert kv <= L * 2 * 2 * (2 * W) * heads_kv * (C // H) * 4 + L * 2 * 2 * 64
    assert kv < L * 2 * 2 * 22 * heads_kv * (C // H) * 4


def test_a_window_without_a_ring_when_max_len_is_short(mistral):
    """max_len <= 2 windows: a plain cache, one prefill of every token (no pieces)."""
    cfg, sd, tokens, ref, _ = mistral

    def run(comm):
        model = TransformerLM(cfg, comm)
        model.load_state_dict_full(sd)
        model.cache(2, 2 * W)
        h = model.forward(tokens[:, :2 * W], pos0=np.zeros(2, np.int64), use_cache=True)
        return model.gather_logits(model.logits_shard(h.reshape(-1, C))).reshape(2, 2 * W, V)
    with tpcore.Cluster(1) as cl:
        got = cl.run(run)[0]
    np.testing.assert_allclose(got, ref[:, :2 * W], rtol=1e-4, atol=1e-4 * np.abs(ref).max())
