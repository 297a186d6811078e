"""The Python boundary of every layer, block and model at the edges of its sizes and
positions.

First, one case for each edge that once broke (a KV cache whose size wrapped to 0,
pos0 + T wrapping past the cache, a message read from a freed linear layer, NULL
given to memcpy for an empty batch) and for the argument messages.

Then hypothesis properties, run inside every rank of world 1 and 2: sizes drawn at
and around 0, 1, 2**31, 2**32, 2**63, negative ones and non-integers; positions at
the ends of the KV cache.  Every call either gives the float64 NumPy reference's
result (small valid sizes: values, and gradients through directional derivatives)
or raises ValueError / TypeError / MemoryError whose message names the argument;
nothing crashes.  Valid sizes too large to build here (gigabytes) are skipped.
Both ranks draw the same examples (derandomized, no shrinking), so the collective
calls of a world-2 example match.

CI runs this file again under the ASan + UBSan build of the extension:
    TPCORE_SANITIZE=address,undefined python setup.py build_ext --inplace --force
    ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \\
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \\
    python -m pytest -q tests/nn/test_boundaries.py
TPCORE_BOUNDARY_EXAMPLES=N multiplies the number of examples (default 1)."""
import math
import os
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import tpcore
import reference_transformer as ref
from conftest import run

INT_MAX = 2**31 - 1
I64 = 2**63 - 1
MAX_NUMEL = 2**40                      # the C core's largest buffer, in elements
SMALL = 1 << 14                        # what the properties build and check (elements)
EDGES = [0, 1, 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32, 2**32 + 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64,
         -1, -2, -2**31, -2**63, -2**63 - 1]
NOT_INTS = [2.0, "3", None, True]
ACTS = ["gelu_tanh", "silu", "relu", "swiglu"]
SCALE = int(os.environ.get("TPCORE_BOUNDARY_EXAMPLES", "1"))


def mostly(valid, edges):
    """valid three times in four, else one of edges."""
    return st.one_of(valid, valid, valid, st.sampled_from(edges))


def sizes(lo=1, hi=5):
    """A small valid size, or an edge value or a non-integer one time in four."""
    return mostly(st.integers(lo, hi), EDGES + NOT_INTS)


SEEDS = mostly(st.integers(0, 50), [0, 1, 2**63, 2**64 - 1, 2**64, -1, -2**63, 2**70, 1.5, "0"])


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def in_range(v, lo, hi):
    return is_int(v) and lo <= v <= hi


def seed_ok(s):
    return is_int(s) and 0 <= s < 2**64


def attempt(call, error, words):
    """call()'s value when error is False; when True, call() must raise ValueError, TypeError
    or MemoryError whose message contains one of words (then None).  Any other exception
    (OverflowError, SystemError, IndexError, ...) fails the property."""
    try:
        value = call()
    except (ValueError, TypeError, MemoryError) as e:
        assert error, f"unexpected {type(e).__name__}: {e}"
        assert any(w in str(e) for w in words), f"{type(e).__name__}({e}) names none of {words}"
        return None
    assert not error, f"no error; expected one naming one of {words}"
    return value


def close(got, want, what, rtol=1e-4, atol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True), \
        f"{what}: off by {np.nanmax(np.abs(got - want)) if got.size else 0:.3g}"


def directional(f, x, dx, R, g, what, eps=1e-6):
    """dx (the layer's input gradient of sum(f(x) * R)) against a finite difference of the
    float64 reference f along a random direction."""
    if not x.size:
        assert dx.shape == x.shape, f"{what}: shape {dx.shape}, expected {x.shape}"
        return
    V = g.standard_normal(x.shape)
    x64 = x.astype(np.float64)
    fd = ((f(x64 + eps * V) * R).sum() - (f(x64 - eps * V) * R).sum()) / (2 * eps)
    an = float((dx.astype(np.float64) * V).sum())
    assert abs(fd - an) <= 1e-4 * (1 + abs(fd)), f"{what}: directional {an:.6g} vs finite difference {fd:.6g}"


