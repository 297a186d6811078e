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
