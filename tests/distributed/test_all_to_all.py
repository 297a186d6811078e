"""Comm.all_to_all (tp_all_to_all) at world 1-4: uneven and zero sizes, every dtype, along
axis 0 and another axis, with and without recv_sizes and out=, DLPack inputs, large messages
that take several rounds of the shm staging buffers; each rank's expected output is built with
NumPy from the blocks every rank would send it (regenerated here from known seeds: block
(src -> dst) of case `seed` is rng([seed, src, dst])).  Bad sizes raise typed errors before
anything moves; sizes that disagree across ranks raise CommError on every rank naming both
ranks (no hang).  The mpi backend runs the same checks under mpirun when it is there.

Run as a script (`python test_all_to_all.py mpi`) it is one rank of that mpirun job."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import tpcore

try:
    from conftest import WORLDS  # 3 and 4 are marked slow (the quick subset runs 1 and 2)
except ImportError:  # run as the mpi script
    WORLDS = [1, 2, 3, 4]
try:
    import ml_dtypes  # noqa: F401 (registers bfloat16 with NumPy)
    HAVE_BF16 = True
except ImportError:
    HAVE_BF16 = False

DTYPES = ["float32", "float64", "int64", "bfloat16", "float16", "int8", "uint8", "int32"]


def _dtypes(names=DTYPES):
    return [d for d in names if d != "bfloat16" or HAVE_BF16]


def _sizes(seed, n, hi):
    """S[src][dst]: rows src sends dst; about a third of them 0."""
    g = np.random.default_rng([seed, 999])
    s = g.integers(0, hi + 1, (n, n))
    s[g.random((n, n)) < 0.33] = 0
    return s.tolist()


def _block(seed, src, dst, rows, inner, dtype):
    g = np.random.default_rng([seed, src, dst])
    shape = (rows,) + inner
    if dtype.startswith("float") or dtype == "bfloat16":
        v = g.standard_normal(shape) * 100
    elif dtype == "uint8":
        v = g.integers(0, 256, shape)
    elif dtype == "int8":
        v = g.integers(-128, 128, shape)
    else:
        v = g.integers(-(2**31), 2**31, shape) * (2**31 if dtype == "int64" else 1)
    return v.astype(np.dtype(dtype))


def _case(comm, seed, dtype, hi, inner=(3,)):
    """This rank's x, its send and recv sizes, and the expected result (NumPy)."""
    n, r = comm.size, comm.rank
    s = _sizes(seed, n, hi)
    x = np.concatenate([_block(seed, r, p, s[r][p], inner, dtype) for p in range(n)])
    want = np.concatenate([_block(seed, p, r, s[p][r], inner, dtype) for p in range(n)])
    return x, s[r], [s[p][r] for p in range(n)], want


def _same(got, want):
    got = np.asarray(got)
    return got.dtype == want.dtype and got.shape == want.shape and \
        np.array_equal(got.view(np.uint8), want.view(np.uint8))


def check_all(comm, large=True, dtypes=DTYPES):
    """Every check on this rank; the list of what failed (empty: all good)."""
    bad = []
    for k, dtype in enumerate(_dtypes(dtypes)):
        x, send, recv, want = _case(comm, 100 + k, dtype, 6)
        x0 = x.copy()
        if not _same(comm.all_to_all(x, send), want):
            bad.append((dtype, "recv_sizes=None"))
        if not _same(comm.all_to_all(x, send, recv_sizes=recv), want):
            bad.append((dtype, "recv_sizes given"))
        out = np.empty_like(want)
        res = comm.all_to_all(x, send, recv, out=out)
        if res is not out or not _same(out, want):
            bad.append((dtype, "out="))
        if not _same(x, x0):
            bad.append((dtype, "x changed"))
        # along axis 1: blocks of columns
        xt = np.ascontiguousarray(np.moveaxis(x.reshape(x.shape[0], 3, 1), 0, 1))
        got = comm.all_to_all(xt, send, axis=1)
        if not _same(np.ascontiguousarray(got), np.ascontiguousarray(np.moveaxis(want.reshape(-1, 3, 1), 0, 1))):
            bad.append((dtype, "axis=1"))
    # all sizes zero, 1-D, and rows of zero width
    z = comm.all_to_all(np.zeros(0, np.float32), [0] * comm.size)
    if z.shape != (0,) or z.dtype != np.float32:
        bad.append(("zeros", z.shape, z.dtype))
    e = comm.all_to_all(np.zeros((comm.size, 0), np.int64), [1] * comm.size)
    if e.shape != (comm.size, 0):
        bad.append(("zero width", e.shape))
    # a foreign tensor through DLPack
    x, send, recv, want = _case(comm, 7, "float32", 4)
    if not _same(comm.all_to_all(DLPackOnly(x), send, recv), want):
        bad.append("dlpack")
    if large:  # several rounds of the 1 MiB staging buffers
        x, send, recv, want = _case(comm, 8, "float32", 90_000, inner=(2,))
        if not _same(comm.all_to_all(x, send, recv), want):
            bad.append("large")
    return bad


