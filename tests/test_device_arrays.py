"""tpcore.DeviceArray on the CPU: construction, properties, repr, NumPy views and
copies, tpcore.asarray's copy semantics (array API), devices named and refused, and
its life cycle (memory freed with the last reference, exported capsules included)."""
import gc
import sys
import tracemalloc

import numpy as np
import pytest

import tpcore
from tpcore import _array

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
