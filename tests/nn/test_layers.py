"""Column- and row-parallel linear layers against float64 NumPy references
written here: forward and backward (input gradient, weight and bias gradients)
at world sizes 1-4, even and uneven partitions, odd sizes, with and without
bias, gather_output and input_is_parallel both ways; seeded initialisation
identical at every world size; finite differences; bad inputs."""
import numpy as np
import pytest

import tpcore
from conftest import DLPackOnly, WORLDS, rng_for, run

IN, OUT, ROWS = 37, 53, 11


def _part(kind, world, uneven):
    dim = OUT if kind == "column" else IN
    if not uneven:
        return None
    # uneven and one rank may hold nothing: weights 1, 3, 0, 2, ...
    return tpcore.partition(dim, world, weights=[(1, 3, 0, 2)[r % 4] + (world == 1) for r in range(world)])


def _ref(kind, x, W, b, dy, flags, part, rank):
    """float64 reference: full forward/backward, then this rank's view of it."""
    x64, W64, dy64 = x.astype(np.float64), W.astype(np.float64), dy.astype(np.float64)
    y = x64 @ W64.T + (b if b is not None else 0)
    dx = dy64 @ W64
    dW = dy64.reshape(-1, W.shape[0]).T @ x64.reshape(-1, W.shape[1])
    db = dy64.reshape(-1, W.shape[0]).sum(0)
    off, loc = part[rank]
    if kind == "column":
        y_out = y if flags["gather_output"] else y[..., off:off + loc]
        return y_out, dx, dW[off:off + loc], (db[off:off + loc] if b is not None else None)
    dx_out = dx[..., off:off + loc] if flags["input_is_parallel"] else dx
    return y, dx_out, dW[:, off:off + loc], db if b is not None else None


def _layer_case(comm, kind, flags, uneven, use_bias, seed):
    n, r = comm.size, comm.rank
    part = _part(kind, n, uneven)
    cls = tpcore.ColumnParallelLinear if kind == "column" else tpcore.RowParallelLinear
    kw = {"gather_output": flags["gather_output"]} if kind == "column" else \
        {"input_is_parallel": flags["input_is_parallel"]}
    layer = cls(IN, OUT, comm, bias=use_bias, partition=part, seed=seed, **kw)
    g = rng_for(seed, 0)  # the same full tensors on every rank
    W = g.standard_normal((OUT, IN)).astype(np.float32)
    b = g.standard_normal(OUT).astype(np.float32) if use_bias else None
    x = g.standard_normal((2, ROWS, IN)).astype(np.float32)  # leading dims are kept
    dy_full = g.standard_normal((2, ROWS, OUT)).astype(np.float32)
    layer.load_full(W, b)
    asked = part
    part = [tuple(p) for p in layer.partition]
    if asked is not None:  # the layer really uses the partition it was given
        assert part == [tuple(p) for p in asked], (part, asked)
    off, loc = part[r]
    x_in = np.ascontiguousarray(x[..., off:off + loc]) if kind == "row" and flags["input_is_parallel"] else x
    y = layer(x_in)
    ry, rdx, rdW, rdb = _ref(kind, x, W, b, dy_full, flags, part, r)
    dy = np.ascontiguousarray(dy_full[..., off:off + loc]) if kind == "column" and not flags["gather_output"] \
        else dy_full
    layer.zero_grad()
    dx = layer.backward(dy)
    dx2 = layer.backward(dy)  # gradients accumulate
    bad = []

    def close(name, got, want, tol=2e-4):
        got = np.asarray(got, np.float64)
        if got.shape != np.shape(want) or not np.all(np.abs(got - want) <= tol * (1 + np.abs(want))):
            bad.append((name, got.shape, np.shape(want),
                        float(np.max(np.abs(got - want))) if got.shape == np.shape(want) else None))

    close("y", y, ry)
    close("dx", dx, rdx)
    close("dx again", dx2, rdx)
    close("grad_weight", layer.grad_weight, 2 * rdW)
    if use_bias:
        close("grad_bias", layer.grad_bias, 2 * rdb)
    # the full weights come back from the shards
    Wf, bf = layer.gather_full()
    close("gather_full W", Wf, W, 0)
    if use_bias:
        close("gather_full b", bf, b, 0)
    return bad


FLAGS = [{"gather_output": False, "input_is_parallel": True}, {"gather_output": True, "input_is_parallel": False}]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("flags", FLAGS, ids=["plain", "gather-or-full-input"])
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
def test_parallel_linear_matches_float64_reference(world, kind, flags, uneven, use_bias):
    for r, bad in enumerate(run(_layer_case, world, kind, flags, uneven, use_bias, 100 + world)):
        assert not bad, f"rank {r}: {bad}"