class DLPackOnly:
    """A foreign CPU tensor that speaks only DLPack (tests/conftest.py's, for the mpi script too)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def bad_args(comm):
    """Each bad argument's exception type and message (nothing is sent: no rank waits)."""
    n = comm.size
    x = np.zeros((4, 2), np.float32)
    ok = [4] + [0] * (n - 1)
    out = []
    for args, kw in [((x, [4] * (n + 1)), {}), ((x, [-1, 5] + [0] * (n - 2) if n > 1 else [-1]), {}),
                     ((x, [3] + [0] * (n - 1)), {}), ((x, "4"), {}), ((x, [4.0] + [0] * (n - 1)), {}),
                     ((x, ok), {"recv_sizes": [1] * (n + 2)}), ((x, ok), {"recv_sizes": [-2] * n}),
                     ((x, ok), {"axis": 2}), ((x, ok), {"axis": "0"}),
                     ((np.zeros((), np.float32), [1] + [0] * (n - 1)), {}),
                     ((x, ok), {"recv_sizes": ok, "out": np.zeros((5, 2), np.float32)}),
                     ((x, ok), {"recv_sizes": ok, "out": np.zeros((4, 2), np.float64)}),
                     (([1, 2], ok), {})]:
        try:
            comm.all_to_all(*args, **kw)
            out.append(("no error", str(kw)))
        except (TypeError, ValueError) as e:
            out.append((type(e).__name__, str(e)))
    comm.barrier()  # the communicator is still in step
    return out


def mismatch(comm):
    """Rank 0 expects one row more from rank 1 than rank 1 sends."""
    n = comm.size
    send = [1] * n
    recv = [1] * n
    if comm.rank == 0:
        recv[1] = 2
    comm.all_to_all(np.zeros(n, np.float32), send, recv_sizes=recv)  # 1-D: rows are elements


# ------------------------------------------------------------------------- pytest

_BAD = [("ValueError", "send_sizes has"), ("ValueError", "send_sizes must be >= 0"),
        ("ValueError", "send_sizes add up to 3 but x has length 4 along axis 0"),
        ("TypeError", "send_sizes must be a sequence of ints"), ("TypeError", "send_sizes must be a sequence"),
        ("ValueError", "recv_sizes has"), ("ValueError", "recv_sizes must be >= 0"),
        ("ValueError", "axis 2 is out of range"), ("TypeError", "axis must be an int"),
        ("ValueError", "x must have at least one dimension"), ("ValueError", "out has shape (5, 2)"),
        ("TypeError", "out has dtype float64"), ("TypeError", "x")]


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all(world, monkeypatch):
    """One cluster per world size for every check: the data against NumPy, the typed errors
    of bad sizes, and sizes that disagree across ranks (then the rebuilt communicator works).
    World 2 moves everything through the staging buffers (large messages in several rounds);
    the others pull large blocks from the peers' buffers (CMA) where the machine allows it."""
    if world == 2:
        monkeypatch.setenv("TPCORE_SHM_CMA_BYTES", str(1 << 60))
    with tpcore.Cluster(world, backend="shm", timeout=20, deadline=120) as cluster:
        for r, bad in enumerate(cluster.run(check_all, world != 3)):
            assert not bad, f"rank {r}: {bad}"
        for r, got in enumerate(cluster.run(bad_args)):
            assert len(got) == len(_BAD), got
            for (gt, gm), (wt, wm) in zip(got, _BAD):
                assert gt == wt and wm in gm and "all_to_all" in gm, (r, gt, gm, wt, wm)
        if world == 1:
            return
        with pytest.raises(tpcore.CommError,
                           match=r"rank 1 sends 1 elements to rank 0 .* rank 0 expects 2 from rank 1"):
            cluster.run(mismatch)
        for r, bad in enumerate(cluster.run(check_all, False)):  # the cluster rebuilt the communicator
            assert not bad, f"rank {r}: {bad}"


MPIRUN = shutil.which("mpirun")


@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="mpirun is not on PATH")
@pytest.mark.skipif(tpcore._C.Comm.probe("mpi") is not None, reason=f"mpi backend: {tpcore._C.Comm.probe('mpi')}")
@pytest.mark.parametrize("world", [3])
def test_mpi_backend(world):
    pkg_parent = os.path.dirname(os.path.dirname(tpcore.__file__))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",
               PYTHONPATH=pkg_parent + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TPCORE_JOB_ID", "TPCORE_BACKEND"):
        env.pop(k, None)
    p = subprocess.run([MPIRUN, "-n", str(world), "--oversubscribe", sys.executable, os.path.abspath(__file__), "mpi"],
                       env=env, capture_output=True, text=True, timeout=120, start_new_session=True)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    assert text.count("A2A PASS") == world, text[-4000:]
    if world > 1:
        assert text.count("A2A MISMATCH") == world, text[-4000:]


def _mpi_main():
    comm = tpcore.init(backend="mpi", timeout=20)
    bad = check_all(comm, large=False, dtypes=["float32", "float64", "int64", "bfloat16"])
    assert not bad, f"rank {comm.rank}: {bad}"
    print(f"A2A PASS rank {comm.rank}", flush=True)
    if comm.size > 1:
        try:
            mismatch(comm)
        except tpcore.CommError as e:
            msg = str(e)
            assert "rank 1 sends 1 elements to rank 0" in msg and "rank 0 expects 2 from rank 1" in msg, msg
            print(f"A2A MISMATCH rank {comm.rank}", flush=True)
    comm.close()


if __name__ == "__main__" and sys.argv[1:] == ["mpi"]:
    _mpi_main()
