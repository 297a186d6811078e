"""DLPack consumer (csrc/python/dlpack.c) and producer (tpcore.DeviceArray) on the CPU:
round trips with NumPy (and PyTorch when importable), versioned and legacy capsules,
and hand-built capsules (ctypes) for what no CPU producer makes: a CUDA tensor on a
machine without CUDA, read-only flags, unsupported dtypes, strides, byte_offset,
unknown versions.  Every hand-built capsule's deleter is counted: exactly once."""
import ctypes
import gc
import sys

import numpy as np
import pytest

import tpcore
from tpcore import _C


# ----------------------------------------------------------- ctypes mirror of the ABI
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


LegacyDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", LegacyDeleter)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


VersionedDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                                     ("deleter", VersionedDeleter), ("flags", ctypes.c_uint64),
                                     ("dl_tensor", DLTensor)]

READ_ONLY, IS_COPIED = 1, 2
kDLCPU, kDLCUDA = 1, 2
kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLComplex, kDLBool = 0, 1, 2, 4, 5, 6

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_capsule_ptr = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_ptr.restype = ctypes.c_void_p
_capsule_ptr.argtypes = [ctypes.py_object, ctypes.c_char_p]


class FakeProducer:
    """A hand-built managed tensor over a NumPy buffer; counts deleter calls.  The capsule
    has no destructor of its own, so only a consumer's call of the deleter counts."""

    def __init__(self, buf, shape, dtype=(kDLFloat, 32, 1), device=(kDLCPU, 0), strides=None, byte_offset=0,
                 versioned=True, flags=0, version=(1, 1)):
        self.buf = buf
        self.calls = 0
        n = len(shape)
        self.shape = (ctypes.c_int64 * max(n, 1))(*shape)
        self.strides = (ctypes.c_int64 * max(n, 1))(*strides) if strides is not None else None
        t = DLTensor(ctypes.c_void_p(buf.ctypes.data), DLDevice(*device), n, DLDataType(*dtype),
                     ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64)),
                     ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64)) if self.strides else None,
                     byte_offset)
        self.versioned = versioned
        if versioned:
            self.deleter = VersionedDeleter(self._delete)
            self.managed = DLManagedTensorVersioned(DLPackVersion(*version), None, self.deleter, flags, t)
            self.name = b"dltensor_versioned"
        else:
            self.deleter = LegacyDeleter(self._delete)
            self.managed = DLManagedTensor(t, None, self.deleter)
            self.name = b"dltensor"

    def _delete(self, _ptr):
        self.calls += 1

    def capsule(self):
        return _capsule_new(ctypes.addressof(self.managed), self.name, None)


def _collect():
    gc.collect()


# ------------------------------------------------------------------ NumPy round trips
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int8", "uint8", "int32", "int64"])
def test_numpy_round_trip_zero_copy(dtype):
    x = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    v = tpcore.from_dlpack(x)
    assert v.shape == (2, 3, 4) and v.dtype == dtype and v.device == "cpu:0"
    assert v.nbytes == x.nbytes and v.size == 24 and not v.owns_memory
    back = np.from_dlpack(v)
    assert np.shares_memory(back, x)
    np.testing.assert_array_equal(back, x)
    x[0, 0, 0] = 5
    assert back[0, 0, 0] == 5


@pytest.mark.parametrize("versioned", [True, False])
def test_numpy_capsules_versioned_and_legacy(versioned):
    x = np.arange(10, dtype=np.float32)
    cap = x.__dlpack__(max_version=(1, 0)) if versioned else x.__dlpack__()
    name = "dltensor_versioned" if versioned else "dltensor"
    assert _capsule_name(cap).decode() == name
    v = _C.from_dlpack(cap)
    assert _capsule_name(cap).decode() == "used_" + name
    np.testing.assert_array_equal(v.to_numpy(), x)
    with pytest.raises(TypeError, match="already consumed"):
        _C.from_dlpack(cap)


def test_numpy_read_only_refused_as_output():
    x = np.arange(4, dtype=np.float32)
    x.flags.writeable = False
    v = tpcore.from_dlpack(x)
    assert v.readonly
    with pytest.raises(ValueError, match="read-only"):
        tpcore.from_dlpack(x, writable=True)
    cap = x.__dlpack__(max_version=(1, 0))  # NumPy marks it read-only in the versioned capsule
    with pytest.raises(ValueError, match="read-only"):
        _C.from_dlpack(cap, writable=True)


