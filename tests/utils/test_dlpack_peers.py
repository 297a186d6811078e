"""DLPack round trips between real libraries and tpcore (test_dlpack.py covers the
consumer and producer with hand-built capsules): NumPy -> tpcore -> PyTorch -> NumPy with
the same memory all the way; torch.bfloat16 through tpcore's own consumer (NumPy's refuses
it) into tpcore.from_dlpack and into the layers; clear errors where the memory cannot be
shared (negative strides, a read-only view asked to be writable, unsupported dtypes, a GPU
tensor on a CPU-only path).  JAX and CuPy where installed."""
import numpy as np
import pytest

import tpcore
from conftest import run

torch = pytest.importorskip("torch")

DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int32", "int64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_tpcore_torch_numpy_share_one_buffer(dtype):
    a = (np.arange(12) * 3 % 7).astype(dtype).reshape(3, 4)
    d = tpcore.from_dlpack(a)
    t = torch.from_dlpack(d)
    b = np.from_dlpack(t)
    assert d.data_ptr == a.ctypes.data == t.data_ptr() == b.ctypes.data
    assert d.dtype == dtype and tuple(t.shape) == (3, 4) and b.dtype == a.dtype
    np.testing.assert_array_equal(b, a)
    t[1, 2] = 5  # a write through torch is seen by NumPy: one buffer
    assert a[1, 2] == 5 and d.to_numpy()[1, 2] == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8])
def test_torch_tpcore_torch_and_writes_through_tpcore(dtype):
    t = torch.arange(10).to(dtype)
    d = tpcore.from_dlpack(t, writable=True)
    assert d.data_ptr == t.data_ptr() and not d.readonly
    view = d.numpy()  # a NumPy view of the same memory (no copy on the CPU)
    assert view.ctypes.data == t.data_ptr()
    view[3] = 9
    assert t[3].item() == 9
    back = torch.from_dlpack(d)
    assert back.data_ptr() == t.data_ptr() and torch.equal(back, t)


def test_torch_bfloat16_through_tpcores_own_consumer():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with pytest.raises((BufferError, RuntimeError, TypeError)):  # NumPy's consumer has no bfloat16
        np.from_dlpack(x)
    d = tpcore.from_dlpack(x)
    assert d.dtype == "bfloat16" and d.shape == (4, 6) and d.data_ptr == x.data_ptr()
    back = torch.from_dlpack(d)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == x.data_ptr() and torch.equal(back, x)
    # converted by tpcore in C: exactly torch's own widening of bfloat16
    f = tpcore.DeviceArray((4, 6), "float32")
    tpcore._C.convert(d, None, f)
    assert torch.equal(torch.from_dlpack(f), x.float())
    # and tpcore.asarray keeps the memory when no conversion is asked
    assert tpcore.asarray(x).data_ptr == x.data_ptr()


def test_bfloat16_to_numpy_needs_ml_dtypes_or_says_so():
    d = tpcore.from_dlpack(torch.ones(3, dtype=torch.bfloat16))
    try:
        import ml_dtypes
    except ImportError:
        with pytest.raises(TypeError, match="ml_dtypes"):
            d.to_numpy()
        return
    a = d.to_numpy()
    assert a.dtype == np.dtype(ml_dtypes.bfloat16) and a.ctypes.data == d.data_ptr
    np.testing.assert_array_equal(a.astype(np.float32), np.ones(3, np.float32))


def _bf16_layers_case(comm):
    """tpcore's layers take torch bfloat16 tensors (through tpcore's consumer), compute in
    float32 and give a bfloat16 tpcore.DeviceArray back."""
    g = torch.Generator().manual_seed(1)
    lin = tpcore.ColumnParallelLinear(6, 5, comm, gather_output=True, seed=2)
    W, b = lin.gather_full()
    x = torch.randn(3, 6, generator=g).to(torch.bfloat16)
    y = lin(x)
    assert isinstance(y, tpcore.DeviceArray) and y.dtype == "bfloat16" and y.shape == (3, 5)
    ref = x.double() @ torch.from_numpy(W).double().T + torch.from_numpy(b).double()
    got = torch.from_dlpack(y)
    assert got.dtype == torch.bfloat16
    assert (got.double() - ref).abs().max().item() <= 1e-2 * (1 + ref.abs().max().item())
    dy = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    lin.zero_grad()
    dx = torch.from_dlpack(lin.backward(dy))
    want = dy.double() @ torch.from_numpy(W).double()
    assert dx.dtype == torch.bfloat16
    assert (dx.double() - want).abs().max().item() <= 1e-2 * (1 + want.abs().max().item())
    off, loc = lin.partition[comm.rank]
    np.testing.assert_allclose(lin.grad_weight, (dy.double().T @ x.double())[off:off + loc].numpy(), rtol=1e-5,
                               atol=1e-5)
    mlp = tpcore.ParallelMLP(6, 7, comm, seed=3)
    z = torch.from_dlpack(mlp(x))
    z32 = torch.from_numpy(mlp(x.float().numpy()))
    assert z.dtype == torch.bfloat16 and torch.equal(z, z32.to(torch.bfloat16))
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_layers_take_torch_bfloat16(world):
    assert run(_bf16_layers_case, world) == [True] * world


