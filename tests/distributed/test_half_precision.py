"""float16 / bfloat16: every bit pattern survives a reduction unchanged, and
the rounding of sums matches NumPy's (float16) and ml_dtypes' (bfloat16) own
float32 -> 16-bit casts, round to nearest even, including subnormals,
overflow to infinity and NaN."""
import numpy as np
import pytest

from conftest import BF16, run


def _identity(comm, dtype):
    """All 65536 patterns on rank 0 plus -0.0 elsewhere: x + (-0) == x."""
    dt = np.dtype(dtype) if dtype != "bfloat16" else BF16
    if comm.rank == 0:
        x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(dt).copy()
    else:
        x = np.full(65536, -0.0, dtype=np.float32).astype(dt)
    comm.all_reduce(x)
    return x.view(np.uint16).copy()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_bit_pattern_round_trips(dtype):
    if dtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes missing")
    got = run(_identity, 2, dtype)[0]
    want = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    dt = np.float16 if dtype == "float16" else BF16
    nan = np.isnan(want.view(dt).astype(np.float32))
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(dt).astype(np.float32)).all()


def _sums(comm, dtype, seed):
    dt = np.dtype(dtype) if dtype != "bfloat16" else BF16
    g = np.random.default_rng([seed, comm.rank])
    # magnitudes from subnormal to past the largest finite value
    mag = np.exp2(g.uniform(-26, 17 if dtype == "float16" else 130, 400_000))
    x = (mag * g.choice([-1.0, 1.0], mag.size)).astype(np.float32).astype(dt)
    mine = x.copy()
    comm.all_reduce(x)
    return mine, x


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("world", [2, 3])
def test_sum_rounding_matches_reference_casts(dtype, world):
    if dtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes missing")
    res = run(_sums, world, dtype, 5)
    ins = [r[0] for r in res]
    # the reduction accumulates in float32 in rank order and rounds once
    with np.errstate(over="ignore", invalid="ignore"):  # inf + -inf is part of the test
        acc = ins[0].astype(np.float32)
        for a in ins[1:]:
            acc = acc + a.astype(np.float32)
        want = acc.astype(ins[0].dtype)
    for r, (_, got) in enumerate(res):
        same = (got.view(np.uint16) == want.view(np.uint16)) | (
            np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))
        assert same.all(), f"rank {r}: {np.count_nonzero(~same)} differ, e.g. {got[~same][:5]} vs {want[~same][:5]}"


def _half_layers(comm, dtype):
    """Layers take float16 / bfloat16 activations and checkpoints (compute is
    float32); outputs and input gradients come back in the input's dtype."""
    import tpcore
    dt = np.dtype(np.float16) if dtype == "float16" else BF16
    g = np.random.default_rng([31, 0])
    W = g.standard_normal((12, 9)).astype(dt)           # a half-precision checkpoint tensor
    b = g.standard_normal(12).astype(dt)
    x = g.standard_normal((5, 9)).astype(dt)
    dy = g.standard_normal((5, 12)).astype(dt)
    col = tpcore.ColumnParallelLinear(9, 12, comm, gather_output=True)
    col.load_full(W, b)
    y, dx = col(x), col.backward(dy)
    # float64 reference from the same half values
    W64, b64, x64, dy64 = (a.astype(np.float64) for a in (W, b, x, dy))
    y_ref, dx_ref = x64 @ W64.T + b64, dy64 @ W64
    off, loc = col.offset, col.local
    gw_ref = (dy64.T @ x64)[off:off + loc]
    mlp = tpcore.ParallelMLP(9, 20, comm, activation="swiglu", seed=2)
    ym = mlp(x)
    ym32 = mlp(x.astype(np.float32))
    emb = tpcore.VocabParallelEmbedding(30, 9, comm)
    emb(np.array([1, 29, 3]))
    emb.zero_grad()
    emb.backward(np.ones((3, 9), dt))
    errs = []
    half = tpcore.RowParallelLinear(9, 12, comm, dtype=dtype)  # 16-bit weights (test_lowp_layers.py)
    if half.weight.dtype != dt or half.grad_weight.dtype != np.float32:
        errs.append(f"dtype={dtype}: weight {half.weight.dtype}, grad {half.grad_weight.dtype}")
    try:
        tpcore.RowParallelLinear(9, 12, comm, dtype="float64")
        errs.append("dtype=float64 parameters accepted")
    except ValueError as e:
        if "float32" not in str(e):
            errs.append(str(e))
    tol = 1e-2 if dtype == "float16" else 6e-2
    return (y.dtype == dt and dx.dtype == dt and ym.dtype == dt,
            bool(np.allclose(y.astype(np.float64), y_ref, rtol=tol, atol=tol)),
            bool(np.allclose(dx.astype(np.float64), dx_ref, rtol=tol, atol=tol)),
            bool(np.allclose(col.grad_weight, gw_ref, rtol=1e-5, atol=1e-5)),   # grads stay float32
            bool(np.array_equal(ym, ym32.astype(dt))),
            float(emb.grad_weight.sum()) == 9.0 * sum(emb.offset <= t < emb.offset + emb.local for t in (1, 29, 3)),
            errs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("world", [1, 3])
def test_layers_accept_half_precision_activations_and_checkpoints(dtype, world):
    if dtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes missing")
    for r, res in enumerate(run(_half_layers, world, dtype)):
        *flags, errs = res
        assert all(flags) and not errs, f"rank {r}: {flags} {errs}"
