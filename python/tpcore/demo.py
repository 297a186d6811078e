"""The main job: collectives across the ranks of one host, checked and timed.

    python -m tpcore.launch -n 2 -m tpcore.demo          (or: python -m tpcore.demo -n 2)

Every rank fills its buffers with its own random values; each collective's
result is checked against a NumPy reference that each rank computes from every
rank's regenerated inputs; rank 0 prints what was done and how fast, for
ordinary (private) arrays and for arrays in registered shared memory.  Later
versions grow this into a tensor-parallel transformer generating text.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import numpy as np

import tpcore

SIZES = [4 << 10, 1 << 20, 16 << 20]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


def _bus_factor(op, n):
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n if op in ("all_gather", "reduce_scatter") else 1.0


def _inputs(op, nbytes, n, seed):
    count = nbytes // 4
    per = count // n if op in ("all_gather", "reduce_scatter") else count
    if op == "reduce_scatter":
        per *= n
    return [np.random.default_rng([seed, r]).standard_normal(per).astype(np.float32) for r in range(n)]


def _expected(op, ins, rank, n):
    if op == "all_reduce":
        return np.sum([a.astype(np.float64) for a in ins], axis=0)
    if op == "all_gather":
        return np.concatenate(ins).astype(np.float64)
    if op == "reduce_scatter":
        full = np.sum([a.astype(np.float64) for a in ins], axis=0)
        k = full.size // n
        return full[rank * k:(rank + 1) * k]
    return ins[0].astype(np.float64)


def _prepare(op, x, src):
    """In-place ops overwrite x: refill it before each call (not timed)."""
    if op in ("all_reduce", "broadcast"):
        np.copyto(x, src)


def _run_one(comm, op, x, src):
    if op == "all_reduce":
        return comm.all_reduce(x)
    if op == "all_gather":
        return comm.all_gather(src)
    if op == "reduce_scatter":
        return comm.reduce_scatter(src)
    return comm.broadcast(x, root=0)


def demo(comm, iters: int = 20) -> list:
    n, r = comm.size, comm.rank
    rows = []
    for mode in ("private", "registered"):
        for op in OPS:
            for nbytes in SIZES:
                ins = _inputs(op, nbytes, n, seed=zlib.crc32(f"{op}{nbytes}".encode()))
                src = ins[r]
                if mode == "registered":
                    reg = comm.alloc(src.shape, src.dtype)
                    reg[...] = src
                    src = reg
                x = comm.alloc(src.shape, src.dtype) if mode == "registered" else np.empty_like(src)
                _prepare(op, x, src)
                res = _run_one(comm, op, x, src)
                want = _expected(op, ins, r, n)
                wrong = int(np.count_nonzero(~(np.abs(res.astype(np.float64) - want) <= 1e-5 * (1 + np.abs(want)))))
                times = []
                for _ in range(iters):
                    _prepare(op, x, src)
                    comm.barrier()
                    t0 = time.perf_counter()
                    _run_one(comm, op, x, src)
                    times.append(time.perf_counter() - t0)
                t = float(np.median(times))
                tmax = np.array([t])
                comm.all_reduce(tmax, op="max")
                bad = np.array([wrong], dtype=np.int64)
                comm.all_reduce(bad)
                size = nbytes if op != "all_gather" else src.size * 4 * n
                algbw = size / tmax[0] / 1e9
                rows.append((mode, op, size, tmax[0] * 1e6, algbw, algbw * _bus_factor(op, n), int(bad[0])))
    return rows


def _print(rows, n):
    print(f"tpcore {tpcore.__version__} demo: {n} rank(s) on one host, backend shm, float32 sum; "
          f"time is the median of the slowest rank")
    blas = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    if blas:
        print(f"environment: {blas}")
    print(f"{'memory':>10} {'op':>15} {'bytes':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} {'#wrong':>7}")
    for mode, op, size, us, alg, bus, bad in rows:
        print(f"{mode:>10} {op:>15} {size:>10} {us:>10.1f} {alg:>11.2f} {bus:>11.2f} {bad:>7}")
    total_bad = sum(r[-1] for r in rows)
    print(f"{len(rows)} collectives checked against NumPy: {'all correct' if total_bad == 0 else f'{total_bad} WRONG elements'}")
    return total_bad


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tpcore.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=None,
                   help="ranks to spawn when not started by the launcher (default 2)")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    if "TPCORE_JOB_ID" in os.environ or "RANK" in os.environ:
        with tpcore.init() as comm:
            rows = demo(comm, a.iters)
            bad = _print(rows, comm.size) if comm.rank == 0 else 0
            print(f"rank {comm.rank}: pid {os.getpid()}, {comm.stats()['calls']} calls, "
                  f"{comm.stats()['seconds'] * 1e3:.1f} ms in communication", file=sys.stderr)
    else:
        n = a.n or 2
        rows = tpcore.spawn(demo, n, args=(a.iters,), deadline=600)[0]
        bad = _print(rows, n)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
