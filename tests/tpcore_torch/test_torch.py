"""tpcore.torch: the nn.Modules over the C layers against single-process float64 torch
references written here (torch.nn.functional, autograd): forward, input gradients and
parameter gradients at world sizes 1-4 with odd and uneven sizes; two forwards before a
backward, retain_graph, no_grad, requires_grad=False, accumulation; a small model trained
at world 2 step for step against the plain torch model; full state dicts across world
sizes; sharded state dicts; zero-copy crossings; bad inputs."""
import copy
import math
import pickle
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import tpcore  # noqa: E402  (after importorskip("torch"): the module skips without torch)
import tpcore.torch as tt  # noqa: E402  (after importorskip("torch"): the module skips without torch)
from conftest import WORLDS, run  # noqa: E402  (after importorskip("torch"): the module skips without torch)
import paths  # noqa: E402  (after importorskip("torch"))

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


# ------------------------------------------------------------------ linear layers
IN, OUT = 13, 10


def _linear_case(comm):
    n, r = comm.size, comm.rank
    for kind, flag, part_of, use_bias in (("column", False, None, True), ("column", True, uneven, True),
                                          ("column", False, uneven, False), ("row", True, None, True),
                                          ("row", False, uneven, True), ("row", True, uneven, False)):
        g = gen(1000 + 7 * n + len(kind) + flag)  # the same full tensors on every rank
        W, b = randn(g, OUT, IN), randn(g, OUT)
        x, dy = randn(g, 2, 3, IN), randn(g, 2, 3, OUT)
        if kind == "column":
            m = tt.ColumnParallelLinear(IN, OUT, comm, bias=use_bias, gather_output=flag,
                                        partition=part_of and part_of(OUT, n), seed=3)
        else:
            m = tt.RowParallelLinear(IN, OUT, comm, bias=use_bias, input_is_parallel=flag,
                                     partition=part_of and part_of(IN, n), seed=3)
        # the full weights go in through load_state_dict, with nn.Linear's names
        ref = torch.nn.Linear(IN, OUT, bias=use_bias, dtype=torch.float64)
        with torch.no_grad():
            ref.weight.copy_(W)
            if use_bias:
                ref.bias.copy_(b)
        m.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
        off, loc = m.partition[r]
        what = f"{kind} flag={flag} bias={use_bias} rank {r}/{n}"
        for p in ref.parameters():
            p.grad = None
        x64 = x.double().requires_grad_()
        y64 = ref(x64)
        y64.backward(dy.double())
        if kind == "row" and flag:  # this rank's columns of x come in, and their gradient goes out
            xin = x[..., off:off + loc].clone().requires_grad_()
        else:
            xin = x.clone().requires_grad_()
        y = m(xin)
        want_y = y64[..., off:off + loc] if kind == "column" and not flag else y64
        close(y, want_y, f"{what}: y")
        dy_in = dy[..., off:off + loc] if kind == "column" and not flag else dy
        y.backward(dy_in)
        want_dx = x64.grad[..., off:off + loc] if kind == "row" and flag else x64.grad
        close(xin.grad, want_dx, f"{what}: dx")
        if kind == "column":
            close(m.weight.grad, ref.weight.grad[off:off + loc], f"{what}: dW")
            if use_bias:
                close(m.bias.grad, ref.bias.grad[off:off + loc], f"{what}: db")
        else:
            close(m.weight.grad, ref.weight.grad[:, off:off + loc], f"{what}: dW")
            if use_bias:
                close(m.bias.grad, ref.bias.grad, f"{what}: db")
        if not use_bias:
            assert m.bias is None and "bias" not in dict(m.named_parameters())
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_linear_forward_backward(world):
    assert run(_linear_case, world) == [True] * world


