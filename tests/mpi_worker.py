"""One rank of tests/launch/test_mpi.py's jobs, started by mpirun (or tpcore.launch --backend mpi).

    python mpi_worker.py collectives   every collective, dtype, op, even and uneven counts,
                                       p2p, sendrecv ring, split, a TP layer pair vs world 1
                                       (MPI_TEST_MISMATCH at world 3: then ranks that disagree on
                                       a count, in a collective and in send/recv, get clear errors)
    python mpi_worker.py abort_hang    a recv of fewer elements than sent (MPI's error text); rank 1
                                       aborts a sub-communicator, then hangs: the others name it,
                                       then time out
    python mpi_worker.py kill          rank 1 kills itself with SIGKILL inside a collective loop
    python mpi_worker.py stop          the calls of MPI_TEST_CALLS, then the ranks of MPI_TEST_STOP
                                       ("2", "1,3") stop themselves (SIGSTOP) before an all_reduce:
                                       the others' timeouts name them and their last call (the
                                       test kills them)

Data comes from one seed, so every rank computes every rank's data and the float64 NumPy
reference locally.  A rank prints "PASS rank r checks n" at the end; a failed check raises.
"""
import os
import signal
import sys
import time

import ml_dtypes
import numpy as np

import tpcore

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "prod", "min", "max", "avg"]
TOL = {"float32": 1e-5, "float64": 1e-12, "float16": 4e-3, "bfloat16": 2e-2}


def report(comm, line):
    """A result line: on stdout and in $MPI_TEST_OUT/rank<r>.txt (mpirun may drop the last
    lines of a rank's stdout when the job ends at once)."""
    print(line, flush=True)
    out = os.environ.get("MPI_TEST_OUT")
    if out:
        with open(os.path.join(out, f"rank{comm.rank}.txt"), "a") as f:
            f.write(line + "\n")


def npdtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def data(seed, rank, shape, dtype):
    """Fresh non-zero values of rank `rank` (the same on every rank that asks)."""
    g = np.random.default_rng([seed, rank])
    if dtype.startswith("float") or dtype == "bfloat16":
        v = g.uniform(0.5, 2.0, shape) * g.choice([-1.0, 1.0], shape)
    elif dtype == "uint8":
        v = g.integers(1, 10, shape)
    else:
        v = g.integers(1, 10, shape) * g.choice([-1, 1], shape)
    return v.astype(npdtype(dtype))


