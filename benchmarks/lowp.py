#!/usr/bin/env python
"""16-bit weights on the CPU: tpcore's linear_forward with w in bfloat16 / float16 against
the same call with float32 w (BLAS sgemv / sgemm) and NumPy's float32 matmul, in one run.

    python benchmarks/lowp.py                 # the table
    python benchmarks/lowp.py --quick --json lowp.json

Columns: M, K, N (y[M,N] = x[M,K] w[N,K]^T), the weight dtype, the best time of --reps
calls, GB/s of weight bytes read (N K x 2 or 4 / time), and the speedup of this row over
tpcore's float32 call and over NumPy's float32 `x @ w.T` (> 1: this row is faster).  Each
call uses the next of several weight copies that together exceed the last-level cache
(decoding streams every layer's weights from memory); --hot reuses one copy.  Decode-sized
M (<= 8) is the memory-bound case that 16-bit storage halves; larger M is compute-bound
(the CPU widens w into panels for sgemm) and should stay near 1.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

try:
    import tpcore
except ImportError:  # a source checkout that is not installed (the extension must be built)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import tpcore
from tpcore import _C


def best_time(fn, copies, reps):
    fn(copies[0])  # warm up (page faults, thread start)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for w in copies:
            fn(w)
        best = min(best, (time.perf_counter() - t) / len(copies))
    return best


def run(shapes, ms, reps, hot, cache_bytes):
    import ml_dtypes
    rng = np.random.default_rng(0)
    rows = []
    for K, N in shapes:
        ncopy = 1 if hot else max(2, -(-cache_bytes // (N * K * 4)))
        w32 = [rng.uniform(-1, 1, (N, K)).astype(np.float32) for _ in range(ncopy)]
        ws = {"float32": w32,
              "bfloat16": [tpcore.convert(w, ml_dtypes.bfloat16) for w in w32],
              "float16": [tpcore.convert(w, np.float16) for w in w32]}
        for M in ms:
            x = rng.uniform(-1, 1, (M, K)).astype(np.float32)
            y = np.empty((M, N), np.float32)
            t_np = best_time(lambda w: np.matmul(x, w.T, out=y), w32, reps)
            t = {name: best_time(lambda w: _C.linear_forward(x, w, None, y), c, reps) for name, c in ws.items()}
            for name in ws:
                rows.append({"M": M, "K": K, "N": N, "dtype": name, "ms": t[name] * 1e3,
                             "weight_GBps": N * K * ws[name][0].itemsize / t[name] / 1e9,
                             "vs_tpcore_f32": t["float32"] / t[name], "vs_numpy_f32": t_np / t[name]})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="M in 1, 4, 32 and the smaller shape only")
    p.add_argument("--reps", type=int, default=7, help="timed passes over the weight copies (best kept)")
    p.add_argument("--hot", action="store_true", help="one weight copy (cache-resident when it fits)")
    p.add_argument("--cache-mb", type=int, default=96, help="bytes of float32 weight copies to cycle through")
    p.add_argument("--threads", type=int, default=0, help="tpcore's threads (0: its default)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    a = p.parse_args(argv)
    if a.threads:
        tpcore.set_num_threads(a.threads)
    shapes = [(768, 3072)] if a.quick else [(768, 3072), (2048, 8192)]
    ms = [1, 4, 32] if a.quick else [1, 2, 4, 8, 32]
    rows = run(shapes, ms, a.reps, a.hot, a.cache_mb << 20)
    print(f"tpcore linear_forward, 16-bit weights; {tpcore.get_num_threads()} thread(s); "
          f"{'hot' if a.hot else 'cold'} weights; BLAS: {_C.build_info().get('blas', '?')}")
    print(f"{'M':>4} {'K':>6} {'N':>6} {'w dtype':>9} {'ms':>9} {'GB/s w':>7} {'vs f32':>7} {'vs numpy':>8}")
    for r in rows:
        print(f"{r['M']:>4} {r['K']:>6} {r['N']:>6} {r['dtype']:>9} {r['ms']:>9.3f} {r['weight_GBps']:>7.1f} "
              f"{r['vs_tpcore_f32']:>7.2f} {r['vs_numpy_f32']:>8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": tpcore.get_num_threads(), "hot": a.hot, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