# ------------------------------------------------------------------ MLP
H, FFN = 9, 11
ACTS = {"gelu": lambda h: F.gelu(h), "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "silu": F.silu,
        "relu": F.relu, "swiglu": lambda h: F.silu(h[..., :h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:]}


def _mlp_ref(act, P, x):
    h = F.linear(x, P["fc1.weight"], P.get("fc1.bias"))
    return F.linear(ACTS[act](h), P["fc2.weight"], P.get("fc2.bias"))


def _mlp_case(comm):
    n, r = comm.size, comm.rank
    for i, act in enumerate(ACTS):
        use_bias = act != "relu"
        g_ = 2 if act == "swiglu" else 1
        g = gen(2000 + 10 * n + i)
        P = {"fc1.weight": randn(g, g_ * FFN, H), "fc2.weight": randn(g, H, FFN) / 3}
        if use_bias:
            P.update({"fc1.bias": randn(g, g_ * FFN), "fc2.bias": randn(g, H)})
        x, dy = randn(g, 3, 2, H), randn(g, 3, 2, H)
        m = tt.ParallelMLP(H, FFN, comm, activation=act, bias=use_bias, partition=uneven(FFN, n) if i % 2 else None)
        m.load_state_dict(P)
        P64 = {k: v.double().requires_grad_() for k, v in P.items()}
        x64 = x.double().requires_grad_()
        _mlp_ref(act, P64, x64).backward(dy.double())
        xin = x.clone().requires_grad_()
        y = m(xin)
        what = f"{act} rank {r}/{n}"
        close(y, _mlp_ref(act, P64, x64), f"{what}: y")
        y.backward(dy)
        close(xin.grad, x64.grad, f"{what}: dx")
        off, loc = m.layer.fc1.partition[r]
        rows = list(range(off, off + loc)) + ([FFN + j for j in range(off, off + loc)] if act == "swiglu" else [])
        close(m.fc1.weight.grad, P64["fc1.weight"].grad[rows], f"{what}: fc1 dW")
        close(m.fc2.weight.grad, P64["fc2.weight"].grad[:, off:off + loc], f"{what}: fc2 dW")
        if use_bias:
            close(m.fc1.bias.grad, P64["fc1.bias"].grad[rows], f"{what}: fc1 db")
            close(m.fc2.bias.grad, P64["fc2.bias"].grad, f"{what}: fc2 db")
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_mlp_forward_backward(world):
    assert run(_mlp_case, world) == [True] * world


# ------------------------------------------------------------------ vocabulary-parallel
V, DIM = 17, 5


def _vocab_case(comm):
    n, r = comm.size, comm.rank
    g = gen(3000 + n)
    table = randn(g, V, DIM)
    tokens = torch.randint(0, V, (3, 4), generator=g)
    dout = randn(g, 3, 4, DIM)
    emb = tt.VocabParallelEmbedding(V, DIM, comm, partition=uneven(V, n) if n % 2 else None)
    emb.load_state_dict({"weight": table})
    off, loc = emb.partition[r]
    t64 = table.double().requires_grad_()
    want = F.embedding(tokens, t64)
    want.backward(dout.double())
    y = emb(tokens)
    close(y, want, "embedding y")
    y.backward(dout)
    close(emb.weight.grad, t64.grad[off:off + loc], "embedding dW")

    # cross-entropy of each rank's logits shard, the three reductions and ignore_index
    logits, targets = randn(g, 3, 4, V) * 2, torch.randint(0, V, (3, 4), generator=g)
    targets[0, 1] = targets[2, 3] = -100
    weights = randn(g, 3, 4)
    part = tpcore.partition(V, n) if n % 2 else uneven(V, n)
    off, loc = part[r]
    for reduction in ("mean", "sum", "none"):
        l64 = logits.double().requires_grad_()
        want = F.cross_entropy(l64.reshape(-1, V), targets.reshape(-1), ignore_index=-100,
                               reduction=reduction)
        shard = logits[..., off:off + loc].clone().requires_grad_()
        got = tt.vocab_parallel_cross_entropy(shard, targets, comm, reduction=reduction)
        if reduction == "none":
            want = want.reshape(3, 4)
            (want * weights.double()).sum().backward()
            (got * weights).sum().backward()
        else:
            want.backward()
            got.backward()
        close(got, want, f"xent {reduction}")
        close(shard.grad, l64.grad[..., off:off + loc], f"xent {reduction}: dlogits")
    # the module form, with an explicit vocab_offset and another ignore_index
    xent = tt.VocabParallelCrossEntropy(comm, ignore_index=3)
    shard = logits[..., off:off + loc].clone().requires_grad_()
    t2 = targets.clamp(min=0)
    got = xent(shard, t2, vocab_offset=off)
    l64 = logits.double().requires_grad_()
    want = F.cross_entropy(l64.reshape(-1, V), t2.reshape(-1), ignore_index=3)
    want.backward()
    got.backward()
    close(got, want, "xent module")
    close(shard.grad, l64.grad[..., off:off + loc], "xent module: dlogits")
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_vocab_embedding_and_cross_entropy(world):
    assert run(_vocab_case, world) == [True] * world


# ------------------------------------------------------------------ Transformer block
def _rope(x, theta):
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
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
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
        return _mlp_ref(cfg.activation, {k[4:]: v for k, v in P.items() if k.startswith("mlp.")}, u)

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


def _random_full(block, g):
    """Random full tensors of a block's full shapes (norm weights around 1)."""
    P = {}
    for k, shape in block.full_shapes().items():
        t = randn(g, *shape) * (0.3 if "weight" in k and "norm" not in k else 0.1)
        P[k] = 1 + t if k.startswith("norm") and k.endswith("weight") else t
    return P


def _block_case(comm, name):
    n, r = comm.size, comm.rank
    cfg = tpcore.Config(**CONFIGS[name])
    blk = tt.TransformerBlock(cfg, comm, ffn_partition=uneven(cfg.ffn_hidden, n) if n > 2 else None)
    g = gen(4000 + n)
    P = _random_full(blk.layer, g)
    blk.load_state_dict(P)
    x1, x2, dy1, dy2 = (randn(g, 2, 5, cfg.hidden) for _ in range(4))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False  # padding at the end of the second sequence
    P64 = {k: v.double().requires_grad_() for k, v in P.items()}
    xs = [x1.double().requires_grad_(), x2.double().requires_grad_()]
    ref_block(cfg, P64, xs[0], mask).backward(dy1.double())
    g1 = {k: v.grad.clone() for k, v in P64.items()}
    ref_block(cfg, P64, xs[1]).backward(dy2.double())  # accumulated: the sum of both
    a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    y1 = blk(a, key_mask=mask)
    y2 = blk(b)  # a second forward before the first backward: the first is replayed
    close(y1, ref_block(cfg, P64, xs[0], mask), f"{name}: y1", 5e-5)
    close(y2, ref_block(cfg, P64, xs[1]), f"{name}: y2", 5e-5)
    y1.backward(dy1)
    close(a.grad, xs[0].grad, f"{name}: dx1", 5e-5)
    full = blk.layer
    slices = full._slices()
    for k, (local, rows, cut) in slices.items():  # this rank's slice of each full gradient
        want = g1[k][cut]
        got = dict(blk.named_parameters())[local].grad[rows]
        close(got, want, f"{name} rank {r}/{n}: grad {k}", 5e-5)
    y2.backward(dy2)
    close(b.grad, xs[1].grad, f"{name}: dx2", 5e-5)
    grads = {local: p.grad for local, p in blk.named_parameters()}
    for k, (local, rows, cut) in slices.items():  # summed over both backwards
        close(grads[local][rows], P64[k].grad[cut], f"{name} rank {r}/{n}: accumulated grad {k}", 5e-5)
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_forward_backward(world, name):
    assert run(_block_case, world, name) == [True] * world


def _attention_case(comm, name):
    cfg = tpcore.Config(**CONFIGS[name])
    att = tt.ParallelAttention(cfg, comm)
    assert sorted(n for n, _ in att.named_parameters()) == sorted(
        k for k in ("attn.qkv.weight", "attn.qkv.bias", "attn.out.weight", "attn.out.bias")
        if k in att.layer.named_parameters())
    g = gen(4500 + comm.size)
    P = _random_full(att.layer, g)
    att.load_state_dict(P)
    x, dy = randn(g, 2, 4, cfg.hidden), randn(g, 2, 4, cfg.hidden)
    P64 = {k: v.double().requires_grad_() for k, v in P.items()}
    x64 = x.double().requires_grad_()
    want = ref_attention(cfg, P64, x64)
    want.backward(dy.double())
    xin = x.clone().requires_grad_()
    y = att(xin)
    close(y, want, f"{name} attention y", 5e-5)
    y.backward(dy)
    close(xin.grad, x64.grad, f"{name} attention dx", 5e-5)
    params = dict(att.named_parameters())
    for k, (local, rows, cut) in att.layer._slices().items():
        close(params[local].grad[rows], P64[k].grad[cut], f"{name} attention grad {k}", 5e-5)
    return True


@pytest.mark.parametrize("world,name", [(1, "gpt"), (3, "llama"), (2, "bert")])
def test_parallel_attention(world, name):
    assert run(_attention_case, world, name) == [True] * world


# ------------------------------------------------------------------ autograd semantics
def _semantics_case(comm):
    r = comm.rank
    g = gen(5000)
    m = tt.ColumnParallelLinear(IN, OUT, comm, gather_output=True)
    W, b = randn(g, OUT, IN), randn(g, OUT)
    m.load_state_dict({"weight": W, "bias": b})
    off, loc = m.partition[r]
    x1, x2, dy = randn(g, 4, IN), randn(g, 4, IN), randn(g, 4, OUT)
    dW = lambda x, d: (d.double().T @ x.double())[off:off + loc]  # noqa: E731 (a one-line local helper)

    # two forwards, then the backwards in reverse order; the second backward accumulates
    a, c = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    ya, yc = m(a), m(c)
    yc.backward(dy)
    close(m.weight.grad, dW(x2, dy), "dW of the second forward")
    ya.backward(dy)
    close(m.weight.grad, dW(x1, dy) + dW(x2, dy), "accumulated dW")
    close(a.grad, dy.double() @ W.double(), "dx of the first forward")

    # retain_graph: a second backward through the same graph adds the same gradient again
    m.zero_grad()
    y = m(x1)
    y.backward(dy, retain_graph=True)
    y.backward(dy)
    close(m.weight.grad, 2 * dW(x1, dy), "retain_graph dW")

    # no_grad in between does not disturb a pending backward; its output has no graph
    m.zero_grad()
    y = m(x1)
    with torch.no_grad():
        z = m(x2)
    assert not z.requires_grad and z.grad_fn is None
    close(z, x2.double() @ W.double().T + b.double(), "no_grad y")
    y.backward(dy)
    close(m.weight.grad, dW(x1, dy), "dW after a no_grad forward")

    # requires_grad=False on a parameter: no gradient for it, the others as usual
    m.zero_grad()
    m.weight.requires_grad_(False)
    xin = x1.clone().requires_grad_()
    m(xin).backward(dy)
    assert m.weight.grad is None
    close(m.bias.grad, dy.double().sum(0)[off:off + loc], "db with a frozen weight")
    close(xin.grad, dy.double() @ W.double(), "dx with a frozen weight")
    # nothing requires a gradient: a plain forward without a graph
    m.bias.requires_grad_(False)
    y = m(x1)
    assert y.grad_fn is None
    m.weight.requires_grad_(True)
    m.bias.requires_grad_(True)

    # so is a load_state_dict between forward and backward (C writes the parameters: versions bumped)
    y = m(x1)
    m.load_state_dict({k: v + 1 for k, v in m.state_dict().items()})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    m.load_state_dict({"weight": W, "bias": b})

    # an optimizer step between forward and backward is caught by torch, as for nn.Linear
    y = m(x1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.zero_grad()
    m(x1).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    # bfloat16 and float16 inputs: computed in float32, the output in their dtype
    for dt in (torch.bfloat16, torch.float16):
        xb = x1.to(dt).requires_grad_()
        yb = m(xb)
        assert yb.dtype == dt
        close(yb, xb.double() @ m.state_dict()["weight"].double().T + m.state_dict()["bias"].double(),
              f"{dt} y", 1e-2)
        yb.float().sum().backward()
        assert xb.grad.dtype == dt
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_autograd_semantics(world):
    assert run(_semantics_case, world) == [True] * world


def _replay_case(comm):
    """Two forwards of each module before the backwards: every gradient is that of its own
    forward (the layer replays the first forward before its backward)."""
    g = gen(5100)
    mlp = tt.ParallelMLP(H, FFN, comm, activation="silu", seed=4)
    emb = tt.VocabParallelEmbedding(V, DIM, comm, seed=5)
    P = {k: v.clone() for k, v in mlp.state_dict().items()}
    table = emb.state_dict()["weight"]
    x1, x2, dy = randn(g, 3, H), randn(g, 3, H), randn(g, 3, H)
    t1, t2 = torch.tensor([1, 16, 3]), torch.tensor([2, 2, 9])
    d1, d2 = randn(g, 3, DIM), randn(g, 3, DIM)
    ya, yb = mlp(x1.clone().requires_grad_()), mlp(x2.clone().requires_grad_())
    ea, eb = emb(t1), emb(t2)
    ya.backward(dy)
    ea.backward(d1)
    P64 = {k: v.double().requires_grad_() for k, v in P.items()}
    _mlp_ref("silu", P64, x1.double()).backward(dy.double())
    off, loc = mlp.layer.fc1.partition[comm.rank]
    close(mlp.fc1.weight.grad, P64["fc1.weight"].grad[off:off + loc], "mlp first dW")
    t64 = table.double().requires_grad_()
    F.embedding(t1, t64).backward(d1.double())
    eo, el = emb.partition[comm.rank]
    close(emb.weight.grad, t64.grad[eo:eo + el], "embedding first dW")
    yb.backward(dy)
    eb.backward(d2)
    F.embedding(t2, t64).backward(d2.double())
    close(emb.weight.grad, t64.grad[eo:eo + el], "embedding accumulated dW")

    # one module applied twice in a graph (shared weights): mlp(mlp(x))
    mlp.zero_grad()
    xin = x1.clone().requires_grad_()
    y = mlp(mlp(xin))
    y.backward(dy)
    P64 = {k: v.double().requires_grad_() for k, v in P.items()}
    x64 = x1.double().requires_grad_()
    want = _mlp_ref("silu", P64, _mlp_ref("silu", P64, x64))
    want.backward(dy.double())
    close(y, want, "mlp(mlp(x))")
    close(xin.grad, x64.grad, "mlp(mlp(x)): dx")
    close(mlp.fc1.weight.grad, P64["fc1.weight"].grad[off:off + loc], "mlp(mlp(x)): fc1 dW")
    close(mlp.fc2.bias.grad, P64["fc2.bias"].grad, "mlp(mlp(x)): fc2 db")
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_two_forwards_before_backward(world):
    assert run(_replay_case, world) == [True] * world


def _double_backward_case(comm):
    """create_graph=True through a C layer is refused by name, on every rank alike (the check
    comes before any collective), and the module stays usable afterwards."""
    g = gen(5200)
    mlp = tt.ParallelMLP(H, FFN, comm, seed=4)
    x = randn(g, 3, H).requires_grad_()
    with pytest.raises(RuntimeError, match=r"tpcore.torch.ParallelMLP: double backward \(create_graph=True"):
        torch.autograd.grad((mlp(x) ** 2).sum(), x, create_graph=True)
    # a constant upstream gradient too (once_differentiable would let this one through silently)
    logits = randn(g, 3, 4).requires_grad_()
    with pytest.raises(RuntimeError, match="VocabParallelCrossEntropy: double backward"):
        torch.autograd.grad(tt.vocab_parallel_cross_entropy(logits, torch.tensor([0, 1, 2]), comm), logits,
                            create_graph=True)
    P = {k: v.double() for k, v in mlp.state_dict().items()}
    x64 = x.detach().double().requires_grad_()
    _mlp_ref("gelu", P, x64).backward(torch.ones(3, H, dtype=torch.float64))
    mlp(x).backward(torch.ones(3, H))
    close(x.grad, x64.grad, "dx after a refused double backward")
    return True


def test_double_backward_refused():
    assert run(_double_backward_case, 2) == [True, True]


def _jit_case(comm):
    """torch.jit.trace records each C call (a traced direct result would be a constant: the
    same output for every input), with or without gradients; torch.jit.script is refused."""
    g = gen(5300)
    col, row = tt.ColumnParallelLinear(IN, OUT, comm, seed=1), tt.RowParallelLinear(OUT, 5, comm, seed=2)
    model = torch.nn.Sequential(col, torch.nn.GELU(), row)
    P = {k: v.double() for k, v in model.state_dict().items()}

    def ref(x):
        return F.linear(F.gelu(F.linear(x.double(), P["0.weight"], P["0.bias"])), P["2.weight"], P["2.bias"])
    for frozen in (False, True):
        model.requires_grad_(not frozen)
        traced = torch.jit.trace(model, randn(g, 2, IN))
        x = randn(g, 4, IN).requires_grad_()
        y = traced(x)
        close(y, ref(x), f"traced (frozen={frozen})")
        y.sum().backward()
        x64 = x.detach().double().requires_grad_()
        ref(x64).sum().backward()
        close(x.grad, x64.grad, f"traced dx (frozen={frozen})")
        with torch.no_grad():
            x2 = randn(g, 3, IN)
            close(traced(x2), ref(x2), f"traced under no_grad (frozen={frozen})")
    with pytest.raises(TypeError, match="ColumnParallelLinear: torch.jit.script cannot compile"):
        torch.jit.script(model)
    return True


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_torch_jit_trace_records_the_calls_and_script_is_refused():
    assert run(_jit_case, 2) == [True, True]


# ------------------------------------------------------------------ zero copy
def _zero_copy_case(comm):
    m = tt.ColumnParallelLinear(IN, OUT, comm)
    # parameters are the C layer's buffers; an optimizer step lands in C memory
    assert m.weight.data_ptr() == m.layer.weight.ctypes.data
    assert m.bias.data_ptr() == m.layer.bias.ctypes.data
    seen = {}
    forward, backward = m.layer.forward, m.layer.backward

    def spy_f(x):
        seen["x"] = x
        seen["y"] = forward(x)
        return seen["y"]

    def spy_b(dy):
        seen["dy"] = dy
        seen["dx"] = backward(dy)
        return seen["dx"]
    m.layer.forward, m.layer.backward = spy_f, spy_b
    x = randn(gen(1), 3, IN).requires_grad_()
    y = m(x)
    assert seen["x"].ctypes.data == x.data_ptr()      # torch -> C: the tensor's own memory
    assert y.data_ptr() == seen["y"].ctypes.data       # C -> torch: the C result's memory
    dy = torch.ones_like(y)
    y.backward(dy)
    assert seen["dy"].ctypes.data == dy.data_ptr()
    assert x.grad.data_ptr() == seen["dx"].ctypes.data
    before = m.layer.weight.copy()
    torch.optim.SGD(m.parameters(), lr=0.5).step()
    np.testing.assert_allclose(m.layer.weight, before - 0.5 * m.weight.grad.numpy(), rtol=1e-6, atol=1e-7)
    assert m.weight.data_ptr() == m.layer.weight.ctypes.data
    blk = tt.TransformerBlock(tpcore.Config(**CONFIGS["gpt"]), comm)
    for name, p in blk.named_parameters():
        assert p.data_ptr() == blk.layer.named_parameters()[name][0].ctypes.data, name
    return True


def test_zero_copy_parameters_and_activations():
    assert run(_zero_copy_case, 2) == [True, True]


# ------------------------------------------------------------------ training at world 2
class PlainModel(torch.nn.Module):
    """The single-process torch model: embedding -> block -> LM head -> cross-entropy."""

    def __init__(self, cfg, sd):
        super().__init__()
        self.cfg, self.names = cfg, list(sd)
        self.P = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(v.clone()) for k, v in sd.items()})

    def forward(self, tokens, targets):
        P = {k: self.P[k.replace(".", "_")] for k in self.names}
        block = {k[len("block."):]: v for k, v in P.items() if k.startswith("block.")}
        h = ref_block(self.cfg, block, F.embedding(tokens, P["emb.weight"]))
        logits = F.linear(h, P["head.weight"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TPModel(torch.nn.Module):
    def __init__(self, cfg, comm):
        super().__init__()
        self.comm = comm
        self.emb = tt.VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, comm, seed=1)
        self.block = tt.TransformerBlock(cfg, comm, seed=2)
        self.head = tt.ColumnParallelLinear(cfg.hidden, cfg.vocab_size, comm, bias=False, seed=3)
        self.xent = tt.VocabParallelCrossEntropy(comm)

    def forward(self, tokens, targets):
        return self.xent(self.head(self.block(self.emb(tokens))), targets)


def _train_case(comm, opt_name, name):
    cfg = tpcore.Config(**CONFIGS[name])
    tp = TPModel(cfg, comm)
    sd = tp.state_dict()  # full tensors: the plain model starts from the same weights
    plain = PlainModel(cfg, sd)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}[opt_name]
    opt_tp, opt_plain = make(tp.parameters()), make(plain.parameters())
    g = gen(6000)  # the same batches on both ranks (data parallel would differ; tensor parallel does not)
    for step in range(4):
        tokens = torch.randint(0, V, (2, 5), generator=g)
        targets = torch.randint(0, V, (2, 5), generator=g)
        opt_tp.zero_grad()
        opt_plain.zero_grad()
        loss_tp = tp(tokens, targets)
        loss_plain = plain(tokens, targets)
        close(loss_tp, loss_plain, f"step {step}: loss", 1e-5)
        loss_tp.backward()
        loss_plain.backward()
        opt_tp.step()
        opt_plain.step()
        now = tp.state_dict()
        for k in sd:
            close(now[k], plain.P[k.replace(".", "_")], f"step {step}: {k}", 1e-4)
    assert not torch.equal(now["head.weight"], sd["head.weight"])  # it did train
    return float(loss_tp)