def test_negative_and_non_contiguous_strides_refused():
    a = np.arange(6, dtype=np.float32)
    with pytest.raises(ValueError, match=r"C-contiguous, got shape \(6,\) with strides \(-4,\)"):
        tpcore.from_dlpack(a[::-1])
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with pytest.raises(ValueError, match="C-contiguous"):
        tpcore.from_dlpack(t[:, ::2])
    d = tpcore.from_dlpack(t[1:])  # a contiguous slice: a byte offset, still no copy
    assert d.data_ptr == t[1:].data_ptr()


def _strided_bf16_case(comm):
    lin = tpcore.ColumnParallelLinear(6, 5, comm)
    x = torch.randn(6, 4).to(torch.bfloat16)
    for bad in (x.t(), torch.randn(4, 12).to(torch.bfloat16)[:, ::2]):
        # the layout is the reason, not the dtype (NumPy's consumer would say "Unsupported dtype")
        with pytest.raises(ValueError, match=r"ColumnParallelLinear: x must be C-contiguous, got shape \(4, 6\)"):
            lin(bad)
    want = lin(x.t().float().numpy().copy())
    got = torch.from_dlpack(lin(x.t().contiguous()))  # contiguous: through tpcore's consumer
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.from_numpy(want).to(torch.bfloat16))
    return True


def test_strided_bfloat16_tensor_to_a_layer_names_the_layout():
    assert run(_strided_bf16_case, 1) == [True]


def test_read_only_memory_is_not_handed_out_as_writable():
    a = np.arange(4, dtype=np.float32)
    a.flags.writeable = False
    d = tpcore.from_dlpack(a)
    assert d.readonly and d.data_ptr == a.ctypes.data
    with pytest.raises(ValueError, match="read-only"):
        tpcore.from_dlpack(a, writable=True)
    with pytest.raises(ValueError, match="read-only"):
        tpcore.from_dlpack(d, writable=True)
    assert not np.from_dlpack(d).flags.writeable  # NumPy honours the flag tpcore exports


@pytest.mark.parametrize("dtype,name", [(torch.complex64, "complex64"), (torch.bool, "bool8"),
                                        (torch.int16, "int16")])
def test_unsupported_torch_dtypes_named(dtype, name):
    with pytest.raises(TypeError, match=f"from_dlpack: x has dtype {name}, which tpcore does not take"):
        tpcore.from_dlpack(torch.zeros(3, dtype=dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or getattr(tpcore, "cuda_available", lambda: False)(),
                    reason="needs a CUDA tensor and a tpcore without CUDA")
def test_torch_cuda_tensor_on_a_cpu_only_tpcore():
    t = torch.ones(3, device="cuda")
    with pytest.raises(TypeError, match="CUDA"):
        tpcore.from_dlpack(t)


def test_jax_round_trip():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    d = tpcore.from_dlpack(x)
    assert d.shape == (2, 3) and d.dtype == "float32"
    np.testing.assert_array_equal(d.to_numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert d.data_ptr == x.unsafe_buffer_pointer()  # no copy
    b = tpcore.from_dlpack(jnp.ones(4, dtype=jnp.bfloat16))
    assert b.dtype == "bfloat16"
    back = jnp.from_dlpack(tpcore.asarray(np.arange(3, dtype=np.float32)))
    np.testing.assert_array_equal(np.asarray(back), np.arange(3, dtype=np.float32))


def test_cupy_arrays():
    cp = pytest.importorskip("cupy")
    x = cp.arange(6, dtype=cp.float32)
    if getattr(tpcore, "cuda_available", lambda: False)():
        d = tpcore.from_dlpack(x)
        assert d.data_ptr == x.data.ptr and d.device.startswith("cuda")
        assert cp.from_dlpack(d).data.ptr == x.data.ptr
    else:
        with pytest.raises(TypeError, match="CUDA"):
            tpcore.from_dlpack(x)
