"""tpcore.DeviceArray on the CPU: construction, properties, repr, NumPy views and
copies, tpcore.asarray's copy semantics (array API), devices named and refused, and
its life cycle (memory freed with the last reference, exported capsules included)."""
import gc
import sys
import tracemalloc

import numpy as np
import pytest

import tpcore
from tpcore.utils import arrays as _array

CUDA = getattr(tpcore, "cuda_available", lambda: False)()


def test_construct_zero_filled_and_properties():
    a = tpcore.DeviceArray((3, 5), dtype="float64", device="cpu")
    assert a.shape == (3, 5) and a.ndim == 2 and a.size == 15 and a.nbytes == 120
    assert a.dtype == "float64" and a.device == "cpu:0" and a.owns_memory and not a.readonly
    np.testing.assert_array_equal(a.to_numpy(), np.zeros((3, 5)))
    assert repr(a) == "DeviceArray(shape=(3, 5), dtype=float64, device='cpu:0')"
    assert repr(tpcore.DeviceArray(4)) == "DeviceArray(shape=(4,), dtype=float32, device='cpu:0')"
    assert tpcore.DeviceArray(()).shape == () and tpcore.DeviceArray(()).size == 1
    e = tpcore.DeviceArray((0, 7))
    assert e.size == 0 and e.nbytes == 0 and e.to_numpy().shape == (0, 7)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"])
def test_every_dtype_round_trips(dtype):
    a = tpcore.asarray(np.arange(7) % 5, dtype=dtype)
    assert a.dtype == dtype
    np.testing.assert_array_equal(a.to_numpy().astype(np.float64), (np.arange(7) % 5).astype(np.float64))