# Adam's update normalises the gradient: a gradient that is zero in exact arithmetic (the key
# bias: softmax is invariant to it) is rounding noise, turned into steps of size lr that differ
# between any two float32 implementations; the Adam case uses the bias-free Llama block.
@pytest.mark.parametrize("opt_name,name", [("sgd", "gpt"), ("adamw", "llama")])
def test_training_matches_plain_torch_step_for_step(opt_name, name):
    losses = run(_train_case, 2, opt_name, name)
    assert losses[0] == losses[1]


# ------------------------------------------------------------------ state dicts
def _build(comm, seed):
    cfg = tpcore.Config(**CONFIGS["llama"])
    return torch.nn.ModuleDict({
        "col": tt.ColumnParallelLinear(IN, OUT, comm, gated=True, seed=seed),
        "row": tt.RowParallelLinear(OUT, IN, comm, input_is_parallel=False, seed=seed),
        "mlp": tt.ParallelMLP(H, FFN, comm, activation="swiglu", seed=seed),
        "emb": tt.VocabParallelEmbedding(V, DIM, comm, seed=seed),
        "block": tt.TransformerBlock(cfg, comm, seed=seed),
        "norm": torch.nn.LayerNorm(3),  # a plain module in the same model
    })


def _outputs(model):
    g = gen(7000)
    with torch.no_grad():
        return {"col": model["col"](randn(g, 2, IN)), "row": model["row"](randn(g, 2, OUT)),
                "mlp": model["mlp"](randn(g, 2, H)), "emb": model["emb"](torch.tensor([0, 16, 7])),
                "block": model["block"](randn(g, 1, 4, 12))}


