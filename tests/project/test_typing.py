"""mypy --strict on a user's script over the public API reports nothing from tpcore's side.

The script is type-checked, never run: it touches init, the collectives, the layers,
Config / TransformerBlock, models.TransformerLM / from_pretrained, the optimizers, spawn,
Engine, the planner, Store, ProcessGrid and checkpoints.  tpcore is found through
PYTHONPATH, as an installed package is (mypy then checks the script against tpcore's
annotations and stubs, py.typed and _C.pyi, and does not report tpcore's own
internals).  assert_type pins what the API returns, so an annotation that decays to Any
(an untyped function, a missing stub) or a wrong one fails the test, not only a missing
one.  About 5-8 s cold on this VM (the mypy cache lives under tmp_path).
"""
import os
import subprocess
import sys
import textwrap
import time

import paths
import pytest

mypy = pytest.importorskip("mypy", reason="mypy is not installed (pip install 'tpcore[test]')")

PYTHON_DIR = str(paths.ROOT / "python")

USER_SCRIPT = '''
"""A user's tensor-parallel script (type-checked only)."""
from __future__ import annotations

from typing import Any, Optional, assert_type

import numpy as np
import numpy.typing as npt

import tpcore
from tpcore.models import lm as models
from tpcore.nn import optim
from tpcore.models import TransformerLM, from_pretrained


def collectives(comm: tpcore.Comm) -> float:
    x: npt.NDArray[np.float32] = np.ones(8, dtype=np.float32)
    assert_type(comm.all_reduce(x, op="sum"), npt.NDArray[np.float32])
    assert_type(comm.all_reduce(x, op="mean", out=np.empty_like(x)), npt.NDArray[np.float32])
    assert_type(comm.broadcast(x, root=0), npt.NDArray[np.float32])
    assert_type(comm.reduce(x, root=0, op="max"), npt.NDArray[np.float32])
    assert_type(comm.recv(x, 0), npt.NDArray[np.float32])
    assert_type(comm.sendrecv(x, 0, np.empty_like(x), 0), npt.NDArray[np.float32])
    comm.send(x, 0)
    gathered = comm.all_gather(x, axis=0, sizes=[8] * comm.size)
    assert_type(gathered, np.ndarray)
    scattered = comm.reduce_scatter(np.ones(8 * comm.size, np.float32), op="avg")
    assert_type(scattered, np.ndarray)
    assert_type(comm.all_gather(tpcore.asarray(x)), tpcore.DeviceArray)
    comm.barrier()
    sub = comm.split(comm.rank % 2, key=comm.rank)
    assert_type(sub, Optional[tpcore.Comm])
    if sub is not None:
        sub.close()
    shared = comm.alloc((4, 4), "float32")
    assert_type(shared, np.ndarray)
    assert_type(comm.stats(), dict[str, Any])
    assert_type(comm.history(), list[dict[str, Any]])
    assert_type(comm.rank, int)
    assert_type(comm.size, int)
    assert_type(comm.local_rank, int)
    assert_type(comm.backend, str)
    assert_type(comm.timeout, float)
    comm.timeout = 30.0
    assert_type(comm.closed, bool)
    print(gathered, scattered)
    return float(x[0])


def layers(comm: tpcore.Comm) -> None:
    part = tpcore.partition(64, comm.size, weights=[1.0] * comm.size, align=8)
    assert_type(part, list[tuple[int, int]])
    col = tpcore.ColumnParallelLinear(16, 64, comm, bias=True, gather_output=False, partition=part,
                                      dtype="bfloat16", seed=1, gated=True, device=None)
    row = tpcore.RowParallelLinear(64, 16, comm, input_is_parallel=True, partition=part, seed=1)
    assert_type(col.offset, int)
    # fresh NumPy arrays in, NumPy arrays out (a chained call's argument is an ndarray of
    # Any dtype, for which mypy's overload rules give Any: no error, but nothing to pin)
    h = col.forward(np.ones((4, 16), np.float32))
    assert_type(h, np.ndarray)
    y = row(h)
    assert_type(row(np.ones((4, col.local), np.float32)), np.ndarray)
    dx = col.backward(row.backward(np.ones((4, 16), np.float32)))
    assert_type(col.backward(np.ones((4, 2 * col.local), np.float32)), np.ndarray)
    W, b = col.gather_full()
    assert_type(W, np.ndarray)
    assert_type(b, Optional[np.ndarray])
    col.load_full(W, b)
    assert_type(col.parameters(), list[tuple[np.ndarray, np.ndarray]])
    mlp = tpcore.ParallelMLP(16, 64, comm, activation="swiglu", partition=[64 // comm.size] * comm.size)
    assert_type(mlp.fc1, tpcore.ColumnParallelLinear)
    adam = optim.AdamW(mlp, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    mlp.zero_grad()
    assert_type(mlp.forward(np.ones((2, 16), np.float32)), np.ndarray)
    assert_type(mlp.backward(np.ones((2, 16), np.float32)), np.ndarray)
    adam.step()
    optim.SGD(col.parameters(), lr=0.1, momentum=0.9).step()
    optim.ShardedAdamW(row.parameters(), comm, lr=1e-3).step()
    emb = tpcore.VocabParallelEmbedding(100, 16, comm, seed=3)
    e = emb.forward(np.array([[1, 2, 3]]))
    emb.backward(np.ones((1, 3, 16), np.float32))
    xent = tpcore.VocabParallelCrossEntropy(comm, ignore_index=-100)
    loss = xent.forward(np.ones((3, emb.local), np.float32), np.array([1, 2, 3]), vocab_offset=emb.offset)
    dlogits = xent.backward(1.0)
    l2 = tpcore.vocab_parallel_cross_entropy(np.ones((3, emb.local), np.float32), [1, 2, 3], comm)
    tpcore.save({"col": col, "row": row}, "/tmp/x.safetensors", comm)
    tpcore.load({"col": col, "row": row}, "/tmp/x.safetensors", comm, sharded=False)
    print(dx, e, loss, dlogits, l2)


def transformer(comm: tpcore.Comm) -> float:
    cfg = tpcore.Config(vocab_size=64, hidden=16, layers=2, heads=2, kv_heads=1, max_positions=32,
                        positions="rope", norm="rmsnorm", activation="swiglu", bias=False)
    assert_type(cfg.validate(), tpcore.Config)
    blk = tpcore.TransformerBlock(cfg, comm, seed=0, head_partition=None, dtype="float32")
    yb = blk.forward(np.ones((1, 4, 16), np.float32))
    assert_type(yb, np.ndarray)
    assert_type(blk(np.ones((1, 4, 16), np.float32)), np.ndarray)
    assert_type(blk.backward(np.ones((1, 4, 16), np.float32)), np.ndarray)
    full = blk.gather_full()
    assert_type(full, dict[str, np.ndarray])
    blk.load_full(full)
    attn = tpcore.ParallelAttention(cfg, comm)
    lm = models.TransformerLM(cfg, comm, seed=0)
    toks = np.array([[1, 2, 3, 4]])
    value = lm.loss(toks[:, :-1], toks[:, 1:])
    assert_type(value, float)
    lm.backward()
    assert_type(lm.logits(toks), np.ndarray)
    assert_type(lm.encode(toks), np.ndarray)
    out = lm.generate([[1, 2]], max_new_tokens=3, temperature=0.0)
    sd = lm.state_dict_full()
    lm.load_state_dict_full(sd)
    lm.save_pretrained("/tmp/model")
    again: TransformerLM = from_pretrained("/tmp/model", comm, progress=False)
    eng = tpcore.Engine(lm, max_batch=2, max_len=16)
    req = eng.submit([1, 2, 3], max_new_tokens=2)
    assert_type(req, tpcore.serve.Request)
    for done in eng.run():
        assert_type(done.tokens, np.ndarray)
        assert_type(done.ttft, Optional[float])
    assert_type(eng.step(), list[tpcore.serve.Request])
    plan = tpcore.plan_partition(comm, cfg, speeds=[1.0] * comm.size)
    assert_type(plan, tpcore.Plan)
    assert_type(plan.heads, list[int])
    plan.save("/tmp/plan.json")
    lm2 = models.TransformerLM(cfg, comm, plan=tpcore.Plan.load("/tmp/plan.json"))
    p2 = tpcore.plan_from_measurements(cfg, [1.0, 0.5])
    assert_type(p2.model_kwargs(), dict[str, list[int]])
    grid = tpcore.ProcessGrid(comm, tp=1)
    assert_type(grid.tp, tpcore.Comm)
    n_reduces: int = tpcore.average_gradients(lm2, grid.dp)
    pipe = tpcore.PipelineLM(cfg, grid)
    assert_type(pipe.train_step(toks[:, :-1], toks[:, 1:], micro_batches=1), float)
    assert_type(tpcore.stage_partition(4, 2), list[tuple[int, int]])
    print(yb, attn, out, again, n_reduces)
    return value


def main() -> None:
    results = tpcore.spawn(collectives, 2, deadline=60.0)
    assert_type(results, list[float])
    tpcore.spawn(layers, 2, args=(), kwargs={}, timeout=30.0)
    comm = tpcore.init(backend="shm", timeout=30.0, spin_us=100)
    assert_type(comm, tpcore.Comm)
    with comm:
        transformer(comm)
    assert_type(tpcore.__version__, str)
    assert_type(tpcore.build_info(), dict[str, Any])
    assert_type(tpcore.cuda_available(), bool)
    tpcore.set_num_threads(2)
    assert_type(tpcore.get_num_threads(), int)
    tpcore.set_throttle(1.0)
    assert_type(tpcore.get_throttle(), float)
    with tpcore.Store("127.0.0.1", 0, is_server=True, secret=b"0123456789abcdef") as store:
        store.set("a", b"b")
        assert_type(store.get("a"), bytes)
        assert_type(store.try_get("a"), Optional[bytes])
        assert_type(store.add("n", 1), int)
        store.wait(["a"])
        assert_type(store.port, int)
    arr = tpcore.asarray(np.ones(3, np.float32), device="cpu")
    assert_type(arr, tpcore.DeviceArray)
    assert_type(arr.shape, tuple[int, ...])
    assert_type(tpcore.from_dlpack(arr), tpcore.DeviceArray)
    assert_type(arr.to_numpy(), np.ndarray)
    try:
        pass
    except (tpcore.CommError, tpcore.CommTimeout, tpcore.RankExitedError, tpcore.CheckpointError,
            tpcore.PlanError) as err:
        print(err)


if __name__ == "__main__":
    main()
'''