def reference(parts, op, dtype):
    """float64 (int64 for integers) reduction, then the dtype's rounding / wrap-around."""
    is_int = not (dtype.startswith("float") or dtype == "bfloat16")
    wide = [p.astype(np.int64 if is_int else np.float64) for p in parts]
    if op in ("sum", "avg"):
        r = sum(wide[1:], wide[0].copy())
        if op == "avg":
            r = (np.sign(r) * (np.abs(r) // len(parts))) if is_int else r / len(parts)
    elif op == "prod":
        r = wide[0].copy()
        for w in wide[1:]:
            r = r * w
    elif op == "min":
        r = np.minimum.reduce(wide)
    else:
        r = np.maximum.reduce(wide)
    return r.astype(npdtype(dtype)) if is_int else r


class Checker:
    def __init__(self, comm):
        self.comm, self.n = comm, 0

    def close(self, got, want, dtype, what):
        self.n += 1
        assert got.dtype == npdtype(dtype), (what, got.dtype)
        if dtype in TOL:
            g = got.astype(np.float64)
            ok = np.allclose(g, want, rtol=TOL[dtype] * (4 if dtype in ("float16", "bfloat16") else 1),
                             atol=TOL[dtype])
            assert ok, f"{what} on rank {self.comm.rank}: max error {np.max(np.abs(g - want))}\n{g}\n{want}"
        else:
            assert np.array_equal(got, want), f"{what} on rank {self.comm.rank}:\n{got}\n{want}"


def collectives(comm, seed):
    c, n, r = Checker(comm), comm.size, comm.rank
    uneven = [3, 0, 5, 1][:n] if n > 1 else [4]
    dtypes = os.environ.get("MPI_TEST_DTYPES", ",".join(DTYPES)).split(",")
    for dtype in dtypes:
        for k, op in enumerate(OPS):
            for shape in [[(7,), (2, 3)][k % 2]]:
                parts = [data(seed, p, shape, dtype) for p in range(n)]
                want = reference(parts, op, dtype)
                x = parts[r].copy()
                c.close(comm.all_reduce(x, op=op), want, dtype, f"all_reduce {dtype} {op} in place")
                out = np.empty_like(x)
                comm.all_reduce(parts[r], op=op, out=out)
                c.close(out, want, dtype, f"all_reduce {dtype} {op}")
                assert np.array_equal(parts[r], data(seed, r, shape, dtype)), "all_reduce changed its input"
                root = (seed + len(op)) % n
                y = parts[r].copy()
                comm.reduce(y, root=root, op=op)
                if r == root:
                    c.close(y, want, dtype, f"reduce {dtype} {op} root {root}")
                else:
                    assert np.array_equal(y, parts[r]), "reduce changed a non-root's x"
            # reduce_scatter: even (3 rows per rank) and uneven sizes
            for sizes in (None, uneven):
                rows = 3 * n if sizes is None else sum(sizes)
                parts = [data(seed + 1, p, (rows, 2), dtype) for p in range(n)]
                want = reference(parts, op, dtype)
                sz = sizes or [3] * n
                lo = sum(sz[:r])
                got = comm.reduce_scatter(parts[r], op=op, sizes=sizes)
                c.close(got, want[lo:lo + sz[r]], dtype, f"reduce_scatter {dtype} {op} sizes {sizes}")
        for sizes in (None, uneven):
            mine = data(seed + 2, r, ((sizes or [4] * n)[r], 3), dtype)
            want = np.concatenate([data(seed + 2, p, ((sizes or [4] * n)[p], 3), dtype) for p in range(n)])
            got = comm.all_gather(mine, sizes=sizes)
            c.close(got, want.astype(np.float64) if dtype in TOL else want, dtype, f"all_gather {dtype} {sizes}")
        for root in range(n):
            x = data(seed + 3, r, (9,), dtype)
            want = data(seed + 3, root, (9,), dtype)
            comm.broadcast(x, root=root)
            c.close(x, want.astype(np.float64) if dtype in TOL else want, dtype, f"broadcast {dtype} root {root}")
    # p2p: a ring with sendrecv, then send/recv pairs (even ranks send first)
    for dtype in ("float32", "bfloat16", "int64"):
        nxt, prv = (r + 1) % n, (r - 1) % n
        mine = data(seed + 4, r, (11,), dtype)
        out = np.empty_like(mine)
        comm.sendrecv(mine, nxt, out, prv)
        want = data(seed + 4, prv, (11,), dtype)
        c.close(out, want.astype(np.float64) if dtype in TOL else want, dtype, "sendrecv ring")
        if n > 1 and not (n % 2 and r == n - 1):
            peer = r + 1 if r % 2 == 0 else r - 1
            got = np.empty_like(mine)
            if r % 2 == 0:
                comm.send(mine, peer)
                comm.recv(got, peer)
            else:
                comm.recv(got, peer)
                comm.send(mine, peer)
            want = data(seed + 4, peer, (11,), dtype)
            c.close(got, want.astype(np.float64) if dtype in TOL else want, dtype, f"send/recv with {peer}")
    comm.barrier()
    # split: even and odd ranks, the last rank (of 3+) takes no part
    color = None if n >= 3 and r == n - 1 else r % 2
    sub = comm.split(color, key=-r)
    if color is None:
        assert sub is None
    else:
        members = [p for p in range(n) if (None if n >= 3 and p == n - 1 else p % 2) == color]
        assert sub.size == len(members) and sub.rank == sorted(members, reverse=True).index(r), (sub.rank, sub.size)
        assert sub.backend == "mpi"
        x = data(seed + 5, r, (6,), "float64")
        want = reference([data(seed + 5, p, (6,), "float64") for p in members], "sum", "float64")
        c.close(sub.all_reduce(x), want, "float64", "split all_reduce")
        sub.close()
    return c


def tp_layers(comm, seed):
    """ColumnParallelLinear -> RowParallelLinear on this communicator equals one process's."""
    rng = np.random.default_rng(seed)
    d, h, b = 8, 12, 5
    w1 = rng.standard_normal((h, d)).astype(np.float32)
    w2 = rng.standard_normal((d, h)).astype(np.float32)
    x = rng.standard_normal((b, d)).astype(np.float32)
    want = (x.astype(np.float64) @ w1.T.astype(np.float64)) @ w2.T.astype(np.float64)
    col = tpcore.ColumnParallelLinear(d, h, comm, bias=False, gather_output=False)
    row = tpcore.RowParallelLinear(h, d, comm, bias=False, input_is_parallel=True)
    col.load_full(w1)
    row.load_full(w2)
    got = row.forward(col.forward(x))
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4), np.max(np.abs(got - want))


def mismatches():
    """Ranks that disagree get clear errors; nothing is left in flight (MPI_Finalize still runs)."""
    comm = tpcore.init(backend="mpi", timeout=20)
    try:
        comm.all_reduce(np.ones(5 + (comm.rank == 1), np.float32))
    except tpcore.CommError as e:
        report(comm, f"ERROR rank {comm.rank}: {e}")
    else:
        report(comm, f"NO ERROR rank {comm.rank}")
    comm = tpcore.init(backend="mpi", timeout=20)  # the first failed
    try:  # rank 0 sends 4 elements to rank 1, which expects 5
        if comm.rank == 0:
            comm.send(np.ones(4, np.float32), 1)
        elif comm.rank == 1:
            comm.recv(np.empty(5, np.float32), 0)
    except tpcore.CommError as e:
        report(comm, f"P2P ERROR rank {comm.rank}: {e}")
    else:
        report(comm, f"P2P NO ERROR rank {comm.rank}")


def one_call(comm, kind, x):
    """One collective of kind on x, each kind on its own line (the test reads the call sites)."""
    if kind == "all_reduce":
        comm.all_reduce(x)  # stop: all_reduce
    elif kind == "broadcast":
        comm.broadcast(x, root=comm.size - 1)  # stop: broadcast
    elif kind == "all_gather":
        comm.all_gather(x)  # stop: all_gather
    else:
        comm.barrier()  # stop: barrier


def stop(comm, seed):
    x = data(seed, comm.rank, (16,), "float32")
    for kind in filter(None, os.environ["MPI_TEST_CALLS"].split(",")):
        one_call(comm, kind, x)
    report(comm, f"READY rank {comm.rank} pid {os.getpid()}")
    if str(comm.rank) in os.environ["MPI_TEST_STOP"].split(","):
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)  # continued: the test kills it
        return
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
    except tpcore.CommError as e:
        report(comm, f"ERROR rank {comm.rank} after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}")
        sys.exit(2)
    report(comm, f"NO ERROR rank {comm.rank}")


