"""Collectives on N ranks, each result checked against NumPy.

    python examples/collectives.py                 # 4 ranks, 1000 elements per rank
    python examples/collectives.py -n 3 --count 1000003 --iters 20
    python -m tpcore.launch -n 4 examples/collectives.py    # the ranks started by the launcher

Every rank fills its input with its own random values (a generator seeded by the rank),
runs all_reduce (sum and max), all_gather (uneven lengths per rank), reduce_scatter (uneven
blocks), broadcast, reduce to a root, a ring of sendrecv and an all_reduce inside a split
communicator, and compares each result with a float64 NumPy reference computed from every
rank's regenerated inputs.  Rank 0 prints each operation, its error and its median time
(the slowest rank's).  Exit status 1 when a result is wrong.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import tpcore


def data(rank: int, n: int, tag: int) -> np.ndarray:
    """Rank `rank`'s input of n float32 values for operation `tag` (any rank can regenerate it)."""
    return np.random.default_rng([tag, rank]).standard_normal(n).astype(np.float32)


def uneven(count: int, world: int) -> list:
    """Per-rank lengths that differ (rank r gets about (r + 1) parts of count): uneven on purpose."""
    w = np.arange(1, world + 1)
    sizes = (count * w // w.sum()).tolist()
    sizes[-1] += count - sum(sizes)
    return sizes


def timed(comm, fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        comm.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    slowest = comm.all_reduce(np.array([np.median(times)]), op="max")
    return float(slowest[0])


def run(comm, count: int, iters: int) -> list:
    """Every operation once, checked, then timed; returns [(name, max abs error, tolerance, seconds)]."""
    r, n = comm.rank, comm.size
    every = lambda tag, m=count: [data(q, m, tag) for q in range(n)]  # noqa: E731 (all ranks' inputs)
    f64 = lambda xs: [x.astype(np.float64) for x in xs]  # noqa: E731 (a one-line local helper)
    rows = []

    def check(name, got, want, tol, fn):
        err = float(np.abs(np.asarray(got, np.float64) - want).max()) if np.size(want) else 0.0
        rows.append((name, err, tol, timed(comm, fn, iters)))

    # all_reduce: in place on x (sum over ranks, then the elementwise max)
    x = data(r, count, 1)
    got = comm.all_reduce(x.copy())
    check("all_reduce sum", got, np.sum(f64(every(1)), axis=0), 4e-5 * n, lambda: comm.all_reduce(x.copy()))
    got = comm.all_reduce(x.copy(), op="max")
    check("all_reduce max", got, np.max(f64(every(1)), axis=0), 0.0, lambda: comm.all_reduce(x.copy(), op="max"))

    # all_gather with a different length on every rank (sizes=)
    sizes = uneven(count, n)
    mine = data(r, sizes[r], 2)
    got = comm.all_gather(mine, sizes=sizes)
    want = np.concatenate([data(q, sizes[q], 2) for q in range(n)]).astype(np.float64)
    check("all_gather (uneven)", got, want, 0.0, lambda: comm.all_gather(mine, sizes=sizes))

    # reduce_scatter: the sum over ranks, rank q keeps block q (uneven blocks)
    x = data(r, count, 3)
    got = comm.reduce_scatter(x, sizes=sizes)
    full = np.sum(f64(every(3)), axis=0)
    off = sum(sizes[:r])
    check("reduce_scatter (uneven)", got, full[off:off + sizes[r]], 4e-5 * n,
          lambda: comm.reduce_scatter(x, sizes=sizes))

    # broadcast from the last rank, in place
    root = n - 1
    x = data(r, count, 4)
    got = comm.broadcast(x.copy(), root=root)
    check(f"broadcast from {root}", got, data(root, count, 4).astype(np.float64), 0.0,
          lambda: comm.broadcast(x.copy(), root=root))

    # reduce onto rank 0 (the others' buffers are left as they were)
    x = data(r, count, 5)
    got = comm.reduce(x.copy(), root=0)
    want = np.sum(f64(every(5)), axis=0) if r == 0 else x.astype(np.float64)
    check("reduce to 0", got, want, 4e-5 * n, lambda: comm.reduce(x.copy(), root=0))

    # a ring: send to the right neighbour, receive from the left one
    x = data(r, count, 6)
    out = np.empty_like(x)
    right, left = (r + 1) % n, (r - 1) % n
    got = comm.sendrecv(x, right, out, left)
    check("sendrecv ring", got, data(left, count, 6).astype(np.float64), 0.0,
          lambda: comm.sendrecv(x, right, out, left))

    # split: even and odd ranks each all-reduce among themselves
    sub = comm.split(r % 2, r)
    x = data(r, count, 7)
    got = sub.all_reduce(x.copy())
    want = np.sum([data(q, count, 7).astype(np.float64) for q in range(n) if q % 2 == r % 2], axis=0)
    check("split even/odd all_reduce", got, want, 4e-5 * n, lambda: sub.all_reduce(x.copy()))
    sub.close()

    # every rank's worst error, so that rank 0 reports a wrong result on any rank
    errs = comm.all_reduce(np.array([e for _, e, _, _ in rows]), op="max")
    return [(name, float(e), tol, t) for (name, _, tol, t), e in zip(rows, errs)]


def report(rows, n: int, count: int) -> bool:
    print(f"tpcore {tpcore.__version__}: {n} ranks, {count} float32 values per rank, checked against NumPy (float64)")
    print(f"{'operation':>26} {'max abs err':>12} {'tolerance':>10} {'median us':>10}")
    ok = True
    for name, err, tol, t in rows:
        good = err <= tol
        ok &= good
        print(f"{name:>26} {err:>12.2e} {tol:>10.1e} {t * 1e6:>10.1f} {'' if good else 'WRONG'}")
    print("check passed: every collective equals NumPy" if ok else "CHECK FAILED")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=4, help="ranks to spawn when not started by the launcher (default 4)")
    p.add_argument("--count", type=int, default=1000, help="float32 values per rank (default 1000)")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions of each operation (default 5)")
    a = p.parse_args(argv)
    if a.count < 1:
        p.error("--count must be >= 1")
    if "TPCORE_JOB_ID" in os.environ or "RANK" in os.environ:  # started by python -m tpcore.launch
        with tpcore.init() as comm:
            rows = run(comm, a.count, a.iters)
            return 0 if comm.rank != 0 or report(rows, comm.size, a.count) else 1
    rows = tpcore.spawn(run, a.n, args=(a.count, a.iters), deadline=600)[0]
    return 0 if report(rows, a.n, a.count) else 1


if __name__ == "__main__":
    sys.exit(main())
