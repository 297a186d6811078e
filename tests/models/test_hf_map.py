"""The Hugging Face name maps (tpcore/hf.py): one map per architecture, read one way by
from_hf (loading) and the other by to_hf (save_pretrained(hf=True)); they agree with
the shapes the config check expects, and a round trip gives back every number."""
import numpy as np
import pytest

import tpcore
from tpcore.models import hf

CONFIGS = {
    "gpt2": dict(vocab_size=97, hidden=24, layers=2, heads=6, ffn_hidden=40, norm="layernorm",
                 activation="gelu_tanh", positions="learned", bias=True, tie_embeddings=True, max_positions=32,
                 model_type="gpt2"),
    "gpt2-untied": dict(vocab_size=97, hidden=24, layers=2, heads=6, ffn_hidden=40, norm="layernorm",
                        activation="gelu", positions="learned", bias=True, tie_embeddings=False, max_positions=32,
                        model_type="gpt2"),
    "llama": dict(vocab_size=101, hidden=24, layers=3, heads=6, kv_heads=2, ffn_hidden=36, norm="rmsnorm",
                  eps=1e-6, activation="swiglu", positions="rope", bias=False, tie_embeddings=False,
                  max_positions=64, model_type="llama"),
    "llama-tied": dict(vocab_size=101, hidden=24, layers=1, heads=6, kv_heads=3, ffn_hidden=36, norm="rmsnorm",
                       activation="swiglu", positions="rope", bias=False, tie_embeddings=True, max_positions=64,
                       model_type="llama"),
    "bert": dict(vocab_size=89, hidden=20, layers=2, heads=5, ffn_hidden=33, norm="layernorm", eps=1e-12,
                 activation="gelu", positions="learned", bias=True, causal=False, pre_norm=False, final_norm=False,
                 embedding_norm=True, type_vocab_size=2, tie_embeddings=True, max_positions=40, model_type="bert"),
}


def _cfg(name):
    return tpcore.Config(**CONFIGS[name])


def _random_sd(cfg, seed=0):
    rng = np.random.default_rng(seed)
    req, _ = hf.expected_shapes(cfg, "tpcore")
    return {k: rng.standard_normal(tuple(v for v, _ in dims)).astype(np.float32) for k, dims in req.items()}


def _shapes(dims_by_name):
    return {k: tuple(v for v, _ in dims) for k, dims in dims_by_name.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_map_covers_the_model_and_the_checkpoint(name):
    cfg = _cfg(name)
    kind = cfg.model_type
    entries = hf.name_map(cfg)
    ours = [o for e in entries for o in e.ours]
    theirs = [t for e in entries for t in e.theirs]
    assert len(ours) == len(set(ours)) and len(theirs) == len(set(theirs)), "a name mapped twice"
    assert set(ours) == set(_shapes(hf.expected_shapes(cfg, "tpcore")[0])), "every tpcore tensor, once"
    req, opt = hf.expected_shapes(cfg, kind)
    assert set(req) <= set(theirs) <= set(req) | set(opt), "the names the config check expects"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_through_the_hugging_face_layout(name):
    cfg = _cfg(name)
    kind = cfg.model_type
    sd = _random_sd(cfg)
    tensors, conf = hf.to_hf(cfg, sd)
    assert conf["model_type"] == kind
    req, opt = hf.expected_shapes(cfg, kind)
    want = _shapes({**opt, **req})
    for k, v in tensors.items():
        assert v.dtype == np.float32 and v.flags.c_contiguous
        assert v.shape == want[hf.map_name(k, kind)], k
    back = hf.from_hf(tensors, cfg)
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert np.array_equal(np.asarray(back[k][...]), v), k


def test_gpt2_layout_is_transposed_and_fused():
    cfg = _cfg("gpt2")
    sd = _random_sd(cfg, 1)
    tensors, _ = hf.to_hf(cfg, sd)
    w = tensors["transformer.h.0.attn.c_attn.weight"]
    assert w.shape == (24, 72)
    assert np.array_equal(w[:, 24:48], sd["blocks.0.attn.k.weight"].T)
    assert np.array_equal(tensors["transformer.h.1.mlp.c_fc.weight"], sd["blocks.1.mlp.fc1.weight"].T)
    assert "lm_head.weight" not in tensors  # tied


def test_llama_gate_up_and_untied_head():
    cfg = _cfg("llama")
    sd = _random_sd(cfg, 2)
    tensors, _ = hf.to_hf(cfg, sd)
    fc1 = sd["blocks.2.mlp.fc1.weight"]
    assert np.array_equal(tensors["model.layers.2.mlp.gate_proj.weight"], fc1[:36])
    assert np.array_equal(tensors["model.layers.2.mlp.up_proj.weight"], fc1[36:])
    assert np.array_equal(tensors["lm_head.weight"], sd["lm_head.weight"])  # no prefix on the head
    del tensors["lm_head.weight"]  # an untied checkpoint without its head: the embedding (as transformers)
    back = hf.from_hf(tensors, cfg)
    assert np.array_equal(np.asarray(back["lm_head.weight"]), sd["wte.weight"])


def test_bert_prefix_and_old_layernorm_names():
    cfg = _cfg("bert")
    sd = _random_sd(cfg, 3)
    tensors, _ = hf.to_hf(cfg, sd)
    old = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in tensors.items()}
    back = hf.from_hf(old, cfg)
    for k, v in sd.items():
        assert np.array_equal(np.asarray(back[k][...]), v), k


def test_a_missing_tensor_is_named():
    cfg = _cfg("gpt2")
    tensors, _ = hf.to_hf(cfg, _random_sd(cfg))
    del tensors["transformer.h.1.ln_2.bias"]
    with pytest.raises(KeyError, match="h.1.ln_2.bias"):
        hf.from_hf(tensors, cfg)


def test_no_second_hand_written_inverse():
    """A Hugging Face tensor name is written in hf.py's code twice at most: in its name map
    and in the shapes the config check expects, never in a separate writer or reader."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(hf))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body and
            isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    consts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
              and id(n) not in docs]
    for piece in ("attn.c_attn.weight", "mlp.c_fc.bias", "ln_f.weight", "gate_proj.weight",
                  "post_attention_layernorm.weight", "o_proj.weight", "word_embeddings.weight",
                  "token_type_embeddings.weight", "qkv_proj.weight", "gate_up_proj.weight", "w1.weight",
                  "pre_feedforward_layernorm.weight", "q_norm.weight"):
        n = sum(piece in c for c in consts)
        assert 1 <= n <= 2, (piece, n)