def _gated_output(comm, model):
    """The gated column layer's full output in [gates | ups] order (each rank outputs its
    [gate_r | up_r] columns): comparable across world sizes."""
    part = model["col"].partition
    y = comm.all_gather(_outputs(model)["col"].numpy(), axis=-1, sizes=[2 * s for _, s in part])
    gates, ups, o = [], [], 0
    for _, s in part:
        gates.append(y[..., o:o + s])
        ups.append(y[..., o + s:o + 2 * s])
        o += 2 * s
    return np.concatenate(gates + ups, -1)


def _save_case(comm):
    model = _build(comm, 11)
    with torch.no_grad():
        model["norm"].weight.uniform_(generator=gen(1))
    sd = model.state_dict()
    out = _outputs(model)
    return {k: v.clone() for k, v in sd.items()}, {k: v for k, v in out.items() if k != "col"}, \
        _gated_output(comm, model)


def _load_case(comm, sd, want, want_col):
    model = _build(comm, 99)  # other weights: everything must come from sd
    assert not torch.equal(model.state_dict()["emb.weight"], sd["emb.weight"])
    model.load_state_dict(sd)
    out = _outputs(model)
    for k, v in want.items():
        close(out[k], v, f"{k} after loading at world {comm.size}", 1e-6)
    np.testing.assert_allclose(_gated_output(comm, model), want_col, rtol=1e-6, atol=1e-6)
    again = model.state_dict()
    assert sorted(again) == sorted(sd)
    for k in sd:
        assert torch.equal(again[k], sd[k]), k
    return True