def test_bad_arguments():
    with pytest.raises(ValueError, match="negative dimension"):
        tpcore.DeviceArray((2, -1))
    with pytest.raises(ValueError, match="dtype 'int16' is not known"):
        tpcore.DeviceArray(3, dtype="int16")
    with pytest.raises(ValueError, match="at most 8"):
        tpcore.DeviceArray((1,) * 9)
    with pytest.raises(ValueError, match="device 'tpu' is not known"):
        tpcore.DeviceArray(3, device="tpu")
    with pytest.raises(ValueError, match="the CPU is device 0 only"):
        tpcore.DeviceArray(3, device="cpu:1")
    with pytest.raises(ValueError, match="integer in 0..4096"):
        tpcore.DeviceArray(3, device="cuda:x")
    with pytest.raises(TypeError, match="device must be a string"):
        tpcore.DeviceArray(3, device=0)
    with pytest.raises(ValueError, match="overflows"):
        tpcore.DeviceArray((2**40, 2**40))


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
@pytest.mark.parametrize("dev", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_clear_error(dev):
    with pytest.raises(RuntimeError, match="CUDA is not available in this process"):
        tpcore.DeviceArray(3, device=dev)
    with pytest.raises(RuntimeError, match="asarray: device 'cuda:.*CUDA is not available"):
        tpcore.asarray(np.ones(3, np.float32), device=dev)


def test_to_numpy_is_a_view_on_the_cpu():
    a = tpcore.DeviceArray((2, 2))
    n = a.to_numpy()
    n[1, 1] = 7
    assert a.numpy()[1, 1] == 7
    assert np.from_dlpack(a)[1, 1] == 7


def test_copy_and_to():
    a = tpcore.asarray(np.arange(4, dtype=np.int32))
    c = a.copy()
    assert c.data_ptr != a.data_ptr and c.owns_memory
    c.to_numpy()[0] = 9
    assert a.to_numpy()[0] == 0
    assert a.to("cpu") is a


def test_asarray_copy_semantics():
    x = np.arange(6, dtype=np.float32)
    same = tpcore.asarray(x)
    assert same.data_ptr == x.ctypes.data and not same.owns_memory
    assert tpcore.asarray(x, copy=False).data_ptr == x.ctypes.data
    assert tpcore.asarray(x, copy=True).data_ptr != x.ctypes.data
    a = tpcore.DeviceArray(3)
    assert tpcore.asarray(a) is a and tpcore.asarray(a, device="cpu") is a
    assert tpcore.asarray(a, copy=True) is not a
    with pytest.raises(ValueError, match="copy=False"):
        tpcore.asarray([1.0, 2.0], copy=False)
    with pytest.raises(ValueError, match="copy=False"):
        tpcore.asarray(x[::2], copy=False)
    s = tpcore.asarray(x[::2])  # a copy makes it contiguous
    np.testing.assert_array_equal(s.to_numpy(), x[::2])
    with pytest.raises(TypeError, match="copy must be"):
        tpcore.asarray(x, copy="yes")
    lst = tpcore.asarray([[1, 2], [3, 4]], dtype="float64")
    assert lst.shape == (2, 2) and lst.dtype == "float64"


def test_life_cycle_frees_memory():
    a = tpcore.DeviceArray((1000,))
    base = sys.getrefcount(a)
    views = [a.to_numpy(), np.from_dlpack(a), a.__dlpack__(max_version=(1, 0)), a.__dlpack__()]
    assert sys.getrefcount(a) == base + 4
    del views
    gc.collect()
    assert sys.getrefcount(a) == base
    # a view over NumPy memory keeps the NumPy array alive and lets it go
    x = np.ones(1000, np.float32)
    xb = sys.getrefcount(x)
    v = tpcore.asarray(x)
    assert sys.getrefcount(x) == xb + 1
    del v
    assert sys.getrefcount(x) == xb


def test_no_leak_over_many_round_trips():
    def once():
        x = np.ones(50_000, np.float32)  # NumPy's data allocations are traced by tracemalloc
        v = tpcore.from_dlpack(x)
        n = np.from_dlpack(v)
        w = tpcore.from_dlpack(n.__dlpack__(max_version=(1, 0)))
        c = tpcore.asarray(w, copy=True)
        return float(c.to_numpy()[0] + n[0])

    once()
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(300):
            assert once() == 2.0
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert grown < 200_000, f"{grown} bytes still traced after 300 round trips of 200 KB arrays"


def test_check_on_device_names_both():
    with pytest.raises(TypeError, match=r"ColumnParallelLinear: x is on cpu:0 but the layer is on cuda:0"):
        _array.check_on_device(np.ones(2), "x", "ColumnParallelLinear", ("cuda", 0))
    _array.check_on_device(np.ones(2), "x", "ColumnParallelLinear", ("cpu", 0))
    _array.check_on_device(tpcore.DeviceArray(2), "x", "L", ("cpu", 0))


def test_resolve_device():
    assert _array.resolve_device(None, "L") == ("cpu", 0)
    assert _array.resolve_device("cpu", "L") == ("cpu", 0)
    with pytest.raises(ValueError, match="^L: device 'xpu' is not known"):
        _array.resolve_device("xpu", "L")


# ------------------------------------------------------------- layers and device=
from conftest import run  # noqa: E402  (the import opens the section that uses it)


def _cpu_layers(comm):
    g = np.random.default_rng(5)
    W = g.standard_normal((6, 4)).astype(np.float32)
    b = g.standard_normal(6).astype(np.float32)
    x = g.standard_normal((3, 4)).astype(np.float32)
    out = {}
    for dev in (None, "cpu", "cpu:0"):
        L = tpcore.ColumnParallelLinear(4, 6, comm, gather_output=True, device=dev)
        L.load_full(W, b)
        out[dev] = L(x)
        assert L.device == ("cpu", 0) and isinstance(L.weight, np.ndarray)
    L = tpcore.ColumnParallelLinear(4, 6, comm, gather_output=True, device="cpu")
    L.load_full(W, b)
    y_dev = L(tpcore.asarray(x))  # a CPU DeviceArray is host data: NumPy out, as before
    ref = x.astype(np.float64) @ W.T.astype(np.float64) + b
    return out, y_dev, ref


def test_layers_on_the_cpu_unchanged():
    out, y_dev, ref = run(_cpu_layers, 1)[0]
    for y in out.values():
        assert isinstance(y, np.ndarray)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(y, out[None])
    assert isinstance(y_dev, np.ndarray)
    np.testing.assert_array_equal(y_dev, out[None])


def _layer_devices(comm, device):
    cfg = tpcore.Config(vocab_size=16, hidden=8, heads=2, ffn_hidden=16)
    makers = {
        "ColumnParallelLinear": lambda: tpcore.ColumnParallelLinear(4, 6, comm, device=device),
        "RowParallelLinear": lambda: tpcore.RowParallelLinear(4, 6, comm, device=device),
        "ParallelMLP": lambda: tpcore.ParallelMLP(8, 16, comm, device=device),
        "VocabParallelEmbedding": lambda: tpcore.VocabParallelEmbedding(16, 8, comm, device=device),
        "VocabParallelCrossEntropy": lambda: tpcore.VocabParallelCrossEntropy(comm, device=device),
        "TransformerBlock": lambda: tpcore.TransformerBlock(cfg, comm, device=device),
    }
    res = {}
    for name, make in makers.items():
        try:
            make()
            res[name] = ("ok", "")
        except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
            res[name] = (type(e).__name__, str(e))
    return res


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_layers_on_cuda_without_cuda_are_clear_errors(device):
    for name, (etype, msg) in run(_layer_devices, 1, device)[0].items():
        assert etype == "RuntimeError", (name, etype, msg)
        assert msg.startswith(f"{name}: device 'cuda:") and "CUDA is not available" in msg, (name, msg)


def test_layers_unknown_device_named():
    for name, (etype, msg) in run(_layer_devices, 1, "tpu")[0].items():
        assert etype == "ValueError" and msg.startswith(f"{name}: device 'tpu' is not known"), (name, msg)


def _cuda_linear(comm):
    g = np.random.default_rng(11)
    W = g.standard_normal((10, 7)).astype(np.float32)
    b = g.standard_normal(10).astype(np.float32)
    x = g.standard_normal((2, 3, 7)).astype(np.float32)
    L = tpcore.ColumnParallelLinear(7, 10, comm, gather_output=True, device="cuda")
    L.load_full(W, b)
    assert isinstance(L.weight, tpcore.DeviceArray) and L.weight.device.startswith("cuda")
    xd = tpcore.asarray(x, device="cuda")
    y = L(xd)
    assert isinstance(y, tpcore.DeviceArray) and y.device == xd.device and y.shape == (2, 3, 10)
    errs = []
    for bad in (x, tpcore.asarray(x)):
        try:
            L(bad)
        except TypeError as e:
            errs.append(str(e))
    W_back, b_back = L.gather_full()
    return y.to_numpy(), x.astype(np.float64) @ W.T.astype(np.float64) + b, errs, W_back, W


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (tpcore.cuda_available() is False)")
def test_cuda_linear_matches_float64_reference():
    y, ref, errs, W_back, W = run(_cuda_linear, 1, start_method="spawn")[0]
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(W_back, W)
    assert len(errs) == 2 and all("is on cpu:0 but the layer is on cuda:" in e for e in errs), errs


def _cuda_mlp(comm):
    g = np.random.default_rng(3)
    x = g.standard_normal((5, 8)).astype(np.float32)
    dy = g.standard_normal((5, 8)).astype(np.float32)
    cpu = tpcore.ParallelMLP(8, 12, comm, activation="gelu", seed=7)
    gpu = tpcore.ParallelMLP(8, 12, comm, activation="gelu", seed=7, device="cuda")
    assert isinstance(gpu.fc1.weight, tpcore.DeviceArray)
    y = gpu(tpcore.asarray(x, device="cuda"))
    dx = gpu.backward(tpcore.asarray(dy, device="cuda"))
    return (cpu(x), y.to_numpy(), cpu.backward(dy), dx.to_numpy(), cpu.fc1.grad_weight,
            gpu.fc1.grad_weight.to_numpy())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (tpcore.cuda_available() is False)")
def test_cuda_mlp_matches_cpu_mlp():
    y_c, y_g, dx_c, dx_g, gw_c, gw_g = run(_cuda_mlp, 1, start_method="spawn")[0]
    np.testing.assert_allclose(y_g, y_c, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(dx_g, dx_c, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(gw_g, gw_c, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------ collectives, host-staged
# (adapted: the Python-level staging is gone; DeviceArrays go to the C communicator,
# whose dispatcher stages CUDA memory over shm.  CPU DeviceArrays run the same calls.)
def _staged_ops(comm, really_gpu):
    dev, call = ("cuda" if really_gpu else "cpu"), getattr
    r, n = comm.rank, comm.size
    base = np.arange(6, dtype=np.float32) + 10 * r
    res = {}
    x = tpcore.asarray(base, device=dev, copy=True)
    call(comm, "all_reduce")(x, op="sum")
    res["all_reduce"] = x.to_numpy().copy()
    o = tpcore.asarray(np.zeros(6, np.float32), device=dev, copy=True)
    call(comm, "all_reduce")(tpcore.asarray(base, device=dev, copy=True), op="max", out=o)
    res["all_reduce_out"] = o.to_numpy().copy()
    g = call(comm, "all_gather")(tpcore.asarray(base, device=dev, copy=True))
    res["all_gather"] = np.asarray(g.to_numpy() if isinstance(g, tpcore.DeviceArray) else g).copy()
    rs = call(comm, "reduce_scatter")(tpcore.asarray(np.tile(base, n), device=dev, copy=True))
    res["reduce_scatter"] = np.asarray(rs.to_numpy() if isinstance(rs, tpcore.DeviceArray) else rs).copy()
    b = tpcore.asarray(base, device=dev, copy=True)
    call(comm, "broadcast")(b, root=n - 1)
    res["broadcast"] = b.to_numpy().copy()
    red = tpcore.asarray(base, device=dev, copy=True)
    call(comm, "reduce")(red, root=0)
    res["reduce"] = red.to_numpy().copy()
    buf = tpcore.asarray(np.zeros(6, np.float32), device=dev, copy=True)
    src = tpcore.asarray(base, device=dev, copy=True)
    call(comm, "sendrecv")(src, (r + 1) % n, buf, (r - 1) % n)
    res["sendrecv"] = buf.to_numpy().copy()
    if r == 0:
        call(comm, "send")(tpcore.asarray(base, device=dev, copy=True), 1)
    elif r == 1:
        rb = tpcore.asarray(np.zeros(6, np.float32), device=dev, copy=True)
        call(comm, "recv")(rb, 0)
        res["recv"] = rb.to_numpy().copy()
    return res


def _check_staged(out):
    n = len(out)
    bases = [np.arange(6, dtype=np.float64) + 10 * r for r in range(n)]
    total = sum(bases)
    for r, res in enumerate(out):
        np.testing.assert_array_equal(res["all_reduce"], total)
        np.testing.assert_array_equal(res["all_reduce_out"], bases[-1])
        np.testing.assert_array_equal(res["all_gather"], np.concatenate(bases))
        np.testing.assert_array_equal(res["reduce_scatter"], np.tile(total, n).reshape(n, 6)[r])
        np.testing.assert_array_equal(res["broadcast"], bases[-1])
        np.testing.assert_array_equal(res["reduce"], total if r == 0 else bases[r])
        np.testing.assert_array_equal(res["sendrecv"], bases[(r - 1) % n])
    np.testing.assert_array_equal(out[1]["recv"], bases[0])


def test_host_staged_collectives_logic():
    _check_staged(run(_staged_ops, 2, False))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (tpcore.cuda_available() is False)")
def test_host_staged_collectives_on_the_gpu():
    _check_staged(run(_staged_ops, 2, True, start_method="spawn"))
