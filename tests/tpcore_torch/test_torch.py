"""tpcore.torch: the nn.Modules over the C layers against single-process float64 torch
references written here (torch.nn.functional, autograd): forward, input gradients and
parameter gradients at world sizes 1-4 with odd and uneven sizes; two forwards before a
backward, retain_graph, no_grad, requires_grad=False, accumulation; torch.jit; zero-copy
crossings.  Training, state dicts and bad inputs: test_torch_training.py; the references:
torch_reference.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import tpcore  # noqa: E402  (after importorskip("torch"): the module skips without torch)
import tpcore.torch as tt  # noqa: E402  (after importorskip("torch"): the module skips without torch)
from conftest import WORLDS, run  # noqa: E402  (after importorskip("torch"): the module skips without torch)
from torch_reference import (  # noqa: E402  (after importorskip("torch"))
    ACTS, close, CONFIGS, DIM, FFN, gen, H, IN, mlp_ref, OUT, randn, random_full, ref_attention, ref_block, uneven, V,
)


# ------------------------------------------------------------------ linear layers


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
        mlp_ref(act, P64, x64).backward(dy.double())
        xin = x.clone().requires_grad_()
        y = m(xin)
        what = f"{act} rank {r}/{n}"
        close(y, mlp_ref(act, P64, x64), f"{what}: y")
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


def _block_case(comm, name):
    n, r = comm.size, comm.rank
    cfg = tpcore.Config(**CONFIGS[name])
    blk = tt.TransformerBlock(cfg, comm, ffn_partition=uneven(cfg.ffn_hidden, n) if n > 2 else None)
    g = gen(4000 + n)
    P = random_full(blk.layer, g)
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
    P = random_full(att.layer, g)
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
    mlp_ref("silu", P64, x1.double()).backward(dy.double())
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
    want = mlp_ref("silu", P64, mlp_ref("silu", P64, x64))
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
    mlp_ref("gelu", P, x64).backward(torch.ones(3, H, dtype=torch.float64))
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