def _init_case(comm, kind, uneven):
    part = _part(kind, comm.size, uneven)
    cls = tpcore.ColumnParallelLinear if kind == "column" else tpcore.RowParallelLinear
    layer = cls(IN, OUT, comm, partition=part, seed=7)
    W, b = layer.gather_full()
    return W, b


@pytest.mark.parametrize("kind", ["column", "row"])
def test_seeded_init_is_the_same_at_every_world_size(kind):
    W1, b1 = run(_init_case, 1, kind, False)[0]
    bound = 1 / np.sqrt(IN)
    assert np.all(np.abs(W1) <= bound) and np.all(np.abs(b1) <= bound)
    assert abs(W1.mean()) < 0.02 and W1.std() > bound / 2  # U(-bound, bound): std = bound / sqrt(3)
    for world in (2, 3, 4):
        for uneven in (False, True):
            for W, b in run(_init_case, world, kind, uneven):
                assert np.array_equal(W, W1) and np.array_equal(b, b1)
    W_other, _ = run(_init_case, 1, kind, False)[0]
    assert np.array_equal(W_other, W1)


def _fd_case(comm):
    """Finite differences of L = sum(r * MLP(x)) through column -> row."""
    col = tpcore.ColumnParallelLinear(6, 10, comm, seed=1)
    row = tpcore.RowParallelLinear(10, 4, comm, seed=2)
    g = rng_for(9, 0)
    x = g.standard_normal((3, 6)).astype(np.float32)
    rw = g.standard_normal((3, 4)).astype(np.float32)

    def loss(xv):
        return float(np.sum(rw.astype(np.float64) * row(col(xv))))

    loss(x)
    dx = col.backward(row.backward(rw))
    eps, worst = 1e-2, 0.0
    for i in range(3):
        for j in range(6):
            xp, xm = x.copy(), x.copy()
            xp[i, j] += eps
            xm[i, j] -= eps
            num = (loss(xp) - loss(xm)) / (2 * eps)
            worst = max(worst, abs(num - dx[i, j]) / (1e-3 + abs(num)))
    return worst


@pytest.mark.parametrize("world", [1, 2, 3])
def test_finite_difference_gradient(world):
    for worst in run(_fd_case, world):
        assert worst < 1e-2, worst


def _bad_inputs(comm):
    col = tpcore.ColumnParallelLinear(8, 6, comm)
    errs = []
    cases = [
        (lambda: col(np.ones((2, 7), np.float32)), ValueError, "(..., 8)"),
        (lambda: col(np.ones((2, 8), np.float64)), TypeError, "float32"),
        (lambda: col(np.ones((8, 2), np.float32).T), ValueError, "contiguous"),
        (lambda: col([1.0] * 8), TypeError, "NumPy"),
        (lambda: tpcore.ColumnParallelLinear(8, 6, comm, partition=[1] * comm.size), ValueError, "sum to"),
        (lambda: tpcore.RowParallelLinear(0, 6, comm), ValueError, "in_features"),
        (lambda: tpcore.ColumnParallelLinear(8, 6, comm, dtype="int4"), ValueError, "float32, float16, bfloat16"),
        (lambda: col.load_full(np.ones((6, 9))), ValueError, "shape"),
    ]
    fresh = tpcore.RowParallelLinear(8, 6, comm)
    cases.append((lambda: fresh.backward(np.ones((2, 6), np.float32)), RuntimeError, "before forward"))
    for call, etype, word in cases:
        try:
            call()
            errs.append(f"no error ({word})")
        except etype as e:
            if word not in str(e):
                errs.append(f"{etype.__name__} without '{word}': {e}")
        except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
            errs.append(f"{type(e).__name__} instead of {etype.__name__}: {e}")
    col(np.ones((2, 8), np.float32))
    cols = 6 if comm.size == 1 else col.local
    try:
        col.backward(np.ones((3, cols), np.float32))
        errs.append("backward with other rows: no error")
    except ValueError as e:
        if f"(3, {cols})" not in str(e) or f"(2, {cols})" not in str(e):
            errs.append(str(e))
    return errs


@pytest.mark.parametrize("world", [1, 2])
def test_bad_inputs(world):
    for r, errs in enumerate(run(_bad_inputs, world)):
        assert not errs, f"rank {r}: {errs}"


