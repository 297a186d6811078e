"""The collectives on tpcore.DeviceArrays: they go to the C communicator as NumPy arrays
do (the extension's get_buf takes a DeviceArray of any device), other DLPack tensors
become DeviceArray views (no copy), and outputs comm.py makes live on the input's
device.  CPU DeviceArrays run everywhere; the CUDA variants (shm with the C
dispatcher's host staging, and NCCL) skip with the reason where no GPU is usable.
Every result is checked against float64 NumPy references written here."""
import os

import numpy as np
import pytest

import tpcore
from conftest import WORLDS, DLPackOnly, rng_for, run

SEED = 1234
SHAPE = (6, 5)  # 6 rows: even over 1, 2, 3 ranks; world 4 uses sizes= for reduce_scatter


def cuda_usable():
    f = getattr(tpcore, "cuda_available", None)
    return bool(f and f())


def nccl_why():
    """None when the NCCL backend can run here, else why not."""
    if not cuda_usable():
        return "needs a CUDA GPU (tpcore.cuda_available() is False)"
    return tpcore._C.Comm.probe("nccl")


def _data(rank, shape=SHAPE, seed=SEED):
    return rng_for(seed, rank).standard_normal(shape).astype(np.float32)


def _host(a):
    """A NumPy copy of a result (a DeviceArray of any device, or a NumPy array)."""
    return np.array(a.to_numpy() if isinstance(a, tpcore.DeviceArray) else a, copy=True)


def _dev(a, device):
    return tpcore.asarray(np.ascontiguousarray(a), device=device, copy=True)


def _zeros(shape, device):
    return tpcore.DeviceArray(shape, "float32", device)