def ceil_div(a, b):
    return -(-a // b)


# ------------------------------------------------------------------ sizes, positions and seeds at the C boundary


def _boundary_cases(comm):
    """Each case: (call, exception type, words its message must hold)."""
    cfg = tpcore.Config(vocab_size=16, hidden=8, layers=1, heads=2 * comm.size, head_dim=2, ffn_hidden=12,
                        positions="rope", max_positions=32)
    blk = tpcore.TransformerBlock(cfg, comm, seed=1)
    model = tpcore.models.TransformerLM(cfg, comm, seed=2)
    x1 = np.ones((1, 1, 8), np.float32)

    def cached(pos0, T=1, via_c=False):
        x = np.ones((1, T, 8), np.float32)
        if via_c:  # the C check alone, without the Python layer's
            return blk._c.forward(x.reshape(T, 8), 1, T, pos0=np.array([pos0], np.int64), use_cache=True)
        return blk(x, pos0=[pos0], use_cache=True, need_backward=False)

    cases = [
        # batch * max_len must not wrap to 0 (a cached forward would write past an empty cache)
        (lambda: blk.cache(2**58, 64), ValueError, ["batch", "288230376151711744"]),
        (lambda: blk.cache(2**40, 2**40), ValueError, ["batch", "1099511627776"]),
        (lambda: blk.cache(1, 2**40), ValueError, ["max_len", "1099511627776"]),
        (lambda: blk.cache(INT_MAX, INT_MAX), ValueError, ["too large", "2147483647"]),
        (lambda: model.cache(2**58, 64), ValueError, ["batch"]),
        (lambda: blk(x1, pos0=[0], use_cache=True, need_backward=False), ValueError, ["cache"]),
        # pos0 + T must not overflow past the bounds check
        (lambda: blk.cache(1, 8), None, []),
        (lambda: cached(I64, T=2), ValueError, ["pos0", str(I64)]),
        (lambda: cached(I64 - 1, T=2, via_c=True), ValueError, ["pos0", str(I64 - 1)]),
        (lambda: cached(7, T=2, via_c=True), ValueError, ["pos0", "past the KV cache", "max_len 8"]),
        (lambda: model.cache(1, 8), None, []),
        (lambda: model.forward([[1, 2]], pos0=[I64 - 1], use_cache=True), ValueError, ["pos0"]),
        (lambda: model.forward([[1, 2]], pos0=[2**64]), ValueError, ["pos0"]),
        # a negative pos0 names pos0, not a position past the cache
        (lambda: cached(-5), ValueError, ["pos0 must be >= 0", "-5"]),
        (lambda: cached(-5, via_c=True), ValueError, ["pos0 must be >= 0", "-5"]),
        (lambda: model.forward([[1]], pos0=[-3], use_cache=True), ValueError, ["pos0 must be >= 0", "-3"]),
        (lambda: cached(1.5), TypeError, ["pos0", "integers"]),
        # the "shard too large" message outlives the freed layer (ASan: no use after free)
        (lambda: tpcore.ColumnParallelLinear(2**30, 2**30, comm), ValueError,
         ["too large", f"{2**30 // comm.size} x {2**30}"]),
        (lambda: tpcore.RowParallelLinear(2**30, 2**30, comm), ValueError, ["too large"]),
        # a width past the 32-bit GEMM dimensions names the argument, the range and the value
        (lambda: tpcore.ColumnParallelLinear(2**63, 4, comm), ValueError,
         ["in_features", "2147483647", "9223372036854775808"]),
        (lambda: tpcore.RowParallelLinear(4, 2**63, comm), ValueError, ["out_features", "9223372036854775808"]),
        (lambda: tpcore.ParallelMLP(8, 2**64, comm), ValueError, ["ffn_hidden", "18446744073709551616"]),
        (lambda: tpcore.VocabParallelEmbedding(2**63, 4, comm), ValueError, ["num_embeddings"]),
        (lambda: tpcore.ColumnParallelLinear(4.0, 4, comm), TypeError, ["in_features", "float"]),
        # seeds are integers in [0, 2**64) everywhere
        (lambda: tpcore.ColumnParallelLinear(4, 4, comm, seed=-1), ValueError, ["seed", "[0, 2**64)", "-1"]),
        (lambda: tpcore.RowParallelLinear(4, 4, comm, seed=2**64), ValueError, ["seed", str(2**64)]),
        (lambda: tpcore.ParallelMLP(4, 4, comm, seed=-1), ValueError, ["seed", "-1"]),
        (lambda: tpcore.VocabParallelEmbedding(4, 4, comm, seed=-7), ValueError, ["seed", "-7"]),
        (lambda: tpcore.TransformerBlock(cfg, comm, seed=-1), ValueError, ["seed", "-1"]),
        (lambda: tpcore.models.TransformerLM(cfg, comm, seed=-1), ValueError, ["seed", "[0, 2**64)", "-1"]),
        (lambda: tpcore.ColumnParallelLinear(4, 4, comm, seed=1.5), TypeError, ["seed", "float"]),
        (lambda: tpcore._C.ParallelLinear(comm._c, "column", 4, 4, True, False, True, None, -1, False), ValueError,
         ["seed", "-1"]),
        (lambda: tpcore.models.TransformerLM(cfg, comm, seed=2**64 - 1), None, []),  # derived seeds wrap
        # other integers at the C boundary: no OverflowError
        (lambda: tpcore.VocabParallelCrossEntropy(comm, ignore_index=2**63)(np.zeros((1, 2), np.float32), [0]),
         ValueError, ["ignore_index"]),
        (lambda: blk._c.forward(np.ones((2, 8), np.float32), 2**32, 2**32), ValueError, ["rows", "B * T"]),
        (lambda: blk._c.forward(np.ones((2, 8), np.float32), 2**64, 1), ValueError, ["B", str(2**64)]),
        (lambda: tpcore.ColumnParallelLinear(4, 4, comm, partition=[2**70] + [0] * (comm.size - 1)), ValueError,
         ["partition"]),
    ]
    problems = []
    for i, (call, etype, words) in enumerate(cases):
        try:
            call()
            if etype is not None:
                problems.append(f"case {i}: no error")
        except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
            if etype is None or type(e) is not etype:
                problems.append(f"case {i}: {type(e).__name__}: {e}")
            elif any(w not in str(e) for w in words):
                problems.append(f"case {i}: {type(e).__name__}({e}) lacks {[w for w in words if w not in str(e)]}")
    # empty batches (UBSan: no NULL to memcpy / memset): empty in, empty out, forward and backward
    blk.cache(2, 8)
    for B, T in ((0, 3), (2, 0), (0, 0)):
        y = blk(np.zeros((B, T, 8), np.float32), need_backward=True)
        dx = blk.backward(np.zeros((B, T, 8), np.float32))
        yc = blk(np.zeros((B, T, 8), np.float32), pos0=[0] * B, use_cache=True, need_backward=False)
        if y.shape != (B, T, 8) or dx.shape != (B, T, 8) or yc.shape != (B, T, 8):
            problems.append(f"empty batch {B} x {T}: shapes {y.shape}, {dx.shape}, {yc.shape}")
    if model.forward(np.zeros((0, 2), np.int64)).shape != (0, 2, 8):
        problems.append("empty model batch")
    for layer, width in ((tpcore.ColumnParallelLinear(8, 4, comm, gather_output=True), 8),
                         (tpcore.RowParallelLinear(8, 4, comm, input_is_parallel=False), 8),
                         (tpcore.ParallelMLP(8, 6, comm), 8)):
        out = layer(np.zeros((0, width), np.float32))
        back = layer.backward(np.zeros(out.shape, np.float32))
        if out.shape[0] != 0 or back.shape != (0, width):
            problems.append(f"empty {type(layer).__name__}: {out.shape}, {back.shape}")
    emb = tpcore.VocabParallelEmbedding(6, 3, comm)
    if emb([]).shape != (0, 3):
        problems.append("empty embedding lookup")
    emb.backward(np.zeros((0, 3), np.float32))
    xent = tpcore.VocabParallelCrossEntropy(comm)
    loss = xent(np.zeros((0, 2), np.float32), np.zeros(0, np.int64))
    if not math.isnan(loss) or xent.backward().shape != (0, 2):
        problems.append(f"empty cross-entropy: {loss}")
    comm.barrier()
    return problems


@pytest.mark.parametrize("world", [1, 2])
def test_sizes_positions_and_seeds_at_the_c_boundary(world):
    for r, problems in enumerate(run(_boundary_cases, world, timeout=60)):
        assert not problems, f"rank {r}: " + "; ".join(problems)


# ------------------------------------------------------------------ properties

PROPS = {}


def prop(examples_w1, examples_w2, setup=None, **strategies):
    """Register check(comm, state, **example) with the hypothesis strategies of its arguments;
    state = setup(comm) (built once per rank), examples per world size."""
    def deco(check):
        PROPS[check.__name__] = (check, setup, strategies, examples_w1, examples_w2)
        return check
    return deco


def _draw(name, n):
    """n examples of the property's arguments, drawn by hypothesis here, in the parent: every
    rank then runs the same examples in the same order, so the collectives of a world-2
    example match (hypothesis inside each rank could draw differently, e.g. after a rank
    imported a module that adds to hypothesis's pool of constants)."""
    _, _, strategies, _, _ = PROPS[name]
    out = []

    @settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(**strategies)
    def collect(**example):
        out.append(example)
    collect()
    return out


def _run_examples(comm, name, examples):
    check, setup, _, _, _ = PROPS[name]
    state = setup(comm) if setup else None
    for i, example in enumerate(examples):
        try:
            check(comm, state, **example)
        except Exception as e:  # the example in the message; spawn stops the other ranks at once
            raise AssertionError(f"{name} example {i} of {len(examples)}: {example!r}: {type(e).__name__}: {e}") from e
    comm.barrier()


@prop(60, 40, kind=st.sampled_from(["column", "row"]), fin=sizes(), fout=sizes(), seed=SEEDS, flag=st.booleans(),
      bias=st.booleans(), rows=st.integers(0, 3))
def linear(comm, _, kind, fin, fout, seed, flag, bias, rows):
    col = kind == "column"
    error = not (in_range(fin, 1, INT_MAX) and in_range(fout, 1, INT_MAX) and seed_ok(seed))
    if not error:
        local = ceil_div(fout if col else fin, comm.size)
        if (local * fin if col else fout * local) > MAX_NUMEL:
            error = True
        elif fin * fout > SMALL:
            return  # valid, but gigabytes
    cls = tpcore.ColumnParallelLinear if col else tpcore.RowParallelLinear
    kw = dict(gather_output=flag) if col else dict(input_is_parallel=flag)
    lin = attempt(lambda: cls(fin, fout, comm, bias=bias, seed=seed, **kw), error,
                  ["in_features", "out_features", "seed", "too large"])
    if lin is None:
        return
    W, b = lin.gather_full()
    g = np.random.default_rng([rows, fin, fout])  # the same on every rank
    x = g.standard_normal((rows, fin)).astype(np.float32)
    dy = g.standard_normal((rows, fout)).astype(np.float32)
    W64, x64, dy64 = W.astype(np.float64), x.astype(np.float64), dy.astype(np.float64)
    y_ref = x64 @ W64.T + (0 if b is None else b)
    dx_ref = dy64 @ W64
    lo, n = lin.offset, lin.local
    if col:
        y = lin(x)
        dx = lin.backward(dy if flag else np.ascontiguousarray(dy[:, lo:lo + n]))
        close(y, y_ref if flag else y_ref[:, lo:lo + n], "y")
        close(dx, dx_ref, "dx")  # every rank's dy_r W_r, all-reduced
        close(lin.grad_weight, dy64[:, lo:lo + n].T @ x64, "grad_weight")
    else:
        y = lin(np.ascontiguousarray(x[:, lo:lo + n]) if flag else x)
        dx = lin.backward(dy)
        close(y, y_ref, "y")
        close(dx, dx_ref[:, lo:lo + n] if flag else dx_ref, "dx")
        close(lin.grad_weight, dy64.T @ x64[:, lo:lo + n], "grad_weight")


@prop(60, 40, hidden=sizes(), ffn=sizes(), act=st.sampled_from(ACTS), seed=SEEDS, bias=st.booleans(),
      rows=st.integers(0, 3))
def mlp(comm, _, hidden, ffn, act, seed, bias, rows):
    gate = 2 if act == "swiglu" else 1
    error = not (in_range(hidden, 1, INT_MAX) and in_range(ffn, 1, INT_MAX) and seed_ok(seed))
    if not error:
        if gate * ffn > INT_MAX or gate * ceil_div(ffn, comm.size) * hidden > MAX_NUMEL:
            error = True
        elif gate * hidden * ffn > SMALL:
            return
    m = attempt(lambda: tpcore.ParallelMLP(hidden, ffn, comm, activation=act, bias=bias, seed=seed), error,
                ["hidden", "ffn_hidden", "out_features", "seed", "too large"])
    if m is None:
        return
    W1, b1 = (t if t is None else t.astype(np.float64) for t in m.fc1.gather_full())
    W2, b2 = (t if t is None else t.astype(np.float64) for t in m.fc2.gather_full())

    def f(x):
        return ref.act(act, x @ W1.T + (0 if b1 is None else b1)) @ W2.T + (0 if b2 is None else b2)
    g = np.random.default_rng([rows, hidden, ffn])
    x = g.standard_normal((rows, hidden)).astype(np.float32)
    R = g.standard_normal((rows, hidden))
    close(m(x), f(x.astype(np.float64)), "y")
    directional(f, x, m.backward(R.astype(np.float32)), R, g, "dx")


TOKEN = mostly(st.integers(0, 4), ["n-1", "n", -1, I64, -2**63, 2**63, 2**64, 1.5])


@prop(60, 40, n=sizes(), dim=sizes(), seed=SEEDS, toks=st.lists(TOKEN, max_size=4))
def embedding(comm, _, n, dim, seed, toks):
    error = not (in_range(n, 1, I64) and in_range(dim, 1, I64) and seed_ok(seed))
    if not error:
        if ceil_div(n, comm.size) * dim > MAX_NUMEL:
            error = True
        elif n * dim > SMALL:
            return
    emb = attempt(lambda: tpcore.VocabParallelEmbedding(n, dim, comm, seed=seed), error,
                  ["num_embeddings", "embedding_dim", "seed", "too large"])
    if emb is None:
        return
    toks = [n - 1 if t == "n-1" else n if t == "n" else t for t in toks]
    bad = [t for t in toks if not in_range(t, 0, n - 1)]
    table = emb.gather_full()
    y = attempt(lambda: emb(toks), bool(bad), ["token"])
    if y is None:
        return
    assert np.array_equal(y, table[np.array(toks, np.int64)].reshape(len(toks), dim)), "lookup"
    dy = np.random.default_rng(len(toks)).standard_normal((len(toks), dim)).astype(np.float32)
    emb.backward(dy)
    want = np.zeros((n, dim))
    np.add.at(want, np.array(toks, np.int64), dy.astype(np.float64))
    close(emb.grad_weight, want[emb.offset:emb.offset + emb.local], "grad_weight")


OFFSETS = [None, 0, 1, 5, 2**62, I64 - 3, I64, 2**63, -1, 2.0]
TARGET = mostly(st.integers(0, 9), ["ignore", -1, "total", I64, -2**63])


@prop(60, 40, M=st.integers(0, 4), widths=st.lists(mostly(st.integers(1, 3), [0]), min_size=2, max_size=2),
      offset=mostly(st.just(None), OFFSETS), ignore=mostly(st.just(-100), [-1, 0, I64, -2**63, 2**63, 1.5]),
      targets=st.lists(TARGET, min_size=4, max_size=4))
def cross_entropy(comm, _, M, widths, offset, ignore, targets):
    world, rank = comm.size, comm.rank
    widths = widths[:world]
    if world > 1:
        offset = None  # a given layout must tile the vocabulary over the ranks: test_vocab's business
    V = widths[rank]
    lo = offset if is_int(offset) and offset >= 0 else sum(widths[:rank])
    total = (lo + V) if world == 1 else sum(widths)
    x = attempt(lambda: tpcore.VocabParallelCrossEntropy(comm, ignore_index=ignore),
                not in_range(ignore, -2**63, I64), ["ignore_index"])
    if x is None:
        return
    base = lo if world == 1 else 0  # the logits of the whole vocabulary [base, total)
    ign = ignore if in_range(ignore, -2**63, I64) else 0  # (an ignore_index past int64 fails anyway)
    ts = [ign if t == "ignore" else total if t == "total" else
          (base + t % max(total - base, 1) if is_int(t) and 0 <= t < 10 else t) for t in targets[:M]]
    ts = [t if in_range(t, -2**63, I64) else I64 for t in ts]
    g = np.random.default_rng([M, total - base, 7])
    full = g.standard_normal((M, total - base)).astype(np.float32) * 3
    mine = np.ascontiguousarray(full[:, lo - base:lo - base + V])
    error, words = False, []
    if offset is not None and (not is_int(offset) or offset < 0 or (is_int(offset) and offset > I64 - V)
                               or (world == 1 and offset != 0)):  # one rank's shard is the whole vocabulary
        error, words = True, ["vocab_offset"]
    elif not in_range(ignore, -2**63, I64):
        error, words = True, ["ignore_index"]
    elif any(t != ign and not in_range(t, base, total - 1) for t in ts):
        error, words = True, ["target"]
    loss = attempt(lambda: x(mine, np.array(ts, np.int64) if ts else np.zeros(0, np.int64), vocab_offset=offset),
                   error, words + ["vocab_offset", "ignore_index", "target"])
    if loss is None:
        return
    keep = [m for m in range(M) if ts[m] != ign]  # (no row is kept when there are no logits)
    f64 = full.astype(np.float64)
    d = np.zeros_like(f64)
    want = float("nan")
    if keep:
        mx = f64.max(-1, keepdims=True)
        lse = np.log(np.exp(f64 - mx).sum(-1)) + mx[:, 0]
        want = np.mean([lse[m] - f64[m, ts[m] - base] for m in keep])
        for m in keep:
            d[m] = np.exp(f64[m] - lse[m])
            d[m, ts[m] - base] -= 1
    close(loss, want, "loss")
    d /= max(len(keep), 1)
    close(x.backward(), d[:, lo - base:lo - base + V], "dlogits")


@prop(25, 10, kind=st.sampled_from(["layernorm", "rmsnorm"]), M=st.integers(0, 3), C=st.integers(0, 5),
      wlen=mostly(st.none(), [0, 1, 7]))
def norms(comm, _, kind, M, C, wlen):
    g = np.random.default_rng([M, C])
    x = g.standard_normal((M, C)).astype(np.float32)
    w = (1 + 0.3 * g.standard_normal(C if wlen is None else wlen)).astype(np.float32)
    b = g.standard_normal(C).astype(np.float32) if kind == "layernorm" else None
    nm = types.SimpleNamespace(norm=kind, eps=1e-5)
    out = attempt(lambda: tpcore._C.norm_forward(kind, x, w, b, 1e-5), wlen not in (None, C), ["w"])
    if out is None:
        return
    y, mu, rs = out
    w64 = w.astype(np.float64)

    def f(xx):
        return ref.norm(nm, xx, w64, None if b is None else b.astype(np.float64))
    close(y, f(x.astype(np.float64)) if C else np.zeros((M, 0)), "y", atol=1e-4)
    R = g.standard_normal((M, C))
    dw, db = np.zeros(C, np.float32), None if b is None else np.zeros(C, np.float32)
    dx = tpcore._C.norm_backward(kind, R.astype(np.float32), x, w, mu, rs, dw, db)
    directional(f, x, dx, R, g, "dx")


DIMS = ["hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "seed"]


@prop(60, 40, which=st.sampled_from(DIMS), value=sizes(0, 4), seed=SEEDS)
def block_dims(comm, _, which, value, seed):
    d = dict(hidden=8, heads=2 * comm.size, kv_heads=comm.size, head_dim=2, ffn_hidden=6, seed=0)
    d[which] = seed if which == "seed" else value
    C, H, Hk, D, F = (d[k] for k in DIMS[:5])
    error = not (all(in_range(d[k], 0 if k == "kv_heads" else 1, INT_MAX) for k in DIMS[:5])
                 and seed_ok(d["seed"]))
    if not error:
        Hk = Hk or H
        qkv = (H + 2 * Hk) * D
        error = (max(C, H, Hk, D) > INT_MAX // 4 or qkv > INT_MAX // 4 or Hk > H or H % Hk
                 or qkv * C > MAX_NUMEL or ceil_div(F, comm.size) * C > MAX_NUMEL)
        if not error and (qkv + F) * C > SMALL:
            return
    blk = attempt(lambda: tpcore._C.TransformerBlock(comm._c, C, H, d["kv_heads"], D, F, seed=d["seed"]), error,
                  [which, "heads", "too large"])
    if blk is not None:
        y = blk.forward(np.ones((2, C), np.float32), 1, 2)
        assert y.shape == (2, C) and np.isfinite(y).all()


BLOCK = dict(vocab_size=8, hidden=8, heads=2, kv_heads=1, head_dim=4, ffn_hidden=12, rope_theta=100.0, layers=1,
             max_positions=12)
STYLES = {"rope": dict(positions="rope", norm="rmsnorm", activation="swiglu", bias=False),
          "none": dict(positions="none", norm="layernorm", activation="gelu_tanh", bias=True)}


def _blocks(comm):
    """A rope and a plain block with known full parameters, built once per rank."""
    out = {}
    for style, kw in STYLES.items():
        cfg = tpcore.Config(**BLOCK, **kw)
        blk = tpcore.TransformerBlock(cfg, comm, seed=3)
        g = np.random.default_rng(5)
        P = {k: (g.standard_normal(s) * 0.4 + (1 if k.startswith("norm") and k.endswith("weight") else 0))
             .astype(np.float32) for k, s in blk.full_shapes().items()}
        blk.load_full(P)
        out[style] = (cfg, blk, {k: v.astype(np.float64) for k, v in P.items()})
    return out


def position(p, max_len, T):
    return {"end": max_len - T, "past": max_len - T + 1, "len": max_len, "top": I64 - T, "over": I64 - T + 1}.get(p, p)


POS = st.one_of(st.integers(0, 3), st.just("end"), st.sampled_from(["end", "past", "len", "top", "over", -1, -2**63,
                                                                     2**63, 2**64, 1.5]))


def cache_error(batch, max_len, nkd):
    """(error, skip) of cache(batch, max_len) for a rank with nkd K/V values per token."""
    if not (in_range(batch, 1, INT_MAX) and in_range(max_len, 1, INT_MAX)):
        return True, False
    if batch * max_len * nkd > MAX_NUMEL:
        return True, False
    return False, batch * max_len > 4096  # valid; skipped when it would allocate a lot


@prop(120, 80, setup=_blocks, style=st.sampled_from(sorted(STYLES)), batch=sizes(1, 3), max_len=sizes(1, 6),
      B=st.integers(0, 2), T=st.integers(0, 4), p=POS)
def block_cache(comm, blocks, style, batch, max_len, B, T, p):
    cfg, blk, P = blocks[style]
    error, skip = cache_error(batch, max_len, blk.nk * cfg.head_dim)
    if skip:
        return
    if attempt(lambda: blk.cache(batch, max_len), error, ["batch", "max_len", "too large"]) is None and error:
        return
    p = position(p, max_len, T)
    g = np.random.default_rng([B, T, 11])
    x = g.standard_normal((B, T, cfg.hidden)).astype(np.float32)
    bad = B > 0 and (not is_int(p) or not 0 <= p <= max_len - T or B > batch)
    pre = p if (not bad and B and T and p) else 0
    xp = g.standard_normal((B, pre, cfg.hidden)).astype(np.float32)
    if pre:  # fill the cache's first positions, then run at the end of what is there
        blk(xp, use_cache=True, need_backward=False)
    y = attempt(lambda: blk(x, pos0=[p] * B, use_cache=True, need_backward=False), bad,
                ["pos0", "batch", "KV cache"])
    if y is None or not (B and T):
        assert y is None or y.shape == (B, T, cfg.hidden)
        return
    xa = np.concatenate([xp, x], 1).astype(np.float64)
    want = ref.block(cfg, P, xa, pos=np.broadcast_to(np.arange(pre + T), (B, pre + T)))[:, pre:]
    close(y, want, "y (cached)")


@prop(80, 50, setup=_blocks, style=st.sampled_from(sorted(STYLES)), B=st.integers(0, 2), T=st.integers(0, 4), p=POS,
      given_p=st.booleans(), cB=mostly(st.none(), [-1, 2**32, 2**63, 2**64, 1.5]),
      cT=mostly(st.none(), [-1, 0, 2**31, 2**63]))
def block_forward(comm, blocks, style, B, T, p, given_p, cB, cT):
    cfg, blk, P = blocks[style]
    g = np.random.default_rng([B, T, 13])
    x = g.standard_normal((B, T, cfg.hidden)).astype(np.float32)
    if cB is not None or cT is not None:  # the C boundary with B and T given apart from x's rows
        b2, t2 = (B if cB is None else cB), (T if cT is None else cT)
        ok = in_range(b2, 0, I64) and in_range(t2, 0, I64) and b2 * t2 == B * T
        attempt(lambda: blk._c.forward(x.reshape(B * T, cfg.hidden), b2, t2), not ok, ["B", "T", "rows"])
        return
    p = position(p, 0, T) if p in ("top", "over") else (p if not isinstance(p, str) else 3)
    pos0 = [p] * B if given_p else None
    bad = given_p and B > 0 and not in_range(p, 0, I64 - T)
    y = attempt(lambda: blk(x, pos0=pos0, need_backward=True), bad, ["pos0"])
    if y is None:
        return
    R = g.standard_normal(y.shape)
    dx = blk.backward(R.astype(np.float32))
    p0 = p if given_p else 0
    if not (B and T):
        assert y.shape == dx.shape == (B, T, cfg.hidden), (y.shape, dx.shape)
        return
    if style == "rope" and p0 > 10**4:  # float32 angles that far out: only finite
        assert np.isfinite(y).all() and np.isfinite(dx).all()
        return
    pos = np.broadcast_to(p0 + np.arange(T), (B, T))

    def f(xx):
        return ref.block(cfg, P, xx, pos=pos)
    close(y, f(x.astype(np.float64)), "y")
    directional(f, x, dx, R, g, "dx")


LM = {"learned": dict(vocab_size=11, hidden=8, layers=1, heads=2, ffn_hidden=12, positions="learned", max_positions=12,
                      norm="layernorm", activation="gelu_tanh", tie_embeddings=True),
      "rope": dict(vocab_size=11, hidden=8, layers=1, heads=2, kv_heads=1, ffn_hidden=12, positions="rope",
                   rope_theta=100.0, max_positions=12, norm="rmsnorm", activation="swiglu", bias=False,
                   tie_embeddings=False)}


def _ref_hidden(cfg, P, toks, pos):
    h = P["wte.weight"][toks]
    if cfg.positions == "learned":
        h = h + P["wpe.weight"][pos]
    for i in range(cfg.layers):
        h = ref.block(cfg, {k[len(f"blocks.{i}."):]: v for k, v in P.items() if k.startswith(f"blocks.{i}.")}, h,
                      pos=pos)
    return ref.norm(cfg, h, P["final_norm.weight"], P.get("final_norm.bias"))


def _ref_logits(cfg, P, toks):
    T = toks.shape[1]
    h = _ref_hidden(cfg, P, toks, np.broadcast_to(np.arange(T), toks.shape))
    return h[:, -1] @ (P["wte.weight"] if cfg.tie_embeddings else P["lm_head.weight"]).T


def _models(comm):
    """A learned-position and a rope model with their full tensors in float64, built once per rank."""
    models = {}
    for name, kw in LM.items():
        cfg = tpcore.Config(**kw)
        m = tpcore.models.TransformerLM(cfg, comm, seed=9)
        models[name] = (cfg, m, {k: np.asarray(v, np.float64) for k, v in m.state_dict_full().items()})
    return models


@prop(120, 80, setup=_models, name=st.sampled_from(sorted(LM)), op=st.sampled_from(["generate", "cached", "forward"]),
      lens=st.lists(mostly(st.integers(1, 3), [0]), min_size=1, max_size=2),
      new=mostly(st.integers(0, 3), [-1, 2**31 - 1, 2**31, 2**32, 2**63, 2**64]), batch=sizes(1, 3),
      max_len=sizes(1, 8), B=st.integers(0, 2), T=st.integers(0, 3), p=POS, bad_token=mostly(st.just(False), [True]))
def model(comm, models, name, op, lens, new, batch, max_len, B, T, p, bad_token):
    cfg, m, P = models[name]
    V, learned = cfg.vocab_size, cfg.positions == "learned"
    g = np.random.default_rng([len(lens), sum(lens), B, T])
    if op == "generate":
        prompts = [g.integers(0, V, n).tolist() for n in lens]
        total = max(lens) + new
        error = min(lens) == 0 or new < 0 or total > INT_MAX or (learned and total > cfg.max_positions)
        out = attempt(lambda: m.generate(prompts, max_new_tokens=new), error,
                      ["prompt", "max_new_tokens", "max_len", "KV cache", "max_positions"])
        if out is None:
            return
        for s, o in zip(prompts, out):
            o = np.asarray(o)
            assert o.shape == (len(s) + new,) and list(o[:len(s)]) == s, (s, o)
            for t in range(len(s), len(o)):  # each new token is the reference's argmax (up to rounding)
                lg = _ref_logits(cfg, P, o[None, :t])[0]
                assert lg[o[t]] >= lg.max() - 1e-4, f"token {t}: {o[t]} but the reference prefers {lg.argmax()}"
        return
    toks = g.integers(0, V, (B, T))
    if bad_token and toks.size:
        toks[-1, -1] = V
    bad_tok = bad_token and toks.size > 0
    if op == "forward":
        p = position(p, 0, T) if p in ("top", "over") else (p if not isinstance(p, str) else 2)
        bad = B > 0 and not in_range(p, 0, I64 - T)
        if not bad and B and T and learned and p + T > cfg.max_positions:
            bad = True
        h = attempt(lambda: m.forward(toks, pos0=[p] * B), bad or bad_tok,
                    ["pos0", "position", "token"])
        if h is None or not (B and T):
            assert h is None or h.shape == (B, T, cfg.hidden)
            return
        if not learned and p > 10**4:
            assert np.isfinite(h).all()
            return
        close(h, _ref_hidden(cfg, P, toks, np.broadcast_to(p + np.arange(T), (B, T))), "hidden")
        return
    error, skip = cache_error(batch, max_len, cfg.kv_heads * cfg.head_dim)  # an upper bound per rank
    if skip:
        return
    if attempt(lambda: m.cache(batch, max_len), error, ["batch", "max_len", "too large"]) is None and error:
        return
    p = position(p, max_len, T)
    bad = B > 0 and (not is_int(p) or not 0 <= p <= max_len - T or B > batch or
                     (learned and T > 0 and p + T > cfg.max_positions))
    pre = p if (not bad and not bad_tok and B and T and p) else 0
    tp = g.integers(0, V, (B, pre))
    if pre:
        m.forward(tp, use_cache=True)
    h = attempt(lambda: m.forward(toks, pos0=[p] * B, use_cache=True), bad or bad_tok,
                ["pos0", "position", "batch", "KV cache", "token"])
    if h is None or not (B and T):
        return
    ta = np.concatenate([tp, toks], 1)
    want = _ref_hidden(cfg, P, ta, np.broadcast_to(np.arange(pre + T), ta.shape))[:, pre:]
    close(h, want, "hidden (cached)")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", sorted(PROPS))
def test_boundary_property(name, world):
    _, _, _, n1, n2 = PROPS[name]
    run(_run_examples, world, name, _draw(name, (n1 if world == 1 else n2) * SCALE), timeout=60)