def test_partition():
    assert tpcore.partition(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert tpcore.partition(12, 5, align=3) == [(0, 3), (3, 3), (6, 3), (9, 3), (12, 0)]
    assert tpcore.partition(100, 2, weights=[3, 1]) == [(0, 75), (75, 25)]
    p = tpcore.partition(1001, 4, weights=[1.7, 1, 1, 0.3])
    assert sum(s for _, s in p) == 1001 and p[0][1] > p[1][1] > p[3][1]
    assert [o for o, _ in p] == [0, p[0][1], p[0][1] + p[1][1], p[0][1] + p[1][1] + p[2][1]]
    with pytest.raises(ValueError):
        tpcore.partition(10, 3, align=4)
    with pytest.raises(ValueError):
        tpcore.partition(10, 2, weights=[1, -1])


def _reference_partition(n, world, weights, align):
    """The split as the docs state it, written here independently of tp_partition:
    even (first ranks one unit more), or largest remainders of units * w / sum(w)."""
    units = n // align
    if weights is None:
        counts = [units // world + (r < units % world) for r in range(world)]
    else:
        total = 0.0
        for x in weights:  # left to right, as tp_partition (not math.fsum)
            total += x
        exact = [units * x / total for x in weights]
        counts = [int(np.floor(e)) for e in exact]
        rest = units - sum(counts)
        order = sorted(range(world), key=lambda r: (-(exact[r] - counts[r]), r))
        for r in order[:rest]:
            counts[r] += 1
    return [c * align for c in counts]


def test_partition_matches_reference_on_random_cases():
    """tpcore.partition is the C core's tp_partition (the layers' split); on random sizes,
    worlds, aligns and weights it equals the reference, tiles [0, n) and keeps align."""
    rng = np.random.default_rng()
    for _ in range(3000):
        world = int(rng.integers(1, 9))
        align = int(rng.choice([1, 1, 2, 3, 8, 64]))
        n = align * int(rng.integers(0, 10 ** int(rng.integers(1, 7))))
        weights = None if rng.random() < 0.3 else [float(x) for x in rng.choice([0.0, 0.3, 1.0, 1.7, 2.5, 1e-3], world)]
        if weights is not None and sum(weights) <= 0:
            weights[0] = 1.0
        p = tpcore.partition(n, world, weights=weights, align=align)
        sizes = [s for _, s in p]
        assert sizes == _reference_partition(n, world, weights, align), (n, world, weights, align)
        assert [o for o, _ in p] == [sum(sizes[:r]) for r in range(world)] and sum(sizes) == n
        assert all(s % align == 0 and s >= 0 for s in sizes)
    assert tpcore.partition(2**63 - 1, 3)[-1][1] == (2**63 - 1) // 3
    with pytest.raises(ValueError, match="n must be"):
        tpcore.partition(2**63, 2)


def test_partition_weighted_extremes_tile_n():
    """Weighted splits past double precision or range still tile [0, n) with sizes >= 0:
    n > 2^53 (the floors missed n by up to hundreds), weights whose sum or units x weight
    overflow a double (inf/NaN became negative sizes), n = 2^63 - 1 (rounds up to 2^63)."""
    cases = [(2**62, 3, [1, 1, 1]), (10**17 + 3, 3, [1, 1, 1]), (2**60 + 7, 5, [0.1, 0.7, 1.3, 2.9, 5.0]),
             (5, 2, [1e308, 1e308]), (2**62, 3, [1e308] * 3), (10, 2, [1e300, 1]), (2**63 - 1, 1, [1.0]),
             (2**63 - 1, 2, [1, 1]), (2**63 - 1, 3, [1e308, 1e308, 1])]
    for n, world, weights in cases:
        p = tpcore.partition(n, world, weights=weights)
        sizes = [s for _, s in p]
        assert sum(sizes) == n and all(s >= 0 for s in sizes), (n, weights, sizes)
        assert [o for o, _ in p] == [sum(sizes[:r]) for r in range(world)]
    assert tpcore.partition(5, 2, weights=[1e308, 1e308]) == [(0, 3), (3, 2)]  # as [1, 1]


def _disagreeing_partitions(comm):
    part = [3, 1] if comm.rank == 0 else [2, 2]
    try:
        tpcore.RowParallelLinear(4, 1, comm, partition=part)
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_on_the_partition_fail_on_every_rank():
    for msg in run(_disagreeing_partitions, 2):
        assert "disagree on the partition" in msg, msg


def _too_large(comm):
    errs = []
    for make in (lambda: tpcore.ColumnParallelLinear(2**32, 8, comm), lambda: tpcore.RowParallelLinear(8, 2**31, comm),
                 lambda: tpcore.ColumnParallelLinear(2**20, 2**21, comm)):
        try:
            make()
            errs.append("no error")
        except (ValueError, MemoryError) as e:
            if not any(w in str(e) for w in ("at most", "too large", "memory")):
                errs.append(str(e))
    return errs


def test_layers_too_large_for_blas_or_memory_are_refused():
    assert run(_too_large, 1) == [[]]


def _dlpack_case(comm):
    lin = tpcore.ColumnParallelLinear(8, 6, comm, gather_output=True, seed=2)
    x = rng_for(3, 0).standard_normal((4, 8)).astype(np.float32)
    y_np = lin(x)
    y_dl = lin(DLPackOnly(x))
    dx = lin.backward(DLPackOnly(np.ones_like(y_np)))
    mlp = tpcore.ParallelMLP(8, 12, comm)
    same_mlp = np.array_equal(mlp(DLPackOnly(x)), mlp(x))
    try:
        lin(object())
        err = "no error"
    except TypeError as e:
        err = str(e)
    return bool(np.array_equal(y_np, y_dl)), dx.shape, same_mlp, err


@pytest.mark.parametrize("world", [1, 2])
def test_layers_take_any_dlpack_tensor(world):
    for r, (same, dxs, same_mlp, err) in enumerate(run(_dlpack_case, world)):
        assert same and same_mlp and dxs == (4, 8) and "__dlpack__" in err, (r, same, dxs, same_mlp, err)


def wrong_grad_shapes(shape):
    """Gradient shapes with as many elements as shape's, and its last dimension, that are not
    shape: the leading two swapped (batch and sequence, (T, B, C) for (B, T, C)), the rows
    flattened, an extra leading 1."""
    *lead, c = shape
    return [tuple(lead[1::-1]) + tuple(lead[2:]) + (c,), (int(np.prod(lead)), c), (1,) + tuple(shape)]


def refused_grads(layer, y, x_shape, g, name="dy"):
    """Errors of layer's backward after a forward that gave y (x of x_shape): every gradient of
    another shape (`wrong_grad_shapes`, fresh random values) is a ValueError naming both shapes
    and accumulates nothing; then the right one goes through."""
    errs, who = [], type(layer).__name__
    layer.zero_grad()
    for bad in wrong_grad_shapes(tuple(y.shape)):
        try:
            layer.backward(g.standard_normal(bad).astype(np.float32))
            errs.append(f"{who}: a {name} of shape {bad} after a forward of output {tuple(y.shape)}: no error")
        except ValueError as e:
            if str(bad) not in str(e) or str(tuple(y.shape)) not in str(e) or name not in str(e):
                errs.append(f"{who}: the error does not name {bad} and {tuple(y.shape)}: {e}")
    if any(np.any(gr != 0) for _, gr in layer.parameters()):
        errs.append(f"{who}: a refused backward accumulated gradients")
    dx = layer.backward(g.standard_normal(y.shape).astype(np.float32))
    if (dx is not None and dx.shape != x_shape) or not any(np.any(gr != 0) for _, gr in layer.parameters()):
        errs.append(f"{who}: the right {name} gave dx {None if dx is None else dx.shape} for x {x_shape}")
    return errs


def _grad_shape_case(comm, seed):
    g = rng_for(seed, 0)  # the same inputs and gradients on every rank
    B, T = (int(v) for v in g.choice(np.arange(2, 7), 2, replace=False))  # B != T
    n_in, n_out, ffn = (int(v) for v in g.integers(3, 17, 3))
    vocab = int(g.integers(2, B * T + 1))  # every id among the tokens: every rank's rows get a gradient
    x = g.standard_normal((B, T, n_in)).astype(np.float32)
    errs = []
    for layer in (tpcore.ColumnParallelLinear(n_in, n_out, comm, seed=seed),
                  tpcore.ColumnParallelLinear(n_in, n_out, comm, gather_output=True, seed=seed),
                  tpcore.RowParallelLinear(n_in, n_out, comm, input_is_parallel=False, seed=seed),
                  tpcore.ParallelMLP(n_in, ffn, comm)):
        errs += refused_grads(layer, layer(x), x.shape, g)
    row = tpcore.RowParallelLinear(n_in, n_out, comm, seed=seed)  # x: this rank's columns
    xr = np.ascontiguousarray(x[..., :row.local])
    errs += refused_grads(row, row(xr), xr.shape, g)
    emb = tpcore.VocabParallelEmbedding(vocab, n_in, comm, seed=seed)
    errs += refused_grads(emb, emb(g.permutation(np.arange(B * T) % vocab).reshape(B, T)), None, g, "dout")
    return errs


@pytest.mark.parametrize("world", [1, 2])
def test_backward_refuses_a_gradient_of_another_shape(world):
    """A gradient with the forward output's element count and last dimension but another shape
    ((T, B, C) for (B, T, C), the rows flattened) is a ValueError naming both shapes on every
    rank, in every layer, instead of a wrong gradient."""
    seed = int(np.random.default_rng().integers(2 ** 31))
    for r, errs in enumerate(run(_grad_shape_case, world, seed)):
        assert not errs, f"rank {r}, seed {seed}: {errs}"