def _even(n, total):
    return [total // n + (1 if r < total % n else 0) for r in range(n)]


# ------------------------------------------------------------------ the operations
def _ops(comm, device):
    """Every collective and p2p call on DeviceArrays of `device`, in place and with out=,
    and mixed with NumPy arrays; the results as NumPy copies, with what kind each was."""
    r, n = comm.rank, comm.size
    x = _data(r)
    res, kinds = {}, {}

    a = _dev(x, device)
    got = comm.all_reduce(a)
    kinds["all_reduce"] = got is a
    res["all_reduce"] = _host(a)

    o = _zeros(SHAPE, device)
    got = comm.all_reduce(_dev(x, device), op="max", out=o)
    kinds["all_reduce_out"] = got is o
    res["all_reduce_out"] = _host(o)

    a = _dev(x, device)
    comm.all_reduce(a, op="avg")
    res["all_reduce_avg"] = _host(a)

    g = comm.all_gather(_dev(x, device))
    kinds["all_gather"] = isinstance(g, tpcore.DeviceArray) and g.device == _dev(x, device).device
    res["all_gather"] = _host(g)

    o = _zeros((n * SHAPE[0], SHAPE[1]), device)
    got = comm.all_gather(_dev(x, device), out=o)
    kinds["all_gather_out"] = got is o
    res["all_gather_out"] = _host(o)

    g = comm.all_gather(_dev(x, device), axis=1)
    kinds["all_gather_axis1"] = isinstance(g, tpcore.DeviceArray)
    res["all_gather_axis1"] = _host(g)

    rows = r + 1  # uneven: rank r gives r + 1 rows
    g = comm.all_gather(_dev(x[:rows], device), sizes=[q + 1 for q in range(n)])
    res["all_gather_uneven"] = _host(g)

    big = _data(r, (n * 3, SHAPE[1]), SEED + 1)
    s = comm.reduce_scatter(_dev(big, device))
    kinds["reduce_scatter"] = isinstance(s, tpcore.DeviceArray)
    res["reduce_scatter"] = _host(s)

    o = _zeros((3, SHAPE[1]), device)
    got = comm.reduce_scatter(_dev(big, device), op="min", out=o)
    kinds["reduce_scatter_out"] = got is o
    res["reduce_scatter_out"] = _host(o)

    sizes = _even(n, SHAPE[1])
    s = comm.reduce_scatter(_dev(x, device), axis=1, sizes=sizes)
    res["reduce_scatter_axis1"] = _host(s)

    a = _dev(x, device)
    got = comm.broadcast(a, root=n - 1)
    kinds["broadcast"] = got is a
    res["broadcast"] = _host(a)

    o = _zeros(SHAPE, device)
    comm.broadcast(_dev(x, device), root=0, out=o)
    res["broadcast_out"] = _host(o)

    a = _dev(x, device)
    comm.reduce(a, root=0)
    res["reduce"] = _host(a)

    o = _zeros(SHAPE, device)
    comm.reduce(_dev(x, device), root=n - 1, op="max", out=o)
    res["reduce_out"] = _host(o) if r == n - 1 else None

    o = _zeros(SHAPE, device)
    got = comm.sendrecv(_dev(x, device), (r + 1) % n, o, (r - 1) % n)
    kinds["sendrecv"] = got is o
    res["sendrecv"] = _host(o)

    if n > 1:  # a ring of send/recv: even ranks send first
        b = _zeros(SHAPE, device)
        if r % 2 == 0:
            comm.send(_dev(x, device), (r + 1) % n)
            got = comm.recv(b, (r - 1) % n)
        else:
            got = comm.recv(b, (r - 1) % n)
            comm.send(_dev(x, device), (r + 1) % n)
        kinds["recv"] = got is b
        res["recv"] = _host(b)

    # mixing NumPy arrays and DeviceArrays
    o = _zeros(SHAPE, device)
    comm.all_reduce(x.copy(), out=o)  # NumPy in, DeviceArray out
    res["mix_np_in"] = _host(o)
    o = np.zeros(SHAPE, np.float32)
    got = comm.all_reduce(_dev(x, device), out=o)  # DeviceArray in, NumPy out
    kinds["mix_np_out"] = got is o
    res["mix_np_out"] = o.copy()
    o = np.zeros((n * SHAPE[0], SHAPE[1]), np.float32)
    comm.all_gather(_dev(x, device), out=o)
    res["mix_gather_np_out"] = o.copy()
    g = comm.all_gather(x.copy())  # NumPy stays NumPy
    kinds["np_stays_np"] = type(g) is np.ndarray
    o = _zeros(SHAPE, device)
    comm.sendrecv(x.copy(), (r + 1) % n, o, (r - 1) % n)
    res["mix_sendrecv"] = _host(o)
    return res, kinds


def _check(out):
    n = len(out)
    xs = [_data(r).astype(np.float64) for r in range(n)]
    bigs = [_data(r, (n * 3, SHAPE[1]), SEED + 1).astype(np.float64) for r in range(n)]
    total, big_total = sum(xs), sum(bigs)
    tol = dict(rtol=1e-5, atol=1e-5)
    for r, (res, kinds) in enumerate(out):
        bad = [k for k, v in kinds.items() if v is not True]
        assert not bad, f"rank {r}: wrong result object or kind for {bad}"
        np.testing.assert_allclose(res["all_reduce"], total, **tol)
        np.testing.assert_array_equal(res["all_reduce_out"], np.maximum.reduce(xs))
        np.testing.assert_allclose(res["all_reduce_avg"], total / n, **tol)
        np.testing.assert_array_equal(res["all_gather"], np.concatenate(xs))
        np.testing.assert_array_equal(res["all_gather_out"], np.concatenate(xs))
        np.testing.assert_array_equal(res["all_gather_axis1"], np.concatenate(xs, axis=1))
        np.testing.assert_array_equal(res["all_gather_uneven"], np.concatenate([xs[q][:q + 1] for q in range(n)]))
        np.testing.assert_allclose(res["reduce_scatter"], big_total[3 * r:3 * r + 3], **tol)
        np.testing.assert_array_equal(res["reduce_scatter_out"], np.minimum.reduce(bigs)[3 * r:3 * r + 3])
        sizes = _even(n, SHAPE[1])
        lo = sum(sizes[:r])
        np.testing.assert_allclose(res["reduce_scatter_axis1"], total[:, lo:lo + sizes[r]], **tol)
        np.testing.assert_array_equal(res["broadcast"], xs[n - 1])
        np.testing.assert_array_equal(res["broadcast_out"], xs[0])
        np.testing.assert_allclose(res["reduce"], total if r == 0 else xs[r], **tol)
        if r == n - 1:
            np.testing.assert_array_equal(res["reduce_out"], np.maximum.reduce(xs))
        np.testing.assert_array_equal(res["sendrecv"], xs[(r - 1) % n])
        if n > 1:
            np.testing.assert_array_equal(res["recv"], xs[(r - 1) % n])
        np.testing.assert_allclose(res["mix_np_in"], total, **tol)
        np.testing.assert_allclose(res["mix_np_out"], total, **tol)
        np.testing.assert_array_equal(res["mix_gather_np_out"], np.concatenate(xs))
        np.testing.assert_array_equal(res["mix_sendrecv"], xs[(r - 1) % n])


@pytest.mark.parametrize("n", WORLDS)
def test_collectives_on_cpu_device_arrays(n):
    _check(run(_ops, n, "cpu"))


# ------------------------------------------------- other DLPack tensors: views, no copy
def _foreign(comm):
    r = comm.rank
    x = _data(r)
    base = x.copy()
    comm.all_reduce(DLPackOnly(base))  # a host tensor of another library: in place, no copy
    g = comm.all_gather(DLPackOnly(x.copy()))  # a host tensor: the new output is NumPy, as before
    src = tpcore.asarray(x, device="cpu", copy=True)
    out = np.zeros(SHAPE, np.float32)
    comm.all_reduce(DLPackOnly(src), op="max", out=DLPackOnly(out))
    return base, type(g) is np.ndarray, g, out


@pytest.mark.parametrize("n", [1, 3])
def test_other_dlpack_tensors_are_viewed_in_place(n):
    out = run(_foreign, n)
    xs = [_data(r).astype(np.float64) for r in range(n)]
    for base, is_np, g, mx in out:
        np.testing.assert_allclose(base, sum(xs), rtol=1e-5, atol=1e-5)
        assert is_np
        np.testing.assert_array_equal(g, np.concatenate(xs))
        np.testing.assert_array_equal(mx, np.maximum.reduce(xs))


# ------------------------------------------------------------------ refusals
def _read_only(comm):
    x = np.ones(4, np.float32)
    ro_np = np.ones(4, np.float32)
    ro_np.flags.writeable = False
    ro = tpcore._C.from_dlpack(ro_np)  # a read-only DeviceArray
    assert isinstance(ro, tpcore.DeviceArray) and ro.readonly
    calls = {
        "in place": lambda a: comm.all_reduce(a),
        "all_reduce out": lambda a: comm.all_reduce(x, out=a),
        "broadcast in place": lambda a: comm.broadcast(a),
        "reduce out": lambda a: comm.reduce(x, out=a),
        "all_gather out": lambda a: comm.all_gather(x, out=a),
        "reduce_scatter out": lambda a: comm.reduce_scatter(x, out=a),
        "recv": lambda a: comm.recv(a, 0),
        "sendrecv out": lambda a: comm.sendrecv(x, 0, a, 0),
    }
    msgs = {}
    for label, call in calls.items():
        pair = []
        for arr in (ro, ro_np):  # the DeviceArray's refusal reads as NumPy's
            try:
                call(arr)
                pair.append("no error")
            except ValueError as e:
                pair.append(str(e))
        msgs[label] = pair
    # reading a read-only DeviceArray is fine
    o = tpcore.DeviceArray(4, "float32", "cpu")
    comm.all_reduce(ro, out=o)
    return msgs, o.to_numpy().copy()


def test_read_only_device_array_refused_as_an_output():
    msgs, o = run(_read_only, 1)[0]
    want = {
        "in place": "all_reduce: x is read-only, but the in-place operation writes into it; pass out= to get the "
                    "result elsewhere",
        "all_reduce out": "all_reduce: out is read-only but the operation writes into it",
        "broadcast in place": "broadcast: x is read-only, but the in-place operation writes into it",
        "reduce out": "reduce: out is read-only but the operation writes into it",
        "all_gather out": "all_gather: out is read-only but the operation writes into it",
        "reduce_scatter out": "reduce_scatter: out is read-only but the operation writes into it",
        "recv": "recv: x is read-only, but recv writes the received data into it",
        "sendrecv out": "sendrecv: out is read-only but the operation writes into it",
    }
    for label, (dev_msg, np_msg) in msgs.items():
        assert want[label] in dev_msg, f"{label}: {dev_msg}"
        assert dev_msg == np_msg, f"{label}: DeviceArray says {dev_msg!r}, NumPy says {np_msg!r}"
    np.testing.assert_array_equal(o, np.ones(4))


def _mismatch(comm):
    errs = []
    x = tpcore.DeviceArray(4, "float32", "cpu")
    for call in (lambda: comm.all_reduce(x, out=tpcore.DeviceArray(4, "float64", "cpu")),
                 lambda: comm.all_reduce(x, out=tpcore.DeviceArray(5, "float32", "cpu")),
                 lambda: comm.all_gather(x, out=tpcore.DeviceArray(3, "float32", "cpu")),
                 lambda: comm.all_gather(x, out=tpcore.DeviceArray(4, "int32", "cpu")),
                 lambda: comm.all_reduce([1.0, 2.0])):
        try:
            call()
            errs.append("no error")
        except (TypeError, ValueError) as e:
            errs.append(f"{type(e).__name__}: {e}")
    return errs


def test_mismatched_device_arrays_are_named():
    errs = run(_mismatch, 1)[0]
    assert errs[0].startswith("TypeError: all_reduce: ") and "x" in errs[0] and "out" in errs[0], errs[0]
    assert errs[1] == "ValueError: all_reduce: out has shape (5,) but x has shape (4,)", errs[1]
    assert errs[2] == "ValueError: all_gather: out has shape (3,), expected (4,)", errs[2]
    assert errs[3] == "TypeError: all_gather: out has dtype int32 but x has dtype float32; they must match", errs[3]
    assert errs[4].startswith("TypeError: all_reduce: x must be a NumPy array, a tpcore.DeviceArray or a tensor "
                              "with __dlpack__, got list"), errs[4]


class _FakeCuda:
    """A CUDA tensor as far as its device says (its data must never be read)."""

    def __dlpack__(self, **kw):
        raise AssertionError("a CUDA tensor must not be imported where CUDA is not usable")

    def __dlpack_device__(self):
        return (2, 0)


def _fake_cuda(comm):
    out = []
    for name, call in (("x", lambda: comm.all_reduce(_FakeCuda())),
                       ("out", lambda: comm.all_reduce(np.ones(4, np.float32), out=_FakeCuda())),
                       ("x", lambda: comm.send(_FakeCuda(), 0))):
        try:
            call()
            out.append((name, "no error"))
        except (TypeError, RuntimeError) as e:
            out.append((name, str(e)))
    return out


@pytest.mark.skipif(cuda_usable(), reason="this machine has a usable CUDA device")
def test_cuda_tensor_without_cuda_is_a_clear_error():
    for (name, msg), op in zip(run(_fake_cuda, 1)[0], ("all_reduce", "all_reduce", "send")):
        assert msg.startswith(f"{op}: {name} is a CUDA tensor"), msg
        assert "CUDA" in msg and ("not available" in msg or "no CUDA support" in msg), msg


def test_python_staging_is_gone():
    from tpcore.utils import arrays as _array
    from tpcore.distributed import comm
    for name in ("staged", "staged_collective", "_to_host", "_back"):
        assert not hasattr(_array, name) and not hasattr(comm, name), name


# ------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="needs a CUDA GPU (tpcore.cuda_available() is False)")
@pytest.mark.parametrize("n", [1, 2])
def test_collectives_on_cuda_device_arrays_over_shm(n):
    """shm moves host memory: the C dispatcher stages the CUDA buffers (several ranks may
    share the one GPU)."""
    _check(run(_ops, n, "cuda:0"))


def _nccl_world():
    return 2 if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" else 1


@pytest.mark.gpu
@pytest.mark.skipif(nccl_why() is not None, reason=f"NCCL backend not usable: {nccl_why()}")
def test_collectives_on_cuda_device_arrays_over_nccl():
    n = _nccl_world()
    _check(run(_ops, n, "cuda:0", backend="nccl"))


@pytest.mark.gpu
@pytest.mark.skipif(nccl_why() is not None, reason=f"NCCL backend not usable: {nccl_why()}")
def test_cpu_device_arrays_over_nccl_are_staged():
    """Host memory given to NCCL goes through the C dispatcher's device bounce buffer."""
    n = _nccl_world()
    _check(run(_ops, n, "cpu", backend="nccl"))


def _torch_cuda(comm):
    import torch
    r = comm.rank
    t = torch.from_numpy(_data(r)).cuda()
    comm.all_reduce(t)  # a view of t's memory: in place, no copy
    g = comm.all_gather(torch.from_numpy(_data(r)).cuda())
    torch.cuda.synchronize()
    return t.cpu().numpy(), isinstance(g, tpcore.DeviceArray), _host(g)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="needs a CUDA GPU (tpcore.cuda_available() is False)")
def test_torch_cuda_tensors_over_shm():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA here")
    out = run(_torch_cuda, 2)
    xs = [_data(r).astype(np.float64) for r in range(2)]
    for t, is_dev, g in out:
        np.testing.assert_allclose(t, sum(xs), rtol=1e-5, atol=1e-5)
        assert is_dev
        np.testing.assert_array_equal(g, np.concatenate(xs))