def test_full_state_dict_reshards_across_world_sizes():
    saved = run(_save_case, 2)
    sd, want, want_col = saved[0]
    assert all(torch.equal(sd[k], saved[1][0][k]) for k in sd)  # every rank gets the full tensors
    assert sd["col.weight"].shape == (2 * OUT, IN) and sd["mlp.fc1.weight"].shape == (2 * FFN, H)
    assert "block.attn.q.weight" in sd and "block.attn.qkv.weight" not in sd
    assert sd["norm.weight"].shape == (3,)
    for world in (3, 1):
        assert run(_load_case, world, sd, want, want_col) == [True] * world


def test_full_state_dict_from_plain_torch_modules():
    def case(comm):
        torch.manual_seed(0)  # the same plain modules on every rank
        lin = torch.nn.Linear(IN, OUT)
        emb = torch.nn.Embedding(V, DIM)
        m = tt.RowParallelLinear(IN, OUT, comm, input_is_parallel=False)
        e = tt.VocabParallelEmbedding(V, DIM, comm)
        m.load_state_dict(lin.state_dict())
        e.load_state_dict(emb.state_dict())
        x, t = torch.randn(3, IN), torch.tensor([[4, 0, 16]])
        with torch.no_grad():
            close(m(x), lin(x), "row vs nn.Linear", 1e-6)
            close(e(t), emb(t), "embedding vs nn.Embedding", 0)
        return True
    assert run(case, 3) == [True] * 3