def test_producer_without_max_version_falls_back_to_legacy():
    calls = []

    class Old:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, stream=None):  # no max_version: a pre-2023 producer
            calls.append(stream)
            return self.a.__dlpack__()

        def __dlpack_device__(self):
            return (kDLCPU, 0)

    x = np.arange(6, dtype=np.float64)
    v = tpcore.from_dlpack(Old(x))
    assert calls == [None]  # CPU: the consumer's stream is None
    np.testing.assert_array_equal(v.to_numpy(), x)


def test_torch_round_trip():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    v = tpcore.from_dlpack(t)
    assert v.shape == (3, 4) and v.data_ptr == t.data_ptr()
    back = torch.from_dlpack(v)
    assert back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)
    b16 = torch.ones(5, dtype=torch.bfloat16)
    assert tpcore.from_dlpack(b16).dtype == "bfloat16"
    with pytest.raises(ValueError, match="C-contiguous"):
        tpcore.from_dlpack(t.t())


# ------------------------------------------------------------ hand-built capsules
def test_fake_cuda_capsule_refused_and_deleted_once():
    if getattr(tpcore, "cuda_available", lambda: False)():
        pytest.skip("CUDA is available here: a fake CUDA pointer would be dereferenced")
    p = FakeProducer(np.zeros(4, np.float32), (4,), device=(kDLCUDA, 0))
    cap = p.capsule()
    with pytest.raises(RuntimeError, match="CUDA is not available") as ei:
        _C.from_dlpack(cap)
    assert "cuda:0" in str(ei.value)
    _collect()
    assert p.calls == 1
    del cap
    _collect()
    assert p.calls == 1


def test_fake_cuda_producer_refused_before_export():
    if getattr(tpcore, "cuda_available", lambda: False)():
        pytest.skip("CUDA is available here")
    exported = []

    class CudaTensor:
        def __dlpack_device__(self):
            return (kDLCUDA, 1)

        def __dlpack__(self, **kw):
            exported.append(kw)
            raise AssertionError("must not be exported")

    with pytest.raises(RuntimeError, match=r"x is a CUDA tensor \(cuda:1\) but CUDA is not available"):
        tpcore.from_dlpack(CudaTensor())
    assert exported == []


@pytest.mark.parametrize("versioned", [True, False])
def test_deleter_called_once_when_view_released(versioned):
    buf = np.arange(6, dtype=np.float32)
    p = FakeProducer(buf, (2, 3), versioned=versioned)
    v = _C.from_dlpack(p.capsule())
    n = v.to_numpy()  # a NumPy view keeps the DeviceArray (and the producer's tensor) alive
    np.testing.assert_array_equal(n, buf.reshape(2, 3))
    del v
    _collect()
    assert p.calls == 0
    assert n.sum() == 15
    del n
    _collect()
    assert p.calls == 1


def test_read_only_capsule_as_output_refused():
    p = FakeProducer(np.zeros(3, np.float32), (3,), flags=READ_ONLY)
    with pytest.raises(ValueError, match="read-only"):
        _C.from_dlpack(p.capsule(), writable=True, op="ColumnParallelLinear.forward", name="out")
    _collect()
    assert p.calls == 1
    p2 = FakeProducer(np.zeros(3, np.float32), (3,), flags=READ_ONLY)
    v = _C.from_dlpack(p2.capsule())  # reading is fine
    assert v.readonly
    with pytest.raises(ValueError, match="read-only"):
        v.to_numpy()[0] = 1
    del v
    _collect()
    assert p2.calls == 1


@pytest.mark.parametrize("dt,name", [((kDLInt, 16, 1), "int16"), ((kDLComplex, 64, 1), "complex64"),
                                     ((kDLBool, 8, 1), "bool8"), ((kDLFloat, 32, 4), "float32x4"),
                                     ((kDLUInt, 32, 1), "uint32"), ((kDLFloat, 8, 1), "float8"),
                                     ((42, 8, 1), "dtype code 42")])
