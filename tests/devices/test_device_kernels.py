"""tpcore._C's d_ kernels (csrc/python/devkernels.c): the tensor kernels a GPU model runs
outside its layers, on any device.  Here on the CPU, with DeviceArrays of the CPU and NumPy
arrays as inputs, against float64 NumPy references (and the host kernels for the optimizer
steps); bad arguments get errors naming the kernel and the argument.  tests/devices/test_gpu.py and
the GPU model tests run them on CUDA."""
import numpy as np
import pytest

import tpcore
from tpcore import _C
from conftest import BF16

DA = tpcore.DeviceArray


def dev(a):
    """A DeviceArray of the CPU holding a copy of a."""
    return tpcore.asarray(np.ascontiguousarray(a), device="cpu", copy=True)


def host(a):
    return a.to_numpy() if isinstance(a, DA) else np.asarray(a)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norms(kind):
    g = np.random.default_rng(1)
    M, C, eps = 7, 13, 1e-5
    x, w, b, dy = (g.standard_normal(s).astype(np.float32) for s in ((M, C), C, C, (M, C)))
    y, mu, rs = _C.norm_forward(kind, dev(x), dev(w), dev(b) if kind == "layernorm" else None, eps)
    assert isinstance(y, DA) and y.device == "cpu:0" and (mu is None) == (kind == "rmsnorm")
    x64 = x.astype(np.float64)
    if kind == "layernorm":
        m = x64.mean(1, keepdims=True)
        r = 1 / np.sqrt(((x64 - m) ** 2).mean(1, keepdims=True) + eps)
        want = (x64 - m) * r * w + b
    else:
        m = 0
        r = 1 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + eps)
        want = x64 * r * w
    assert np.allclose(host(y), want, rtol=1e-5, atol=1e-5)
    dw, db = dev(np.zeros(C, np.float32)), dev(np.zeros(C, np.float32))
    dx = _C.norm_backward(kind, dev(dy), dev(x), dev(w), mu, rs, dw, db if kind == "layernorm" else None)
    xh = (x64 - m) * r
    dxh = dy * w
    if kind == "layernorm":
        want_dx = r * (dxh - dxh.mean(1, keepdims=True) - xh * (dxh * xh).mean(1, keepdims=True))
        assert np.allclose(host(db), dy.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    else:
        want_dx = r * (dxh - xh * (dxh * xh).mean(1, keepdims=True))
    assert np.allclose(host(dx), want_dx, rtol=1e-4, atol=1e-5)
    assert np.allclose(host(dw), (dy * xh).sum(0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("wdt", ["float32", "bfloat16", "float16"])
def test_linear(wdt):
    if wdt == "bfloat16" and BF16 is None:
        pytest.skip("needs ml_dtypes")
    g = np.random.default_rng(2)
    M, K, N = 5, 19, 11
    x, dy = g.standard_normal((M, K)).astype(np.float32), g.standard_normal((M, N)).astype(np.float32)
    w = g.standard_normal((N, K)).astype(np.float32).astype(BF16 if wdt == "bfloat16" else wdt)
    b = g.standard_normal(N).astype(np.float32)
    w64 = w.astype(np.float64)
    y = _C.linear_forward(dev(x), w, dev(b))  # a NumPy weight next to DeviceArrays: both the CPU's
    assert np.allclose(host(y), x @ w64.T + b, rtol=1e-5, atol=1e-5)
    dw = dev(np.ones((N, K), np.float32))
    dx = _C.linear_backward(dev(dy), dev(x), dev(w), dw)
    assert np.allclose(host(dx), dy @ w64, rtol=1e-5, atol=1e-5)
    assert np.allclose(host(dw), 1 + dy.astype(np.float64).T @ x, rtol=1e-5, atol=1e-5)


def test_add_fill_embedding():
    g = np.random.default_rng(3)
    a, b = g.standard_normal((4, 6)).astype(np.float32), g.standard_normal((4, 6)).astype(np.float32)
    y = dev(a)
    _C.add(y, y, dev(b))
    assert np.array_equal(host(y), a + b)
    _C.fill(y, 2.5)
    assert (host(y) == 2.5).all()
    table = g.standard_normal((9, 6)).astype(np.float32)
    tok = np.array([3, 0, 8, 3, 12], np.int64)  # 12 is outside [lo, lo + 9) = [2, 11)
    rows = _C.embedding_forward(dev(tok), dev(table), 2)
    want = np.stack([table[t - 2] if 2 <= t < 11 else np.zeros(6, np.float32) for t in tok])
    assert np.array_equal(host(rows), want)
    dt = dev(np.zeros((9, 6), np.float32))
    dout = g.standard_normal((5, 6)).astype(np.float32)
    _C.embedding_backward(dt, dev(tok), dev(dout), 2)
    want = np.zeros((9, 6))
    for i, t in enumerate(tok):
        if 2 <= t < 11:
            want[t - 2] += dout[i]
    assert np.allclose(host(dt), want, atol=1e-6)


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_optimizer_steps_equal_the_host_kernels(opt):
    g = np.random.default_rng(4)
    p, grad = g.standard_normal(37).astype(np.float32), g.standard_normal(37).astype(np.float32)
    hp, dp = p.copy(), dev(p)
    if opt == "adamw":
        hm, hv = np.zeros_like(p), np.zeros_like(p)
        dm, dv = dev(hm), dev(hv)
        for t in (1, 2, 3):
            _C.adamw_step(hp, grad, hm, hv, 1e-2, 0.9, 0.99, 1e-8, 0.1, t)
            _C.adamw_step(dp, dev(grad), dm, dv, 1e-2, 0.9, 0.99, 1e-8, 0.1, t)
        assert np.array_equal(host(dm), hm) and np.array_equal(host(dv), hv)
    else:
        hb, db = np.zeros_like(p), dev(np.zeros_like(p))
        for t in (1, 2):
            _C.sgd_step(hp, grad, hb, 1e-2, 0.9, 0.0, t == 1)
            _C.sgd_step(dp, dev(grad), db, 1e-2, 0.9, 0.0, t == 1)
        assert np.array_equal(host(db), hb)
    assert np.array_equal(host(dp), hp)


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")
@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
def test_convert_both_ways(dt):
    g = np.random.default_rng(5)
    x = (g.standard_normal(1001) * np.exp2(g.uniform(-30, 30, 1001))).astype(np.float32)
    npdt = BF16 if dt == "bfloat16" else np.dtype(dt)
    y = DA((1001,), dt, device="cpu")
    _C.convert(dev(x), None, y)
    with np.errstate(over="ignore"):  # past float16's range: infinity, as the kernel gives
        want = x.astype(npdt)
    assert np.array_equal(host(y).view(np.uint16), want.view(np.uint16))
    back = DA((1001,), "float32", device="cpu")
    _C.convert(y, None, back)
    assert np.array_equal(host(back), want.astype(np.float32))


def test_bad_arguments_name_the_kernel_and_argument():
    x = dev(np.ones((3, 4), np.float32))
    cases = [
        (lambda: _C.norm_forward("batchnorm", x, dev(np.ones(4, np.float32)), None, 1e-5), "kind"),
        (lambda: _C.norm_forward("rmsnorm", x, dev(np.ones(5, np.float32)), None, 1e-5), "w"),
        (lambda: _C.linear_forward(x, dev(np.ones((2, 5), np.float32))), "linear_forward"),
        (lambda: _C.add(x, x, dev(np.ones(5, np.float32))), "b"),
        (lambda: _C.add(x, x, dev(np.ones(12, np.float64))), "float32"),
        (lambda: _C.fill(dev(np.ones(3, np.int64)), 1.0), "float32"),
        (lambda: _C.embedding_forward(dev(np.ones(3, np.float32)), x), "tokens"),
        (lambda: _C.adamw_step(x, x, x, x, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0), "step"),
        (lambda: _C.convert(x, None, dev(np.ones(5, np.float32))), "shape"),
        (lambda: _C.add([1.0], x, x), "y"),
    ]
    for call, word in cases:
        with pytest.raises((ValueError, TypeError, RuntimeError)) as e:
            call()
        assert word in str(e.value), (word, str(e.value))
    frozen = np.ones(4, np.float32)
    frozen.flags.writeable = False
    for ro in (frozen, tpcore.from_dlpack(frozen)):  # a read-only array, and tpcore's read-only view of it
        with pytest.raises(ValueError) as e:
            _C.fill(ro, 0.0)
        assert "fill: y is read-only" in str(e.value)
    assert (frozen == 1).all()


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")
def test_gpu_layers_16_bit_activation_helpers():
    """What a GPU layer does with a 16-bit activation (tpcore.nn.common.dev_f32 / dev_back), here on
    DeviceArrays of the CPU: converted to float32 on the device, the result back in the 16-bit
    dtype; float32 passes through untouched (no copy)."""
    from tpcore.nn.common import dev_back, dev_f32
    x = (np.random.default_rng(6).standard_normal((3, 5))).astype(np.float32).astype(BF16)
    xa = tpcore.asarray(x, device="cpu", copy=True)
    x32, dt = dev_f32(xa)
    assert dt == "bfloat16" and x32.dtype == "float32" and x32.shape == (3, 5)
    assert np.array_equal(host(x32), x.astype(np.float32))
    back = dev_back(x32, dt)
    assert back.dtype == "bfloat16" and np.array_equal(host(back).view(np.uint16), x.view(np.uint16))
    f = dev(np.ones((2, 2), np.float32))
    same, none = dev_f32(f)
    assert same is f and none is None and dev_back(f, None) is f