def _sharded_case(comm):
    n, r = comm.size, comm.rank
    model = _build(comm, 5)
    sd = tt.sharded_state_dict(model)
    assert sd["col._tp_shard"].tolist()[:3] == [1, n, r]
    assert sd["col.weight"].shape == model["col"].weight.shape  # only this rank's shard
    assert sd["block.attn.qkv.weight"].shape == model["block"].attn.qkv.weight.shape
    out = _outputs(model)
    other = _build(comm, 6)
    tt.load_sharded_state_dict(other, sd)
    for k, v in _outputs(other).items():
        assert torch.equal(v, out[k]), k
    # another rank's shard: refused, naming both layouts
    peer = {k: v.clone() for k, v in sd.items()}
    peer["col._tp_shard"][2] = (r + 1) % n
    with pytest.raises(RuntimeError, match=rf"col._tp_shard: the shard was saved with .*rank {(r + 1) % n}, .* but "
                                           rf".*rank {r}, .*same world size, rank and partition"):
        tt.load_sharded_state_dict(other, peer)
    # the same world size and rank but another partition
    col = {k[len("col."):]: v for k, v in sd.items() if k.startswith("col.")}
    moved = tt.ColumnParallelLinear(IN, OUT, comm, gated=True, partition=uneven(OUT, n))
    if moved.partition != model["col"].partition:
        sizes = ", ".join(str(sz) for _, sz in moved.partition)
        with pytest.raises(RuntimeError, match=rf"partition \[5, 5\] but .* partition \[{sizes}\]"):
            tt.load_sharded_state_dict(moved, col)
    # a shard without its metadata, and a sharded dict handed to load_state_dict
    bad = {k: v for k, v in sd.items() if k != "mlp._tp_shard"}
    with pytest.raises(RuntimeError, match="mlp._tp_shard is missing"):
        tt.load_sharded_state_dict(other, bad)
    with pytest.raises(RuntimeError, match="load it with tpcore.torch.load_sharded_state_dict"):
        other.load_state_dict(sd)
    return {k: v.clone() for k, v in sd.items()}