def main():
    mode = sys.argv[1]
    seed = int(os.environ.get("MPI_TEST_SEED", "7"))
    comm = tpcore.init(backend=os.environ.get("MPI_TEST_BACKEND", "mpi"),
                       timeout=float(os.environ.get("MPI_TEST_TIMEOUT", "20")))
    assert comm.backend == "mpi", comm.backend
    if mode == "collectives":
        c = collectives(comm, seed)
        if os.environ.get("MPI_TEST_LAYERS"):
            tp_layers(comm, seed)
        comm.close()
        report(comm, f"PASS rank {comm.rank} of {comm.size} checks {c.n}")
        if os.environ.get("MPI_TEST_MISMATCH") and comm.size == 3:
            mismatches()

    elif mode == "abort_hang":
        # on a sub-communicator rank 1 aborts: the others fail naming it; then on the world
        # communicator rank 1 hangs: the others time out
        comm.barrier()
        sub, other = comm.split(0), comm.split(0)
        # rank 2 sends 6 elements to rank 0, which expects 5: MPI's truncation error, as a CommError
        try:
            if comm.rank == 0:
                other.recv(np.empty(5, np.float32), 2)
            elif comm.rank == 2:
                other.send(np.ones(6, np.float32), 0)
        except tpcore.CommError as e:
            report(comm, f"P2P ERROR rank {comm.rank}: {e}")
        t0 = time.monotonic()
        if comm.rank == 1:
            time.sleep(0.5)  # the others are past the split (an abort also fails a call in flight)
            sub.abort("boom from the test")
            time.sleep(60)
        else:
            try:
                sub.all_reduce(np.ones(10, np.float32))
            except tpcore.CommError as e:
                report(comm, f"ABORTED rank {comm.rank} after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}")
            t0 = time.monotonic()
            try:
                comm.all_reduce(np.ones(10, np.float32))
            except tpcore.CommError as e:
                report(comm, f"ERROR rank {comm.rank} after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}")
                sys.exit(2)
    elif mode == "stop":
        stop(comm, seed)
    elif mode == "kill":
        comm.barrier()
        report(comm, f"READY rank {comm.rank} pid {os.getpid()}")
        t0 = time.monotonic()
        try:
            for i in range(10**7):
                if comm.rank == 1 and i == 50:
                    os.kill(os.getpid(), signal.SIGKILL)
                comm.all_reduce(np.ones(1000, np.float32))
        except tpcore.CommError as e:
            report(comm, f"ERROR rank {comm.rank} after {time.monotonic() - t0:.1f} s: {e}")
            sys.exit(2)


if __name__ == "__main__":
    main()