def test_unsupported_dtype_named(dt, name):
    p = FakeProducer(np.zeros(8, np.float64), (2,), dtype=dt)
    with pytest.raises(TypeError, match="dtype " + name):
        _C.from_dlpack(p.capsule(), op="myop", name="w")
    _collect()
    assert p.calls == 1


def test_bfloat16_capsule_accepted():
    p = FakeProducer(np.zeros(4, np.uint16), (4,), dtype=(kDLBfloat, 16, 1))
    v = _C.from_dlpack(p.capsule())
    assert v.dtype == "bfloat16"
    del v
    _collect()
    assert p.calls == 1


def test_non_contiguous_refused():
    p = FakeProducer(np.zeros(12, np.float32), (3, 2), strides=(4, 2))
    with pytest.raises(ValueError, match=r"C-contiguous, got shape \(3, 2\) with strides \(4, 2\)"):
        _C.from_dlpack(p.capsule())
    _collect()
    assert p.calls == 1


def test_strides_of_size_one_dims_and_compact_strides_accepted():
    buf = np.arange(6, dtype=np.float32)
    p = FakeProducer(buf, (1, 6), strides=(99, 1))
    np.testing.assert_array_equal(_C.from_dlpack(p.capsule()).to_numpy(), buf.reshape(1, 6))
    p2 = FakeProducer(buf, (2, 3), strides=(3, 1))
    np.testing.assert_array_equal(_C.from_dlpack(p2.capsule()).to_numpy(), buf.reshape(2, 3))


def test_byte_offset_honoured():
    buf = np.arange(10, dtype=np.float32)
    p = FakeProducer(buf, (4,), byte_offset=8)
    v = _C.from_dlpack(p.capsule())
    np.testing.assert_array_equal(v.to_numpy(), np.array([2, 3, 4, 5], np.float32))
    assert v.data_ptr == buf.ctypes.data + 8


def test_misaligned_byte_offset_refused():
    p = FakeProducer(np.zeros(4, np.float32), (2,), byte_offset=2)
    with pytest.raises(ValueError, match="not aligned"):
        _C.from_dlpack(p.capsule())
    _collect()
    assert p.calls == 1


def test_too_many_dims_and_negative_shape_refused():
    p = FakeProducer(np.zeros(1, np.float32), (1,) * 9)
    with pytest.raises(ValueError, match="9 dimensions; at most 8"):
        _C.from_dlpack(p.capsule())
    p2 = FakeProducer(np.zeros(1, np.float32), (-1,))
    with pytest.raises(ValueError, match="negative dimension"):
        _C.from_dlpack(p2.capsule())
    _collect()
    assert p.calls == 1 and p2.calls == 1


def test_unknown_major_version_left_to_producer():
    p = FakeProducer(np.zeros(2, np.float32), (2,), version=(2, 0))
    cap = p.capsule()
    with pytest.raises(BufferError, match="version 2.0 is not supported"):
        _C.from_dlpack(cap)
    assert _capsule_name(cap) == b"dltensor_versioned"  # not taken: the producer still owns it
    _collect()
    assert p.calls == 0


def test_wrongly_named_capsule():
    cap = _capsule_new(ctypes.addressof(ctypes.c_int(0)), b"something_else", None)
    with pytest.raises(TypeError, match="named 'something_else'"):
        _C.from_dlpack(cap)


def test_zero_size_tensor():
    p = FakeProducer(np.zeros(1, np.float32), (0, 3))
    v = _C.from_dlpack(p.capsule())
    assert v.shape == (0, 3) and v.size == 0 and v.nbytes == 0
    assert v.to_numpy().shape == (0, 3)


# -------------------------------------------------------------------- the producer
def _flags(cap):
    m = DLManagedTensorVersioned.from_address(_capsule_ptr(cap, b"dltensor_versioned"))
    return m.flags, (m.version.major, m.version.minor), m.dl_tensor


def test_producer_versioned_and_legacy():
    a = tpcore.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    cap = a.__dlpack__(max_version=(1, 2))
    assert _capsule_name(cap) == b"dltensor_versioned"
    flags, ver, t = _flags(cap)
    assert flags == 0 and ver[0] == 1 and t.ndim == 2 and t.device.device_type == kDLCPU
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (kDLFloat, 32, 1)
    assert [t.shape[i] for i in range(2)] == [2, 3] and [t.strides[i] for i in range(2)] == [3, 1]
    legacy = a.__dlpack__()
    assert _capsule_name(legacy) == b"dltensor"
    assert _capsule_name(a.__dlpack__(max_version=(0, 8))) == b"dltensor"
    assert a.__dlpack_device__() == (kDLCPU, 0)