def test_sharded_state_dict():
    sd0 = run(_sharded_case, 2)[0]

    def wrong_world(comm):
        model = _build(comm, 7)
        with pytest.raises(RuntimeError, match=r"world size 2, rank 0.*world size 3"):
            tt.load_sharded_state_dict(model, sd0)
        return True
    assert run(wrong_world, 3) == [True] * 3


def _errors_case(comm):
    m = tt.ColumnParallelLinear(IN, OUT, comm)
    x = torch.randn(2, IN)
    with pytest.raises(TypeError, match=r"ColumnParallelLinear: x is on meta:0 but the module is on the CPU"):
        m(torch.empty(2, IN, device="meta"))
    with pytest.raises(TypeError, match=r"x has dtype torch.float64; expected torch.float32"):
        m(x.double())
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        m(x.numpy())
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 13\)"):
        m(torch.randn(2, IN + 1))
    with pytest.raises(TypeError, match="cannot be moved or converted"):
        m.double()
    with pytest.raises(TypeError, match="cannot be moved or converted"):
        m.to(torch.bfloat16)
    assert m.to("cpu") is m and m.weight.data_ptr() == m.layer.weight.ctypes.data
    # share_memory_ works in place (same tensor, new storage): refused before it moves anything
    for owner in (m, torch.nn.Sequential(m)):
        with pytest.raises(TypeError, match="cannot be moved or converted"):
            owner.share_memory()
        assert m.weight.data_ptr() == m.layer.weight.ctypes.data
    with pytest.raises(TypeError, match="comm must be a tpcore.Comm"):
        tt.ParallelMLP(4, 4, object())
    with pytest.raises(ValueError, match="activation"):
        tt.ParallelMLP(4, 4, comm, activation="tanh")
    e = tt.VocabParallelEmbedding(V, DIM, comm)
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        e(torch.zeros(3))
    with pytest.raises(ValueError, match="out of range|outside"):
        e(torch.tensor([V]))
    with pytest.raises(TypeError, match="logits_shard must be float32"):
        tt.vocab_parallel_cross_entropy(torch.zeros(2, 3, dtype=torch.float64), torch.tensor([0, 1]), comm)
    with pytest.raises(ValueError, match="reduction"):
        tt.VocabParallelCrossEntropy(comm, reduction="avg")
    # state dicts: wrong shapes, missing and unexpected keys
    sd = m.state_dict()
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: .*shape \(10, 12\).*full \(unsharded\) "
                                           r"shape .* is \(10, 13\)"):
        m.load_state_dict({"weight": torch.zeros(OUT, IN - 1), "bias": sd["bias"]})
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "bias"'):
        m.load_state_dict({"weight": sd["weight"]})
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        m.load_state_dict(dict(sd, extra=torch.zeros(1)))
    with pytest.raises(RuntimeError, match="must be a floating-point tensor"):
        m.load_state_dict({"weight": torch.zeros(OUT, IN, dtype=torch.int64), "bias": sd["bias"]})
    # strict=False: what is given is loaded, the rest kept
    W = torch.randn(OUT, IN)
    m.load_state_dict({"weight": W}, strict=False)
    now = m.state_dict()
    assert torch.equal(now["weight"], W) and torch.equal(now["bias"], sd["bias"])
    # pickling and copying: refused by name (a shallow copy would share the C layer but not the
    # forward counter, so the replay before backward would be skipped: wrong gradients)
    for how, what in ((copy.copy, m), (copy.deepcopy, torch.nn.Sequential(m)), (pickle.dumps, torch.nn.Sequential(m))):
        with pytest.raises(TypeError, match="ColumnParallelLinear cannot be pickled or copied.*state_dict"):
            how(what)
    # a parameter parted from the C memory (its .data replaced, or another Parameter assigned)
    # would train a copy the C layer never sees: the next forward says so
    mlp = tt.ParallelMLP(4, 5, comm)
    torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(mlp.parameters()) + 1, mlp.parameters())
    with pytest.raises(RuntimeError, match=r"ParallelMLP: parameter fc\d\.\w+ no longer views the C layer's memory"):
        mlp(torch.randn(2, 4))
    m.weight = torch.nn.Parameter(W.clone())  # e.g. tying the weight to another module's
    with pytest.raises(RuntimeError, match="parameter weight no longer views the C layer's memory"):
        m(x)
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_errors(world):
    assert run(_errors_case, world) == [True] * world


