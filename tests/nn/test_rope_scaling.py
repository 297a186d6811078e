"""Rotary scaling and GeGLU against their references.

tpcore.nn.rope.rope_frequencies against transformers' own rotary embedding (the module
LlamaRotaryEmbedding builds from a transformers config of the same values, run forward at
the sequence length for dynamic and longrope); the rope kernel with a frequency table and a
factor against float64 NumPy rotations (forward, and the inverse as the transpose); the
default (table-less) path against the old theta formula in float32 bit for bit; GeGLU (the
kernel and ParallelMLP at world 1 and 2) against torch's gelu(approximate="tanh") * up and
autograd in float64."""
import math

import numpy as np
import pytest

import tpcore
from tpcore import _C
from tpcore.nn import rope
from conftest import DEADLINE, rng_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

D = 64
L3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
YARN = {"rope_type": "yarn", "original_max_position_embeddings": 64}
LONG = {"rope_type": "longrope", "original_max_position_embeddings": 64,
        "short_factor": [1.0 + i / 40 for i in range(D // 2)], "long_factor": [1.0 + i / 3 for i in range(D // 2)]}
# (rope_scaling, max_positions, seq_len): every type with several parameter sets
CASES = [
    ({"rope_type": "default"}, 256, None),
    ({"type": "linear", "factor": 3.3}, 256, None),
    ({"rope_type": "linear", "factor": 0.75}, 256, 900),
    (dict(L3, factor=8.0, original_max_position_embeddings=64), 256, None),
    (dict(L3, factor=32.0, low_freq_factor=2.0, high_freq_factor=3.5, original_max_position_embeddings=8192), 256,
     None),
    (dict(L3, factor=8.0), 100, None),  # original_max_position_embeddings: max_positions (transformers' default)
    ({"rope_type": "dynamic", "factor": 2.7}, 256, None),
    ({"rope_type": "dynamic", "factor": 2.7}, 256, 200),
    ({"rope_type": "dynamic", "factor": 2.7}, 256, 1000),
    ({"rope_type": "dynamic", "factor": 1.37}, 256, 4099),
    ({"type": "dynamic", "factor": 4.0}, 128, 129),
    (dict(YARN, factor=4.0), 256, None),
    (dict(YARN, factor=4.0, truncate=False, beta_fast=24, beta_slow=2), 256, None),
    (dict(YARN, factor=8.0, mscale=1.2, mscale_all_dim=0.9), 256, None),
    (dict(YARN, factor=16.0, mscale=1.0, mscale_all_dim=1.0), 256, None),
    (dict(YARN, factor=2.5, attention_factor=1.25), 256, None),
    (dict(YARN, factor=None), 1024, None),  # factor from max_positions / original
    (dict(YARN, factor=3.0, beta_fast=64, beta_slow=64), 256, None),  # low == high: the 0.001 guard
    (LONG, 256, None),
    (LONG, 256, 64),
    (LONG, 256, 65),
    (dict(LONG, attention_factor=1.5, factor=4.0), 256, 300),
    (dict(LONG, original_max_position_embeddings=4096), 131072, 5000),  # Phi-3 128k style: factor = 32
]
THETAS = (10000.0, 500000.0, 12345.6)


def hf_frequencies(scaling, theta, mpe, seq_len):
    """transformers' inv_freq and attention scaling for these values (its module, run forward
    at seq_len when given)."""
    rp = dict(scaling, rope_theta=theta)
    cfg = LlamaConfig(hidden_size=2 * D, num_attention_heads=2, head_dim=D, max_position_embeddings=mpe,
                      rope_parameters=rp, vocab_size=8, num_hidden_layers=1)
    rot = LlamaRotaryEmbedding(cfg)
    if seq_len is not None:
        rot(torch.zeros(1, 1, D), torch.arange(seq_len)[None])
    return rot.inv_freq.numpy().copy(), float(rot.attention_scaling)


def cfg_of(scaling, theta, mpe, local_theta=None):
    return tpcore.Config(hidden=2 * D, heads=2, head_dim=D, positions="rope", rope_theta=theta, max_positions=mpe,
                         rope_scaling=scaling, rope_local_theta=local_theta, vocab_size=8, layers=1)


def ulps(a, b):
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_frequencies_equal_transformers(case, monkeypatch):
    """Bit for bit with torch's float32 pow in place of tpcore's (every other step mirrors
    transformers' in float32); with tpcore's own correctly rounded pow within 2 ulp, equal
    wherever torch's vectorized pow rounds correctly."""
    scaling, mpe, seq_len = CASES[case]
    for theta in THETAS:
        want, want_factor = hf_frequencies(scaling, theta, mpe, seq_len)
        cfg = cfg_of(scaling, theta, mpe)
        got, factor = rope.rope_frequencies(cfg, seq_len)
        assert got.dtype == np.float32 and got.shape == (D // 2,)
        assert factor == want_factor, (theta, factor, want_factor)
        assert ulps(got, want).max() <= 2, (theta, got, want)
        with monkeypatch.context() as m:
            m.setattr(rope, "_pow32", lambda b, e: (torch.tensor(b) ** torch.from_numpy(e)).numpy())
            exact, _ = rope.rope_frequencies(cfg, seq_len)
        assert np.array_equal(exact.view(np.uint32), want.view(np.uint32)), (theta, ulps(exact, want))


def test_pow_is_correctly_rounded_where_it_differs_from_torch():
    """The one step not mirrored bit for bit: theta^e, correctly rounded here; torch's
    vectorized pow is off by one unit on a few exponents, and only there do the tables differ."""
    e = rope._exponents(256)
    for theta in (10000.0, 12345.6, 1e6):
        mine = rope._pow32(np.float32(theta), e)
        exact = np.array([float(np.float32(math.pow(float(np.float32(theta)), float(x)))) for x in e], np.float32)
        assert np.array_equal(mine, exact)
        theirs = (torch.tensor(np.float32(theta)) ** torch.from_numpy(e)).numpy()
        assert ulps(mine, theirs).max() <= 1
        cfg = cfg_of(None, theta, 256)
        cfg.head_dim = 256
        want = (1.0 / (theta ** (torch.arange(0, 256, 2, dtype=torch.int64).float() / 256))).numpy()
        got, _ = rope.rope_frequencies(cfg)
        assert np.array_equal(got != want, mine != theirs)


def test_local_layers_and_length_dependence():
    lin = {"rope_type": "linear", "factor": 8.0}
    cfg = cfg_of(lin, 1e6, 256, local_theta=10000.0)
    local, f = rope.rope_frequencies(cfg, local=True)
    want, wf = hf_frequencies({"rope_type": "default"}, 10000.0, 256, None)
    assert f == wf == 1.0 and np.array_equal(local, want)
    glob, _ = rope.rope_frequencies(cfg)
    assert np.array_equal(glob, hf_frequencies(lin, 1e6, 256, None)[0])
    plain = cfg_of(lin, 1e6, 256)  # no local base: the sliding layers rotate as the global ones
    assert np.array_equal(rope.rope_frequencies(plain, local=True)[0], glob)
    assert rope.rope_type(cfg) == "linear" and rope.rope_type(cfg, local=True) == "default"
    for scaling, dep in ((None, False), (lin, False), ({"rope_type": "dynamic", "factor": 2.0}, True),
                         (LONG, True), (dict(L3, factor=8.0), False), (dict(YARN, factor=4.0), False)):
        c = cfg_of(scaling, 1e4, 256)
        assert rope.depends_on_length(c) is dep
        assert rope.depends_on_length(cfg_of(scaling, 1e4, 256, local_theta=1e4), local=True) is False
    dyn = cfg_of({"rope_type": "dynamic", "factor": 2.0}, 1e4, 256)
    assert np.array_equal(rope.rope_frequencies(dyn, 256)[0], rope.rope_frequencies(dyn)[0])
    assert not np.array_equal(rope.rope_frequencies(dyn, 257)[0], rope.rope_frequencies(dyn)[0])


@pytest.mark.parametrize("scaling, mpe, message", [
    ({"rope_type": "su"}, 256, "supported: default, linear, dynamic, yarn, longrope, llama3"),
    ({"rope_type": "linear"}, 256, "'factor'"),
    ({"rope_type": "dynamic"}, 256, "'factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, 256, "'high_freq_factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, 256,
     "high_freq_factor"),
    ({"rope_type": "yarn"}, 256, "'factor'"),
    ({"rope_type": "yarn", "factor": "4"}, 256, "factor must be a finite number"),
    ({"rope_type": "linear", "factor": -2.0}, 256, "factor must be > 0"),
    ({"rope_type": "linear", "factor": float("nan")}, 256, "factor must be a finite number"),
    ({"rope_type": "longrope", "short_factor": [1.0] * (D // 2)}, 256, "'long_factor'"),
    (dict(LONG, short_factor=[1.0] * 3), 256, "short_factor must be 32 finite numbers"),
    (dict(LONG, original_max_position_embeddings=0), 256, "original_max_position_embeddings"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, 256, "partial_rotary_factor"),
    ({"rope_type": "default", "rope_theta": 5.0}, 256, "differs from cfg.rope_theta"),
])
def test_refusals_name_the_field(scaling, mpe, message):
    cfg = cfg_of(None, 1e4, mpe)
    cfg.rope_scaling = scaling  # (Config itself refuses an unknown rope_type)
    with pytest.raises(ValueError) as e:
        rope.rope_frequencies(cfg, 300)
    assert message in str(e.value)


def test_refusals_of_the_shape():
    cfg = cfg_of(None, 1e4, 256)
    cfg.rope_scaling = {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}
    with pytest.raises(ValueError, match="per layer type"):
        rope.rope_frequencies(cfg)
    cfg = cfg_of(None, 1e4, 256)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        rope.rope_frequencies(cfg, 0)
    with pytest.raises(TypeError, match="seq_len"):
        rope.rope_frequencies(cfg, 3.0)
    cfg.rope_scaling = [("rope_type", "linear")]
    with pytest.raises(TypeError, match="rope_scaling must be a dict"):
        rope.rope_frequencies(cfg)


# ------------------------------------------------------------------ the rope kernel

def rotation64(x, pos, heads, inv_freq, factor, inverse):
    """x [rows, >= heads * D] rotated in float64 from the float32 angle float32(pos) * inv_freq."""
    half = inv_freq.size
    ang = (pos.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float32).astype(np.float64)
    c, s = factor * np.cos(ang), factor * np.sin(ang) * (-1 if inverse else 1)
    out = x.astype(np.float64).copy()
    for h in range(heads):
        a, b = x[:, h * 2 * half:h * 2 * half + half].astype(np.float64), x[:, h * 2 * half + half:(h + 1) * 2 * half]
        out[:, h * 2 * half:h * 2 * half + half] = a * c - b * s
        out[:, h * 2 * half + half:(h + 1) * 2 * half] = b * c + a * s
    return out


@pytest.mark.parametrize("Dh, heads", [(2, 1), (8, 3), (64, 2)])
def test_rope_kernel_with_a_table(Dh, heads):
    """(Strided rows, the fused QKV layout, are csrc/tests/test_kernels_nn.c's case_rope.)"""
    g = rng_for(28, Dh)
    rows, width = 7, heads * Dh
    x = g.standard_normal((rows, width)).astype(np.float32)
    pos = np.array([0, 1, 5, 17, 300, 4097, 70000], np.int64)
    cfg = cfg_of(dict(YARN, factor=4.0), 500000.0, 256)
    cfg.head_dim = Dh
    inv, factor = rope.rope_frequencies(cfg)
    assert factor > 1
    for inverse in (False, True):
        y = x.copy()
        _C.rope_apply(y, pos, heads, Dh, inv, 10000.0, factor, inverse)  # strided rows
        ref = rotation64(x, pos, heads, inv, factor, inverse)
        tol = 4 * 2.0 ** -24 * factor * (np.abs(x) + np.abs(np.roll(x, Dh // 2, 1))) + 1e-30
        err = np.abs(y - ref)
        assert np.all(err <= 2 * tol + 1e-7), err.max()
    # inverse = the transpose, factor kept: <R x, z> == <x, R^T z>
    z = g.standard_normal((rows, width)).astype(np.float32)
    rx, rtz = x.copy(), z.copy()
    _C.rope_apply(rx, pos, heads, Dh, inv, factor=factor)
    _C.rope_apply(rtz, pos, heads, Dh, inv, factor=factor, inverse=True)
    n = heads * Dh
    lhs = np.sum(rx[:, :n].astype(np.float64) * z[:, :n])
    rhs = np.sum(x[:, :n].astype(np.float64) * rtz[:, :n])
    assert abs(lhs - rhs) <= 1e-5 * (1 + abs(lhs))
    # with factor 1, the inverse undoes the forward
    back = x.copy()
    _C.rope_apply(back, pos, heads, Dh, inv)
    _C.rope_apply(back, pos, heads, Dh, inv, inverse=True)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-5)


def old_formula32(x, pos, heads, Dh, theta, inverse):
    """The table-less rope before the table existed, step by step in float32: inv_freq =
    float32(1 / theta^(2i/D)) from a double pow, angle = float32(pos) * inv_freq in float32,
    cos and sin in double rounded to float32, two products and a sum in float32."""
    half = Dh // 2
    inv = np.array([np.float32(1.0 / math.pow(theta, 2 * i / Dh)) for i in range(half)], np.float32)
    y = x.copy()
    for m in range(x.shape[0]):
        ang = np.float32(pos[m]) * inv
        c = np.array([math.cos(float(a)) for a in ang], np.float32)
        s = np.array([math.sin(float(a)) for a in ang], np.float32) * np.float32(-1 if inverse else 1)
        for h in range(heads):
            a, b = x[m, h * Dh:h * Dh + half], x[m, h * Dh + half:(h + 1) * Dh]
            y[m, h * Dh:h * Dh + half] = a * c - b * s
            y[m, h * Dh + half:(h + 1) * Dh] = b * c + a * s
    return y


@pytest.mark.parametrize("theta", [10000.0, 500000.0, 123.25])
def test_rope_kernel_default_path_unchanged(theta):
    g = rng_for(29, int(theta))
    x = g.standard_normal((5, 3 * 16)).astype(np.float32)
    pos = np.array([0, 3, 99, 2048, 131071], np.int64)
    for inverse in (False, True):
        y = x.copy()
        _C.rope_apply(y, pos, 3, 16, None, theta, 1.0, inverse)
        assert np.array_equal(y.view(np.uint32), old_formula32(x, pos, 3, 16, theta, inverse).view(np.uint32))


def test_rope_apply_refuses_bad_arguments():
    x = np.zeros((2, 8), np.float32)
    pos = np.zeros(2, np.int64)
    inv = np.ones(4, np.float32)
    for kw, word in (({"factor": 0.0}, "factor"), ({"factor": float("inf")}, "factor"),
                     ({"factor": float("nan")}, "factor"), ({"theta": 0.0, "inv_freq": None}, "theta")):
        with pytest.raises(ValueError, match=word):
            _C.rope_apply(x, pos, 1, 8, **dict({"inv_freq": inv}, **kw))
    bad = inv.copy()
    bad[2] = np.nan
    with pytest.raises(ValueError, match="inv_freq must hold finite values.*index 2"):
        _C.rope_apply(x, pos, 1, 8, bad)
    with pytest.raises(ValueError, match="inv_freq"):
        _C.rope_apply(x, pos, 1, 8, np.ones(3, np.float32))


# ------------------------------------------------------------------ GeGLU

def geglu_torch(h, dout):
    """torch's gelu(gate, approximate="tanh") * up and its autograd gradient, float64."""
    t = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    F = h.shape[-1] // 2
    y = torch.nn.functional.gelu(t[..., :F], approximate="tanh") * t[..., F:]
    y.backward(torch.tensor(dout, dtype=torch.float64))
    return y.detach().numpy(), t.grad.numpy()


def test_geglu_kernel_matches_torch():
    g = rng_for(30, 0)
    h = (g.standard_normal((9, 2 * 13)) * 3).astype(np.float32)
    d = g.standard_normal((9, 13)).astype(np.float32)
    want_y, want_dh = geglu_torch(h, d)
    y = _C.act_forward("geglu", h)
    dh = _C.act_backward("geglu", h, d)
    assert y.shape == (9, 13) and dh.shape == h.shape
    # float32 tanh / exp: 2e-6 (1 + |gate|) per unit of up and dout, as csrc/tests/test_kernels_nn.c's act_refs
    gate, up = np.abs(h[:, :13]).astype(np.float64), np.abs(h[:, 13:]).astype(np.float64)
    assert np.all(np.abs(y - want_y) <= 2e-6 * (1 + gate) * (1 + up))
    scale = np.abs(d) * (1 + gate) * (1 + up)
    assert np.all(np.abs(dh - want_dh) <= 2e-6 * np.concatenate([scale, np.abs(d) * (1 + gate)], 1))
    # the gate's GELU is TP_ACT_GELU_TANH's, bit for bit
    gate = np.ascontiguousarray(h[:, :13])
    ones = np.concatenate([gate, np.ones_like(gate)], 1)
    assert np.array_equal(_C.act_forward("geglu", ones), _C.act_forward("gelu_tanh", gate))
    with pytest.raises(ValueError, match="geglu needs an even number of columns"):
        _C.act_forward("geglu", h[:, :25].copy())


def _geglu_mlp(comm, seed):
    H, F, R = 12, 19, 5
    mlp = tpcore.ParallelMLP(H, F, comm, activation="geglu", seed=seed)
    g = rng_for(seed, 0)
    W1 = (g.standard_normal((2 * F, H)) / 3).astype(np.float32)
    b1 = g.standard_normal(2 * F).astype(np.float32)
    W2 = (g.standard_normal((H, F)) / 3).astype(np.float32)
    b2 = g.standard_normal(H).astype(np.float32)
    mlp.fc1.load_full(W1, b1)
    mlp.fc2.load_full(W2, b2)
    x = g.standard_normal((R, H)).astype(np.float32)
    dy = g.standard_normal((R, H)).astype(np.float32)
    y = mlp(x)
    dx = mlp.backward(dy)
    saved = mlp.fc1.weight.copy(), mlp.fc1.bias.copy()
    mlp.fc1.weight[...], mlp.fc1.bias[...] = mlp.fc1.grad_weight, mlp.fc1.grad_bias
    gW1, gb1 = mlp.fc1.gather_full()
    mlp.fc1.weight[...], mlp.fc1.bias[...] = saved
    return y, dx, gW1, gb1, (W1, b1, W2, b2, x, dy)


def _split_run(comm, world, seed):
    sub = comm.split(0 if world == 2 else comm.rank)
    return _geglu_mlp(sub, seed)


def test_parallel_mlp_geglu_matches_torch():
    """World 1 and 2 in one Cluster of 2 ranks (world 1: each rank alone, by split)."""
    with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
        results = cluster.run(_split_run, 1, 41) + cluster.run(_split_run, 2, 42)
    for y, dx, gW1, gb1, (W1, b1, W2, b2, x, dy) in results:
        p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
             for k, v in (("W1", W1), ("b1", b1), ("W2", W2), ("b2", b2), ("x", x))}
        F = W2.shape[1]
        h = p["x"] @ p["W1"].T + p["b1"]
        a = torch.nn.functional.gelu(h[:, :F], approximate="tanh") * h[:, F:]
        out = a @ p["W2"].T + p["b2"]
        out.backward(torch.tensor(dy, dtype=torch.float64))
        np.testing.assert_allclose(y, out.detach().numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dx, p["x"].grad.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(gW1, p["W1"].grad.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(gb1, p["b1"].grad.numpy(), rtol=1e-4, atol=1e-4)