def test_producer_unconsumed_capsule_releases_array():
    a = tpcore.DeviceArray((4,))
    before = sys.getrefcount(a)
    caps = [a.__dlpack__(max_version=(1, 0)), a.__dlpack__()]
    assert sys.getrefcount(a) == before + 2
    del caps
    _collect()
    assert sys.getrefcount(a) == before


def test_producer_consumed_capsule_releases_array():
    a = tpcore.DeviceArray((4,))
    before = sys.getrefcount(a)
    n = np.from_dlpack(a)
    assert sys.getrefcount(a) == before + 1
    del n
    _collect()
    assert sys.getrefcount(a) == before


def test_producer_read_only():
    x = np.arange(3, dtype=np.float32)
    x.flags.writeable = False
    a = tpcore.asarray(x)
    flags, _, _ = _flags(a.__dlpack__(max_version=(1, 0)))
    assert flags & READ_ONLY
    with pytest.raises(BufferError, match="read-only"):
        a.__dlpack__()
    assert not np.from_dlpack(a).flags.writeable


def test_producer_copy_and_devices():
    a = tpcore.asarray(np.arange(3, dtype=np.float32))
    cap = a.__dlpack__(max_version=(1, 0), copy=True)
    flags, _, t = _flags(cap)
    assert flags & IS_COPIED and t.data != a.data_ptr
    flags, _, t = _flags(a.__dlpack__(max_version=(1, 0), copy=False, dl_device=(kDLCPU, 0)))
    assert not flags & IS_COPIED and t.data == a.data_ptr
    with pytest.raises(BufferError, match="copy=False"):
        a.__dlpack__(max_version=(1, 0), dl_device=(kDLCUDA, 0), copy=False)
    with pytest.raises(BufferError, match="device type 4"):
        a.__dlpack__(max_version=(1, 0), dl_device=(4, 0))
    with pytest.raises(ValueError, match="CPU array takes stream=None"):
        a.__dlpack__(stream=1)
    a.__dlpack__(stream=-1)
    with pytest.raises(TypeError, match="max_version"):
        a.__dlpack__(max_version=1)


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_tpcore_consumes_its_own_capsules(max_version):
    a = tpcore.asarray(np.arange(5, dtype=np.int64))
    before = sys.getrefcount(a)
    cap = a.__dlpack__() if max_version is None else a.__dlpack__(max_version=max_version)
    v = _C.from_dlpack(cap)
    assert v.data_ptr == a.data_ptr and v.dtype == "int64"
    np.testing.assert_array_equal(v.to_numpy(), np.arange(5))
    del cap
    _collect()
    assert sys.getrefcount(a) == before + 1  # the view's hold keeps the exporter alive
    del v
    _collect()
    assert sys.getrefcount(a) == before


CUDA = getattr(tpcore, "cuda_available", lambda: False)()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (tpcore.cuda_available() is False)")
def test_torch_cuda_round_trip_without_copies():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    v = tpcore.from_dlpack(t)
    assert v.device == "cuda:0" and v.data_ptr == t.data_ptr()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # torch passes its current stream: tpcore makes the data ready on it
        back = torch.from_dlpack(v)
    assert back.data_ptr() == t.data_ptr() and torch.equal(back, t)
    np.testing.assert_array_equal(v.to_numpy(), np.arange(12, dtype=np.float32).reshape(3, 4))
    d = tpcore.asarray(np.ones((2, 2), np.float32), device="cuda")
    assert torch.from_dlpack(d).sum().item() == 4.0
    with pytest.raises(ValueError, match="must be C-contiguous"):
        tpcore.from_dlpack(t.t())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (tpcore.cuda_available() is False)")
def test_cupy_cuda_round_trip_without_copies():
    cp = pytest.importorskip("cupy")
    x = cp.arange(6, dtype=cp.float32)
    v = tpcore.from_dlpack(x)
    assert v.data_ptr == x.data.ptr
    y = cp.from_dlpack(v)
    assert y.data.ptr == x.data.ptr and bool((y == x).all())