def test_import_tpcore_does_not_import_torch_and_missing_torch_is_explained():
    code = ("import sys; import tpcore; assert 'torch' not in sys.modules, 'tpcore imported torch'\n"
            "sys.modules['torch'] = None  # as if torch were not installed\n"
            "try:\n    import tpcore.torch\nexcept ImportError as e:\n    print(e)\nelse:\n    print('imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tpcore.torch needs PyTorch, an optional dependency" in out.stdout
    assert "pip install 'torch>=2.1'" in out.stdout


def _bf16_params_case(comm):
    r = comm.rank
    g = gen(8000)
    m = tt.ColumnParallelLinear(IN, OUT, comm, dtype="bfloat16", seed=2)
    mlp = tt.ParallelMLP(H, FFN, comm, activation="gelu_tanh", dtype="bfloat16", seed=3)
    assert m.weight.dtype == torch.bfloat16 and m.bias.dtype == torch.float32  # 16-bit weights, float32 biases
    assert m.weight.data_ptr() == m.layer.weight.ctypes.data
    sd = m.state_dict()
    assert sd["weight"].dtype == torch.bfloat16
    W, b = sd["weight"].double(), sd["bias"].double()
    off, loc = m.partition[r]
    x, dy = randn(g, 4, IN).requires_grad_(), randn(g, 4, loc)
    y = m(x)
    want = x.detach().double() @ W.T + b
    close(y, want[:, off:off + loc], "bf16-weight y", 1e-5)  # float32 arithmetic on the bf16 weights
    y.backward(dy)
    dy_full = torch.from_numpy(comm.all_gather(dy.numpy(), axis=1, sizes=[s for _, s in m.partition]))
    assert m.weight.grad.dtype == torch.bfloat16  # as a bf16 nn.Linear's
    close(m.weight.grad, (dy.double().T @ x.detach().double()), "bf16-weight dW", 1e-2)
    close(x.grad, dy_full.double() @ W, "bf16-weight dx", 1e-5)
    torch.optim.SGD(m.parameters(), lr=0.5).step()  # a bf16 step lands in the C weight
    assert m.weight.data_ptr() == m.layer.weight.ctypes.data
    after = m.state_dict()["weight"]
    assert not torch.equal(after, sd["weight"])
    close(after, sd["weight"].double() - 0.5 * _gather_rows(comm, m.weight.grad, m.partition), "bf16 step", 1e-2)
    # full state dicts of 16-bit weights round trip bit for bit
    mlp2 = tt.ParallelMLP(H, FFN, comm, activation="gelu_tanh", dtype="bfloat16", seed=9)
    msd = mlp.state_dict()
    mlp2.load_state_dict(msd)
    assert all(torch.equal(v, msd[k]) for k, v in mlp2.state_dict().items())
    xm = randn(g, 2, H)
    with torch.no_grad():
        assert torch.equal(mlp(xm), mlp2(xm))
    return True


def _gather_rows(comm, t, part):
    return torch.from_numpy(comm.all_gather(t.float().numpy(), sizes=[s for _, s in part])).double()


def test_bfloat16_parameters():
    pytest.importorskip("ml_dtypes")  # tpcore's NumPy views of 16-bit weights
    assert run(_bf16_params_case, 2) == [True, True]


def test_docs_training_loop_runs(tmp_path):
    """The tpcore.torch page's example (docs/torch.md), run as it is (fewer steps, the checkpoint in tmp_path)."""
    import os
    page = open(paths.ROOT / "docs" / "torch.md").read()
    i = page.index("# PyTorch modules: tpcore.torch")
    j = page.index("```python\n", i) + len("```python\n")
    code = page[j:page.index("```", j)]
    assert "tpcore.spawn(train, 2)" in code and "range(10)" in code
    code = code.replace("range(10)", "range(2)").replace('"tiny.pt"', repr(str(tmp_path / "tiny.pt")))
    code = code.replace("tpcore.spawn(train, 2)", "tpcore.spawn(train, 2, deadline=120)")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(tpcore.__file__), ".."),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    sd = torch.load(tmp_path / "tiny.pt")
    assert sd["head.weight"].shape == (1000, 64) and sd["emb.weight"].shape == (1000, 64)
