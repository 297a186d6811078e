"""The references of the tpcore.torch tests, in float64 torch written here: tolerances and
comparisons, seeded random tensors, an uneven partition, the small sizes, and the MLP,
attention and Transformer block of each family (CONFIGS) built from full tensors."""
import math

import torch

import tpcore

F = torch.nn.functional

TOL = 2e-5  # float32 C layers against float64 references (abs + rel)


def close(got, want, what, tol=TOL):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs() - tol * (1 + want.abs())
    assert err.max().item() <= 0 if err.numel() else True, \
        f"{what}: max |diff| {(got - want).abs().max().item():.3g} (scale {want.abs().max().item():.3g})"


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def uneven(n, world):
    """An uneven partition of n over world ranks (one rank may hold nothing)."""
    return tpcore.partition(n, world, weights=[(1, 3, 0, 2)[r % 4] + (world == 1) for r in range(world)])

IN, OUT = 13, 10

H, FFN = 9, 11
ACTS = {"gelu": lambda h: F.gelu(h), "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "silu": F.silu,
        "relu": F.relu, "swiglu": lambda h: F.silu(h[..., :h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:]}

V, DIM = 17, 5

def mlp_ref(act, P, x):
    h = F.linear(x, P["fc1.weight"], P.get("fc1.bias"))
    return F.linear(ACTS[act](h), P["fc2.weight"], P.get("fc2.bias"))


def rope(x, theta):
    """x (B, T, heads, D) at positions 0..T-1, the rotate-half form."""
    T, D = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv  # (T, D/2)
    c, s = torch.cos(ang)[None, :, None, :].to(x.dtype), torch.sin(ang)[None, :, None, :].to(x.dtype)
    a, b = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def ref_attention(cfg, P, u, key_mask=None):
    """Single-process multi-head attention (grouped KV heads, rope, causal, padding mask)."""
    B, T, _ = u.shape
    Hq, Hk, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    q = F.linear(u, P["attn.q.weight"], P.get("attn.q.bias")).reshape(B, T, Hq, D)
    k = F.linear(u, P["attn.k.weight"], P.get("attn.k.bias")).reshape(B, T, Hk, D)
    v = F.linear(u, P["attn.v.weight"], P.get("attn.v.bias")).reshape(B, T, Hk, D)
    if cfg.positions == "rope":
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
    k, v = k.repeat_interleave(Hq // Hk, 2), v.repeat_interleave(Hq // Hk, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    if cfg.causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool).tril()
    if key_mask is not None:
        allowed = allowed & key_mask.bool()[:, None, None, :]
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    o = torch.einsum("bhij,bjhd->bihd", p, v).reshape(B, T, Hq * D)
    return F.linear(o, P["attn.out.weight"], P.get("attn.out.bias"))


def ref_block(cfg, P, x, key_mask=None):
    """A single-process torch block from the full tensors P (any float dtype; differentiable)."""
    def norm(h, w, b):
        if cfg.norm == "rmsnorm":
            return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + cfg.eps) * w
        return F.layer_norm(h, (h.shape[-1],), w, b, cfg.eps)

    def attn(u):
        return ref_attention(cfg, P, u, key_mask)

    def mlp(u):
        return mlp_ref(cfg.activation, {k[4:]: v for k, v in P.items() if k.startswith("mlp.")}, u)

    n1 = (P["norm1.weight"], P.get("norm1.bias"))
    n2 = (P["norm2.weight"], P.get("norm2.bias"))
    if cfg.pre_norm:
        h = x + attn(norm(x, *n1))
        return h + mlp(norm(h, *n2))
    h = norm(x + attn(x), *n1)
    return norm(h + mlp(h), *n2)


CONFIGS = {
    "gpt": dict(vocab_size=V, hidden=8, layers=1, heads=4, ffn_hidden=11, activation="gelu_tanh", max_positions=16),
    "llama": dict(vocab_size=V, hidden=12, layers=1, heads=4, kv_heads=2, head_dim=4, ffn_hidden=9, norm="rmsnorm",
                  activation="swiglu", positions="rope", bias=False, max_positions=16),
    "bert": dict(vocab_size=V, hidden=8, layers=1, heads=2, ffn_hidden=7, activation="gelu", causal=False,
                 pre_norm=False, max_positions=16),
}


def random_full(block, g):
    """Random full tensors of a block's full shapes (norm weights around 1)."""
    P = {}
    for k, shape in block.full_shapes().items():
        t = randn(g, *shape) * (0.3 if "weight" in k and "norm" not in k else 0.1)
        P[k] = 1 + t if k.startswith("norm") and k.endswith("weight") else t
    return P
