"""A float64 NumPy Transformer written for the tests from the formulas (never the
code under test): norms, rotary positions, masked softmax attention with grouped
KV heads, the MLPs, pre- and post-norm blocks."""
import math

import numpy as np

_erf = np.vectorize(math.erf)


def act(name, h):
    if name == "gelu":
        return 0.5 * h * (1 + _erf(h / math.sqrt(2)))
    if name == "gelu_tanh":
        return 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    if name == "silu":
        return h / (1 + np.exp(-h))
    if name == "relu":
        return np.maximum(h, 0)
    F = h.shape[-1] // 2
    g, u = h[..., :F], h[..., F:]
    if name == "geglu":
        return act("gelu_tanh", g) * u
    assert name == "swiglu", name
    return g / (1 + np.exp(-g)) * u


def norm(cfg, x, w, b):
    if cfg.norm == "rmsnorm":
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.eps) * w
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + cfg.eps) * w + (0 if b is None else b)


def rope(x, pos, theta):
    """x (B, T, heads, D) at positions pos (B, T): the rotate-half form."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = pos[..., None].astype(np.float64) * inv            # (B, T, D/2)
    c, s = np.cos(ang)[:, :, None, :], np.sin(ang)[:, :, None, :]
    a, b = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


def attention(cfg, p, u, pos, key_mask=None):
    B, T, C = u.shape
    H, Hk, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    bias = lambda n: p.get(n, 0)  # noqa: E731 (a one-line local helper)
    q = (u @ p["attn.q.weight"].T + bias("attn.q.bias")).reshape(B, T, H, D)
    k = (u @ p["attn.k.weight"].T + bias("attn.k.bias")).reshape(B, T, Hk, D)
    v = (u @ p["attn.v.weight"].T + bias("attn.v.bias")).reshape(B, T, Hk, D)
    if cfg.positions == "rope":
        q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
    k = np.repeat(k, H // Hk, axis=2)
    v = np.repeat(v, H // Hk, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)
    allowed = np.ones((B, 1, T, T), bool)
    if cfg.causal:
        allowed &= pos[:, None, :, None] >= pos[:, None, None, :]
    if key_mask is not None:
        allowed &= key_mask.astype(bool)[:, None, None, :]
    s = np.where(allowed, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    e = np.where(allowed, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0.0)
    den = e.sum(-1, keepdims=True)
    prob = np.where(den > 0, e / np.where(den > 0, den, 1), 0.0)
    o = np.einsum("bhij,bjhd->bihd", prob, v).reshape(B, T, H * D)
    return o @ p["attn.out.weight"].T + bias("attn.out.bias")


def mlp(cfg, p, u):
    h = u @ p["mlp.fc1.weight"].T + p.get("mlp.fc1.bias", 0)
    return act(cfg.activation, h) @ p["mlp.fc2.weight"].T + p.get("mlp.fc2.bias", 0)


def block(cfg, p, x, pos=None, key_mask=None):
    """x (B, T, C) float64 -> y; pos (B, T) positions (default 0..T-1)."""
    B, T, _ = x.shape
    if pos is None:
        pos = np.broadcast_to(np.arange(T), (B, T))
    n1b, n2b = p.get("norm1.bias"), p.get("norm2.bias")
    if cfg.pre_norm:
        h1 = x + attention(cfg, p, norm(cfg, x, p["norm1.weight"], n1b), pos, key_mask)
        return h1 + mlp(cfg, p, norm(cfg, h1, p["norm2.weight"], n2b))
    h1 = norm(cfg, x + attention(cfg, p, x, pos, key_mask), p["norm1.weight"], n1b)
    return norm(cfg, h1 + mlp(cfg, p, h1), p["norm2.weight"], n2b)


def directional_errors(loss, x64, P64, dx, grads, keys, g, eps=1e-6, rtol=1e-4):
    """Gradient checks by directional derivatives: for a random direction V of x and of each
    parameter in keys, the analytic <grad, V> against the central difference of loss(x, P)
    (float64).  The list of mismatches as sentences (empty: all agree)."""
    errs = []
    V = g.standard_normal(x64.shape)
    fd = (loss(x64 + eps * V, P64) - loss(x64 - eps * V, P64)) / (2 * eps)
    an = float((np.asarray(dx, np.float64) * V).sum())
    if abs(fd - an) > rtol * (1 + abs(fd)):
        errs.append(f"dx: directional {an:.6g} vs finite difference {fd:.6g}")
    for k in keys:
        Vk = g.standard_normal(P64[k].shape)
        pp, pm = dict(P64), dict(P64)
        pp[k] = P64[k] + eps * Vk
        pm[k] = P64[k] - eps * Vk
        fd = (loss(x64, pp) - loss(x64, pm)) / (2 * eps)
        an = float((np.asarray(grads[k], np.float64) * Vk).sum())
        if abs(fd - an) > rtol * (1 + abs(fd)):
            errs.append(f"d{k}: directional {an:.6g} vs finite difference {fd:.6g}")
    return errs


def random_block_params(block, g):
    """Random full parameters of a block (or attention), by block.full_shapes(): norm weights
    near 1, the other weights and biases small normals from the generator g."""
    P = {}
    for name, shape in block.full_shapes().items():
        if name.startswith("norm") and name.endswith("weight"):
            P[name] = (1 + 0.3 * g.standard_normal(shape)).astype(np.float32)
        else:
            P[name] = (g.standard_normal(shape) * (0.3 if name.endswith("weight") else 0.2)).astype(np.float32)
    return P
