"""Device-aware array import (tpcore/_array.py): every entry point that takes arrays
refuses a tensor on another DLPack device by name ("x is a CUDA tensor (DLPack device
cuda:0); this build of tpcore has no CUDA support ..."), and reports a producer whose
__dlpack__ fails, instead of failing inside NumPy.  Host tensors are imported without a
copy."""
import numpy as np
import pytest

import tpcore
from conftest import DLPackOnly, run
from tpcore.utils import arrays as _array

CFG = dict(vocab_size=50, hidden=16, layers=1, heads=2, ffn_hidden=24, max_positions=32)


class OnDevice:
    """A tensor of another library on DLPack device (type, id): only its device can be read."""

    def __init__(self, shape=(4, 16), device=(2, 0)):
        self.shape, self.ndim, self._dev = tuple(shape), len(shape), device

    def __dlpack__(self, **kw):
        raise AssertionError("a device tensor must not be imported")

    def __dlpack_device__(self):
        return self._dev


class Broken:
    """A CPU producer whose __dlpack__ raises."""

    def __init__(self, shape=(4, 16)):
        self.shape, self.ndim = tuple(shape), len(shape)

    def __dlpack__(self, **kw):
        raise BufferError("the producer refuses to export")

    def __dlpack_device__(self):
        return (1, 0)


def _calls(comm, make):
    """(label, argument name, call) for every entry point family, the argument made by make(shape)."""
    x16 = np.ones((4, 16), np.float32)
    col = tpcore.ColumnParallelLinear(16, 8, comm, seed=1)
    row = tpcore.RowParallelLinear(8, 16, comm, seed=1)
    mlp = tpcore.ParallelMLP(16, 24, comm)
    emb = tpcore.VocabParallelEmbedding(50, 16, comm)
    ce = tpcore.VocabParallelCrossEntropy(comm)
    cfg = tpcore.Config(**CFG)
    blk = tpcore.TransformerBlock(cfg, comm)
    lm = tpcore.models.TransformerLM(cfg, comm)
    ids = np.array([[1, 2, 3, 4]], np.int64)
    full_blk = blk.gather_full()
    sd = lm.state_dict_full()
    col(x16)
    ce(np.zeros((4, 50), np.float32), np.zeros(4, np.int64))
    blk(x16.reshape(1, 4, 16))
    g = np.zeros(4, np.float32)
    return [
        # the collectives
        ("all_reduce", "x", lambda: comm.all_reduce(make((4,)))),
        ("all_reduce out", "out", lambda: comm.all_reduce(np.ones(4, np.float32), out=make((4,)))),
        ("all_gather", "x", lambda: comm.all_gather(make((4,)))),
        ("all_gather out", "out", lambda: comm.all_gather(np.ones(4, np.float32), out=make((4,)))),
        ("reduce_scatter", "x", lambda: comm.reduce_scatter(make((4,)))),
        ("broadcast", "x", lambda: comm.broadcast(make((4,)))),
        ("reduce", "x", lambda: comm.reduce(make((4,)))),
        ("send", "x", lambda: comm.send(make((4,)), 0)),
        ("recv", "x", lambda: comm.recv(make((4,)), 0)),
        ("sendrecv", "x", lambda: comm.sendrecv(make((4,)), 0, np.ones(4, np.float32), 0)),
        # the layers
        ("ColumnParallelLinear", "x", lambda: col(make((4, 16)))),
        ("ColumnParallelLinear.backward", "dy", lambda: col.backward(make((4, 8)))),
        ("ColumnParallelLinear.load_full", "W", lambda: col.load_full(make((8, 16)), np.zeros(8, np.float32))),
        ("ColumnParallelLinear.load_full b", "b", lambda: col.load_full(np.zeros((8, 16), np.float32), make((8,)))),
        ("RowParallelLinear", "x", lambda: row(make((4, 8)))),
        ("RowParallelLinear.load_full", "W", lambda: row.load_full(make((16, 8)), np.zeros(16, np.float32))),
        ("ParallelMLP", "x", lambda: mlp(make((4, 16)))),
        ("VocabParallelEmbedding", "tokens", lambda: emb(make((4,)))),
        ("VocabParallelEmbedding.backward", "dout", lambda: emb.backward(make((4, 16)))),
        ("VocabParallelEmbedding.load_full", "table", lambda: emb.load_full(make((50, 16)))),
        ("cross entropy", "logits_shard", lambda: ce(make((4, 50)), np.zeros(4, np.int64))),
        ("cross entropy targets", "targets", lambda: ce(np.zeros((4, 50), np.float32), make((4,)))),
        ("cross entropy backward", "dloss", lambda: ce.backward(make((4,)))),
        ("cross entropy backward out", "out", lambda: ce.backward(1.0, out=make((4, 50)))),
        # the transformer block
        ("TransformerBlock", "x", lambda: blk(make((1, 4, 16)))),
        ("TransformerBlock pos0", "pos0", lambda: blk(x16.reshape(1, 4, 16), pos0=make((1,)))),
        ("TransformerBlock key_mask", "key_mask", lambda: blk(x16.reshape(1, 4, 16), key_mask=make((1, 4)))),
        ("TransformerBlock.backward", "dy", lambda: blk.backward(make((1, 4, 16)))),
        ("TransformerBlock.load_full", "attn.q.weight",
         lambda: blk.load_full(dict(full_blk, **{"attn.q.weight": make((16, 16))}))),
        # the models
        ("TransformerLM.forward", "tokens", lambda: lm.forward(make((1, 4)))),
        ("TransformerLM.forward mask", "attention_mask", lambda: lm.forward(ids, attention_mask=make((1, 4)))),
        ("TransformerLM.loss", "targets", lambda: lm.loss(ids, make((1, 4)))),
        ("TransformerLM.generate", "prompts", lambda: lm.generate(make((1, 4)), max_new_tokens=1)),
        ("TransformerLM.generate list", "prompt 0", lambda: lm.generate([make((4,))], max_new_tokens=1)),
        # loading parameters (what checkpoint readers hand over)
        ("TransformerLM.load_state_dict_full", "wte.weight",
         lambda: lm.load_state_dict_full(dict(sd, **{"wte.weight": make((50, 16))}))),
        ("TransformerLM.load_state_dict_full block", "blocks.0.mlp.fc2.weight",
         lambda: lm.load_state_dict_full(dict(sd, **{"blocks.0.mlp.fc2.weight": make((16, 24))}))),
        ("optimizer", "param", lambda: tpcore.optim.SGD([(make((4,)), g)])),
    ]


