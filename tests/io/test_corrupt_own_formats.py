"""Corrupt and lying files of tpcore's own formats: save_pretrained's full and sharded
checkpoints, the layers' npz and safetensors checkpoints and their metadata, the models' own
tensor shapes, and special files (FIFOs, devices, directories) refused without being read.
Hugging Face checkpoints and config.json: test_corrupt_files.py."""
import json
import os
import shutil
import struct
import tracemalloc
import zipfile

import numpy as np
import pytest

import tpcore
from tpcore import CheckpointError
from tpcore.io.formats import write_safetensors
from conftest import run
from corrupt_common import FIX, load_model, must_raise, read_tensors


@pytest.fixture(scope="module")
def comm():
    with tpcore.init() as c:
        yield c



# ---------------------------------------------------------- tpcore's own formats
def _own(tmp_path, comm, sharded=False):
    cfg = tpcore.Config.from_hf(os.path.join(FIX, "llama"))
    d = tmp_path / ("own-sharded" if sharded else "own")
    tpcore.models.TransformerLM(cfg, comm, seed=3).save_pretrained(str(d), sharded=sharded)
    return d


def _set_own(d, **kw):
    c = json.loads((d / "tpcore_config.json").read_text())
    c.update(kw)
    (d / "tpcore_config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("change,words", [
    ({"hidden": "32"}, ["hidden", "a string"]), ({"layers": 0}, ["layers"]), ({"eps": -1}, ["eps"]),
    ({"norm": "batchnorm"}, ["norm", "rmsnorm"]), ({"bias": 1}, ["bias", "true or false"]),
    ({"colour": 1}, ["colour", "unknown field"]), ({"heads": 5}, ["config", "multiple"]),
    ({"vocab_size": 4_000_000}, ["wte.weight", "vocab_size=4000000"]),
    ({"max_positions": 5_000_000, "positions": "learned"}, ["wpe.weight", "max_positions=5000000"]),
    ({"qkv_bias": True}, ["attn.q.bias", "no such tensor"]), ({"layers": 1}, ["blocks.1.", "layers 0 to 0"]),
    ({"tie_embeddings": True}, ["lm_head.weight", "no place"])])
def test_own_format_full(tmp_path, comm, change, words):
    d = _own(tmp_path, comm)
    _set_own(d, **change)
    tracemalloc.start()
    try:
        must_raise(lambda: load_model(comm, d), *words)
        assert tracemalloc.get_traced_memory()[1] < (4 << 20)
    finally:
        tracemalloc.stop()


def test_own_format_sharded(tmp_path, comm):
    d = _own(tmp_path, comm, sharded=True)
    load_model(comm, d)
    st = d / "model.rank0-of-1.safetensors"
    good = st.read_bytes()
    _set_own(d, vocab_size=4_000_000)
    tracemalloc.start()
    try:
        must_raise(lambda: load_model(comm, d), "tpcore_config.json", "sizes", "vocab_size=4000000")
        assert tracemalloc.get_traced_memory()[1] < (4 << 20)
    finally:
        tracemalloc.stop()
    _set_own(d, vocab_size=128)
    t = read_tensors(str(st))
    for mutate, words in ((lambda t: t.update({"param.999": np.ones(2, np.float32)}), ["param.999", "unexpected"]),
                          (lambda t: t.update({"extra": np.ones(2, np.float32)}), ["'extra'", "param.<i>"]),
                          (lambda t: t.update({"param.0": t["param.0"].reshape(32, 128)}), ["param.0", "(32, 128)"]),
                          (lambda t: t.update({"param.1": t["param.1"].astype(np.int64)}), ["param.1", "dtype"])):
        u = dict(t)
        mutate(u)
        write_safetensors(str(st), u, {"format": "tpcore-sharded", "world": "1", "rank": "0"})
        must_raise(lambda: load_model(comm, d), "model.rank0-of-1.safetensors", *words)
    write_safetensors(str(st), t, {"format": "tpcore-sharded", "world": "1", "rank": "1"})
    must_raise(lambda: load_model(comm, d), "__metadata__['rank']")
    st.write_bytes(good[:-3])
    must_raise(lambda: load_model(comm, d), "model.rank0-of-1.safetensors")
    st.write_bytes(good)
    (d / "tpcore_config.json").write_bytes(b"\x80")
    must_raise(lambda: load_model(comm, d), "tpcore_config.json", "UTF-8")