@pytest.mark.slow  # mypy
def test_mypy_strict_on_a_user_script(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    env.pop("MYPYPATH", None)  # MYPYPATH would check tpcore's own source as the user's code
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "mypy_cache"),
                        "--no-error-summary", "--show-error-codes", str(script)],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    assert r.returncode == 0, f"mypy --strict found problems ({took:.1f} s):\n{r.stdout}{r.stderr}"
    assert r.stdout.strip() == "", r.stdout


@pytest.mark.slow  # mypy
def test_mypy_sees_tpcore_and_catches_misuse(tmp_path):
    """The check can fail: tpcore must be found (not silently Any), and a wrong use of its
    annotated API is reported."""
    script = tmp_path / "misuse.py"
    script.write_text(textwrap.dedent('''
        import tpcore

        def f(comm: tpcore.Comm) -> str:
            return comm.rank

        comm = tpcore.init(backend="shm", timeout="long")
        cfg: int = tpcore.Config()
        tpcore.ColumnParallelLinear(4, 4, comm, gather_output="yes")
        n: str = tpcore.get_num_threads()
    '''))
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    env.pop("MYPYPATH", None)
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "mypy_cache"),
                        "--show-error-codes", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout
    assert r.returncode == 1, out
    assert "import-not-found" not in out and "import-untyped" not in out, out
    for line in (5, 7, 8, 9, 10):
        assert f"misuse.py:{line}: error" in out, (line, out)


@pytest.mark.slow  # mypy's stubtest
def test_extension_stubs_match_the_extension(tmp_path):
    """_C.pyi against the built extension (mypy's stubtest): every runtime name has a stub and
    every stub a runtime name, with the same signatures where the C code gives them.  Only
    "disjoint base" remarks are let through (typing_extensions' @disjoint_base: a marker for
    the checker, not a difference in the API)."""
    pytest.importorskip("mypy.stubtest")
    import tpcore
    # the extension under test: python/'s in-place build, else the installed package (a fresh
    # clone's python/ has no built extension)
    env = dict(os.environ)
    if os.path.samefile(os.path.dirname(os.path.dirname(os.path.abspath(tpcore.__file__))), PYTHON_DIR):
        env["PYTHONPATH"] = PYTHON_DIR
    else:
        env.pop("PYTHONPATH", None)
    env.pop("MYPYPATH", None)
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "tpcore._C", "--mypy-config-file", os.devnull],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("error:") and "disjoint base" not in ln]
    assert "tpcore._C" in r.stdout or r.returncode == 0, r.stdout + r.stderr  # it did check the module
    assert not errors, "\n".join(errors) + "\n" + r.stdout[-3000:]
