"""Checkpoints: full tensors saved at one world size load at every other
(resharding), sharded files round-trip at the same layout, both formats;
our safetensors files read back with the official `safetensors` package and
its files with ours; mismatched shapes and layouts give clear errors."""
import numpy as np
import pytest

import tpcore
from tpcore.io import formats
from conftest import rng_for, run


def _model(comm, seed, uneven=False):
    part = tpcore.partition(40, comm.size, weights=[1 + r for r in range(comm.size)]) if uneven else None
    return {"emb": tpcore.VocabParallelEmbedding(101, 12, comm, seed=seed),
            "mlp": tpcore.ParallelMLP(12, 40, comm, activation="swiglu", partition=part, seed=seed),
            "head": tpcore.ColumnParallelLinear(12, 101, comm, bias=False, seed=seed)}


def _forward(model, tokens):
    h = model["emb"](tokens)
    return model["head"](model["mlp"](h))


def _save_full(comm, path):
    m = _model(comm, seed=1)
    tpcore.save(m, path, comm)
    return _full_logits(comm, m)


def _full_logits(comm, m):
    tokens = rng_for(3, 0).integers(0, 101, (2, 5))
    shard = _forward(m, tokens)
    return comm.all_gather(np.ascontiguousarray(shard.reshape(-1, shard.shape[-1])).T.copy(),
                           sizes=[s for _, s in m["head"].partition]).T


def _load_full(comm, path, uneven):
    m = _model(comm, seed=99, uneven=uneven)  # different init: everything must come from the file
    tpcore.load(m, path, comm)
    return _full_logits(comm, m)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_full_checkpoint_reshards(tmp_path, suffix):
    path = str(tmp_path / f"model{suffix}")
    ref = run(_save_full, 4, path)[0]
    for world in (1, 2, 3):
        for uneven in (False, True):
            for r, got in enumerate(run(_load_full, world, path, uneven)):
                assert np.allclose(got, ref, rtol=1e-5, atol=1e-5), (world, uneven, r)


def _sharded_roundtrip(comm, path):
    m = _model(comm, seed=5, uneven=True)
    tpcore.save(m, path, comm, sharded=True)
    before = _full_logits(comm, m)
    m2 = _model(comm, seed=6, uneven=True)
    tpcore.load(m2, path, comm, sharded=True)
    after = _full_logits(comm, m2)
    other = _model(comm, seed=7, uneven=False)
    try:
        tpcore.load(other, path, comm, sharded=True)
        err = "no error"
    except ValueError as e:
        err = str(e)
    return bool(np.array_equal(before, after)), err


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_sharded_checkpoint_roundtrip(tmp_path, suffix):
    path = str(tmp_path / f"model{suffix}")
    for r, (same, err) in enumerate(run(_sharded_roundtrip, 3, path)):
        assert same, f"rank {r}"
        assert "partition" in err and "full checkpoint" in err, err
    assert (tmp_path / f"model.rank2-of-3{suffix}").exists()
    with pytest.raises(FileNotFoundError, match="world size"):
        run(lambda comm: tpcore.load(_model(comm, 1, True), path, comm, sharded=True), 2)


def test_safetensors_interoperates_with_the_official_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    g = rng_for(8, 0)
    tensors = {"a.weight": g.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.int64),
               "c": g.standard_normal(4)}
    ours = str(tmp_path / "ours.safetensors")
    formats.write_safetensors(ours, tensors, {"k": "v"})
    back = st.load_file(ours)
    assert set(back) == set(tensors) and all(np.array_equal(back[k], tensors[k]) for k in tensors)
    theirs = str(tmp_path / "theirs.safetensors")
    st.save_file(tensors, theirs, metadata={"x": "y"})
    got, meta = formats.read_safetensors(theirs)
    assert meta == {"x": "y"} and all(np.array_equal(got[k], tensors[k]) for k in tensors)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match="safetensors"):
        formats.read_safetensors(str(bad))
    bad.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header"):
        formats.read_safetensors(str(bad))
    with pytest.raises(ValueError, match=".npz or .safetensors"):
        run(lambda comm: tpcore.save(_model(comm, 1), str(tmp_path / "x.bin"), comm), 1)
    # a full checkpoint of other shapes
    path = str(tmp_path / "small.npz")
    run(lambda comm: tpcore.save({"head": tpcore.ColumnParallelLinear(12, 50, comm)}, path, comm), 1)
    with pytest.raises(ValueError, match="shape"):
        run(lambda comm: tpcore.load({"head": tpcore.ColumnParallelLinear(12, 51, comm)}, path, comm), 2)


def test_from_pretrained_says_it_takes_a_local_directory(tmp_path):
    """A hub id (no such directory) is explained: tpcore reads local directories, and how to get one."""
    def case(comm, path):
        try:
            tpcore.models.from_pretrained(path, comm)
        except FileNotFoundError as e:
            return str(e)
        return None
    hub = tpcore.spawn(case, 1, args=("openai-community/gpt2",))[0]
    assert "does not download from the Hugging Face hub" in hub and \
        "huggingface-cli download openai-community/gpt2" in hub
    missing = tpcore.spawn(case, 1, args=(str(tmp_path / "nope"),))[0]
    assert "is not a directory" in missing and "hub" not in missing
    f = tmp_path / "file.safetensors"
    f.write_bytes(b"x")
    assert "is not a directory" in tpcore.spawn(case, 1, args=(str(f),))[0]