def _tp_load(path, sharded=False):
    """tpcore.load on a fresh 1-rank communicator: a failed load aborts its communicator
    (so that the other ranks do not wait), as the collective contract says."""
    with tpcore.init() as c:
        tpcore.load(_layers_model(c), path, c, sharded=sharded)


def _layers_model(comm):
    return {"emb": tpcore.VocabParallelEmbedding(11, 4, comm, seed=1),
            "mlp": tpcore.ParallelMLP(4, 6, comm, activation="swiglu", seed=1)}


def _npz_members(path):
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def _write_npz(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for k, v in members.items():
            z.writestr(k, v)


def _npy(a):
    import io
    b = io.BytesIO()
    np.save(b, a, allow_pickle=True)
    return b.getvalue()


def test_layer_checkpoints_npz(tmp_path, comm):
    path = str(tmp_path / "m.npz")
    tpcore.save(_layers_model(comm), path, comm)
    _tp_load(path)
    good = _npz_members(path)
    w = "mlp.fc1.weight.npy"

    def case(members, *words):
        _write_npz(path, members)
        must_raise(lambda: _tp_load(path), "m.npz", *words)
    case({k: v for k, v in good.items() if k != w}, "mlp.fc1.weight", "no such tensor")
    case(dict(good, **{"mlp.fc3.weight.npy": good[w]}), "mlp.fc3.weight", "unexpected")
    case(dict(good, **{w: _npy(np.ones((12, 3), np.float32))}), "mlp.fc1.weight", "(12, 4)", "(12, 3)")
    case(dict(good, **{w: _npy(np.ones((12, 4), np.int64))}), "mlp.fc1.weight", "dtype", "int64")
    case(dict(good, **{w: _npy(np.array([["a"] * 4] * 12))}), "mlp.fc1.weight", "dtype")
    case(dict(good, **{w: _npy(np.array([{"x": 1}] * 48, dtype=object).reshape(12, 4))}), "mlp.fc1.weight", "pickled")
    case(dict(good, **{"notes.txt": b"hello"}), "notes.txt", ".npy")
    case(dict(good, **{"__metadata__.npy": _npy(np.array("{not json"))}), "__metadata__", "valid JSON")
    case(dict(good, **{"__metadata__.npy": _npy(np.array("[1]"))}), "__metadata__", "JSON object")
    case(dict(good, **{"__metadata__.npy": _npy(np.arange(3))}), "__metadata__", "unicode")
    # a .npy header that lies about its shape: refused from the sizes, nothing allocated
    hdr = good[w][:good[w].index(b"\n") + 1].replace(b"(12, 4)", b"(100000000, 40)").replace(b"\n", b"")
    hdr = hdr[:8] + struct.pack("<H", len(hdr) - 10 + 1) + hdr[10:] + b"\n"
    tracemalloc.start()
    try:
        case(dict(good, **{w: hdr + good[w][good[w].index(b"\n") + 1:]}), "mlp.fc1.weight", "bytes")
        assert tracemalloc.get_traced_memory()[1] < (4 << 20)
    finally:
        tracemalloc.stop()
    for cut in (0, 10, 100, len(open(path, "rb").read()) // 2):
        _write_npz(path, good)
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[:cut])
        must_raise(lambda: _tp_load(path), "m.npz")
    _write_npz(path, good)
    raw = bytearray(open(path, "rb").read())
    raw[raw.index(b"\x93NUMPY") + 200] ^= 0xFF          # a flipped data byte: the zip CRC fails
    open(path, "wb").write(bytes(raw))
    must_raise(lambda: _tp_load(path), "m.npz")


def test_npz_flipped_data_byte_of_a_large_member(tmp_path):
    """A flipped byte in the data of a member larger than zipfile's first read (members are
    read with pread on indexing, never through zipfile): its CRC is still checked."""
    path = str(tmp_path / "big.npz")

    def model(c):
        return {"emb": tpcore.VocabParallelEmbedding(1500, 24, c, seed=1),
                "mlp": tpcore.ParallelMLP(24, 200, c, activation="swiglu", seed=1)}
    with tpcore.init() as c:
        tpcore.save(model(c), path, c)
    good = _npz_members(path)
    for name in ("emb.weight.npy", "mlp.fc1.weight.npy", "mlp.fc2.weight.npy"):
        assert len(good[name]) > 16384
        _write_npz(path, good)
        raw = bytearray(open(path, "rb").read())
        raw[raw.index(good[name]) + len(good[name]) - 3] ^= 0x10
        open(path, "wb").write(bytes(raw))
        with tpcore.init() as c:
            must_raise(lambda: tpcore.load(model(c), path, c), "big.npz", name[:-4], "CRC")


def _sharded_npz(comm, path):
    m = _layers_model(comm)
    tpcore.save(m, path, comm, sharded=True)
    return tpcore.partition(6, comm.size)


def test_layer_checkpoints_sharded_metadata(tmp_path):
    path = str(tmp_path / "s.npz")
    run(_sharded_npz, 2, path)
    p1 = str(tmp_path / "s.rank1-of-2.npz")
    good = _npz_members(p1)
    for meta, words in (({"world": 2, "rank": 0, "partitions": {}}, ["__metadata__ 'rank'", "1"]),
                        ({"world": "2", "rank": 1}, ["'world'", "integer"]),
                        ({"world": 2, "rank": 1, "partitions": {"mlp.fc1.": [1, 2]}}, ["partitions", "pairs"]),
                        ({"world": 2, "rank": 1, "partitions": 5}, ["partitions"])):
        _write_npz(p1, dict(good, **{"__metadata__.npy": _npy(np.array(json.dumps(meta)))}))

        def load_model(comm):
            try:
                tpcore.load(_layers_model(comm), path, comm, sharded=True)
            except CheckpointError as e:
                return "CheckpointError: " + str(e)
            except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
                return f"{type(e).__name__}: {e}"
            return "loaded"
        msgs = run(load_model, 2)
        assert msgs[1].startswith("CheckpointError: ") and "s.rank1-of-2.npz" in msgs[1], msgs
        assert all(w in msgs[1] for w in words), (words, msgs[1])


def test_layer_checkpoints_safetensors_metadata(tmp_path, comm):
    path = str(tmp_path / "m.safetensors")
    tpcore.save(_layers_model(comm), path, comm)
    t = read_tensors(path)
    write_safetensors(path, t, {"tpcore": "{oops"})
    must_raise(lambda: _tp_load(path), "m.safetensors", "__metadata__['tpcore']")
    write_safetensors(path, dict(t, extra=np.ones(3, np.float32)), {"tpcore": "{}"})
    must_raise(lambda: _tp_load(path), "m.safetensors", "'extra'")


def test_expected_shapes_match_the_models_own_tensors(comm):
    from tpcore.models.hf import expected_shapes
    cfgs = [tpcore.Config.from_hf(os.path.join(FIX, n)) for n in ("gpt2", "llama", "bert")]
    cfgs += [tpcore.Config(vocab_size=50, hidden=16, layers=2, heads=4, kv_heads=2, norm="rmsnorm", bias=True,
                           activation="gelu", positions="rope", tie_embeddings=False, max_positions=32),
             tpcore.Config(vocab_size=50, hidden=16, layers=1, heads=2, norm="layernorm", bias=False,
                           activation="swiglu", positions="none", type_vocab_size=3, embedding_norm=True,
                           final_norm=False, max_positions=32)]
    for cfg in cfgs:
        sd = tpcore.models.TransformerLM(cfg, comm).state_dict_full()
        req, opt = expected_shapes(cfg, "tpcore")
        assert not opt and {k: tuple(v.shape) for k, v in sd.items()} == \
            {k: tuple(x for x, _ in dims) for k, dims in req.items()}, cfg


def _load_special(comm, path):
    try:
        tpcore.models.from_pretrained(path, comm, progress=False)
        return "loaded"
    except CheckpointError as e:
        return str(e)


@pytest.mark.parametrize("name, kind", [("config.json", "device"), ("config.json", "FIFO"),
                                        ("model.safetensors", "FIFO"), ("model.safetensors", "directory")])
def test_special_files_are_refused_without_reading_them(tmp_path, name, kind):
    """/dev/zero as config.json read forever (24 GB before the OOM killer); a FIFO blocked open() for good."""
    d = tmp_path / "ck"
    shutil.copytree(os.path.join(FIX, "gpt2"), d)
    os.unlink(d / name)
    if kind == "device":
        os.symlink("/dev/zero", d / name)
    elif kind == "FIFO":
        os.mkfifo(d / name)
    else:
        os.mkdir(d / name)
    from conftest import run
    [msg] = run(_load_special, 1, str(d), deadline=60)
    assert name in msg and "a regular file" in msg and f"a {kind}" in msg, msg