def _device_case(comm):
    out = []
    for label, arg, call in _calls(comm, lambda shape: OnDevice(shape)):
        try:
            call()
            out.append((label, arg, None, "no error"))
        except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
            out.append((label, arg, type(e).__name__, str(e)))
    return out


def test_a_cuda_tensor_is_refused_by_name_everywhere():
    bad = []
    for label, arg, etype, msg in run(_device_case, 1)[0]:
        want = f"{arg} is a CUDA tensor (DLPack device cuda:0); this build of tpcore has no CUDA support " \
               f"(tpcore.build_info() lists the devices: cpu)"
        if etype != "TypeError" or want not in msg:
            bad.append(f"{label}: {etype}: {msg}")
    assert not bad, "\n".join(bad)


# the entry points that import a host tensor (the optimizer and the cross entropy's logits take
# NumPy arrays only, as before)
def _broken_case(comm):
    out = []
    for label, arg, call in _calls(comm, lambda shape: Broken(shape)):
        if label in ("optimizer", "cross entropy", "cross entropy backward out"):
            continue
        try:
            call()
            out.append((label, arg, None, "no error"))
        except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
            out.append((label, arg, type(e).__name__, str(e)))
    return out


def test_a_failing_dlpack_producer_is_reported():
    bad = []
    for label, arg, etype, msg in run(_broken_case, 1)[0]:
        if etype != "TypeError" or f"{arg} could not be imported through DLPack" not in msg or \
                "the producer refuses to export" not in msg:
            bad.append(f"{label}: {etype}: {msg}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dev,kind,text", [((10, 1), "ROCm", "rocm:1"), ((8, 0), "Metal", "metal:0"),
                                           ((99, 2), "DLPack device type 99", "dlpack-device-99:2")])
def test_other_devices_are_named(dev, kind, text):
    with pytest.raises(TypeError, match=rf"op: t is a {kind} tensor \(DLPack device {text}\); this build of tpcore has "
                                        rf"no {kind} support"):
        _array.as_array(OnDevice((3,), dev), "t", "op")


@pytest.mark.parametrize("dev", [(1, 0), (3, 0), (11, 0), (13, 0)])
def test_host_memory_devices_pass_the_check(dev):
    _array.check_host(OnDevice((3,), dev), "t", "op")  # CPU, CUDA/ROCm pinned host, CUDA managed


def test_host_tensors_are_imported_without_a_copy():
    a = np.arange(6, dtype=np.float32)
    for f in (_array.as_array, _array.asarray):
        b = f(DLPackOnly(a), "x", "op")
        assert isinstance(b, np.ndarray) and np.shares_memory(a, b)
    assert _array.as_array(a, "x", "op") is a
    assert tpcore.distributed.comm.as_array is _array.as_array  # the old name still works


def test_build_info_lists_the_devices():
    assert "cpu" in tpcore.build_info()["devices"]


def _torch_case(comm):
    import torch
    lin = tpcore.ColumnParallelLinear(8, 4, comm, gather_output=True, seed=2)
    x = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    y_t = lin(x)
    y_np = lin(x.numpy())
    t = torch.arange(4, dtype=torch.float32)
    comm.all_reduce(t)  # in place on the tensor's memory
    lin.load_full(torch.ones(4, 8), torch.zeros(4))
    ones = lin(np.ones((1, 8), np.float32))
    return bool(np.array_equal(y_t, y_np)), t.tolist(), ones.tolist()


def test_real_torch_cpu_tensors():
    pytest.importorskip("torch")
    same, t, ones = run(_torch_case, 1)[0]
    assert same and t == [0.0, 1.0, 2.0, 3.0] and ones == [[8.0] * 4]
