"""The layers benchmark's tpcore side (python -m tpcore.bench layers): what every rank of
tpcore.spawn runs (ParallelMLP steps, the float64 check, NumPy's GEMMs on the same shards),
the rows combined over the ranks, and the inputs and timing loop the torch peer shares."""
from __future__ import annotations

import gc
import math
import os
import time
from typing import List

import numpy as np

from tpcore.bench._sweep import Progress


# ------------------------------------------------------------------- helpers

def _erf(z: np.ndarray) -> np.ndarray:
    try:
        from scipy.special import erf
        return erf(z)
    except ImportError:
        return np.vectorize(math.erf, otypes=[np.float64])(z)


def _gelu64(z):
    return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))


def _gelu64_grad(z):
    return 0.5 * (1.0 + _erf(z / math.sqrt(2.0))) + z * np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _inputs(h: int, t: int):
    """x and dy, the same on every rank and for every implementation."""
    rng = np.random.default_rng(1000003 * h + t)
    x = rng.standard_normal((t, h), dtype=np.float32)
    dy = rng.standard_normal((t, h), dtype=np.float32)
    return x, dy


def _timed(fn, iters: int, barrier, before=None):
    """Per-iteration seconds of fn(); barrier (and before) untimed."""
    out = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(iters):
            if before is not None:
                before()
            barrier()
            t0 = time.perf_counter_ns()
            fn()
            out.append((time.perf_counter_ns() - t0) * 1e-9)
    finally:
        if gc_was:
            gc.enable()
    return out


def _pick_iters(plan: dict, last_step_s: float) -> int:
    if plan["iters"]:
        return plan["iters"]
    n = math.ceil(plan["target_s"] / max(last_step_s, 1e-9))
    return int(min(max(n, plan["min_iters"]), plan["max_iters"]))


def _numpy_blas_threads(n: int) -> dict:
    """Set the BLAS threads of NumPy's BLAS (not tpcore's) in this process to n;
    say how."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        env = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
        return {"method": "none (threadpoolctl is not installed: pip install threadpoolctl)",
                "threads": env or "NumPy's default (all cores)"}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the tpcore package
    ctl = ThreadpoolController()
    libs = [lc for lc in ctl.lib_controllers
            if lc.user_api == "blas" and not os.path.abspath(lc.filepath).startswith(here + os.sep)]
    for lc in libs:
        lc.set_num_threads(n)
    return {"method": "threadpoolctl", "threads": n,
            "libs": [{"filepath": lc.filepath, "version": lc.version, "internal_api": lc.internal_api,
                      "num_threads": lc.get_num_threads(), "architecture": getattr(lc, "architecture", None)}
                     for lc in libs]}

def _vmhwm() -> int:
    """This process's peak resident bytes (VmHWM of /proc/self/status; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

# ------------------------------------------------------------- tpcore ranks

def _tpcore_rank(comm, plan: dict) -> list:
    """Run on every rank by tpcore.spawn: all shapes at this world size."""
    import tpcore

    n, rank = comm.size, comm.rank
    threads = tpcore.get_num_threads()
    np_threads = _numpy_blas_threads(threads)
    progress = Progress(plan["progress"] and rank == 0)
    rows = []
    for shape in plan["shapes"]:
        h, f, t = shape["hidden"], shape["ffn"], shape["tokens"]
        tag = f"[layers] tpcore n={n} h={h} T={t}"
        progress.status(f"{tag}: setup", important=True)
        mlp = tpcore.ParallelMLP(h, f, comm, activation="gelu", bias=True, seed=0)
        fl = mlp.fc1.local
        x, dy = _inputs(h, t)
        row = {"hidden": h, "ffn": f, "tokens": t, "n": n, "rank": rank, "threads": threads, "f_local": fl}

        # correctness (the first step doubles as warm-up)
        y = mlp(x)
        dx = mlp.backward(dy)
        if plan["check"]:
            W1, b1 = mlp.fc1.gather_full()
            W2, b2 = mlp.fc2.gather_full()
            if rank == 0:
                k = min(t, plan["check_rows"])
                x64, dy64 = x[:k].astype(np.float64), dy[:k].astype(np.float64)
                z = x64 @ W1.T.astype(np.float64) + b1
                yref = _gelu64(z) @ W2.T.astype(np.float64) + b2
                dxref = ((dy64 @ W2.astype(np.float64)) * _gelu64_grad(z)) @ W1.astype(np.float64)
                row["err_y"] = float(np.max(np.abs(y[:k] - yref)))
                row["err_dx"] = float(np.max(np.abs(dx[:k] - dxref)))
                row["ref_max"] = float(max(np.max(np.abs(yref)), np.max(np.abs(dxref))))
                row["check_rows"] = k
            del W1, b1, W2, b2
        mlp.zero_grad()

        def step():
            mlp(x)
            mlp.backward(dy)

        def fwd():
            mlp(x)

        # the check step was the first warm-up; the others are timed to pick the iteration count (at
        # least one, even with --warmup 1); the fastest counts (one slow step must not shrink the count)
        warm = _timed(step, max(1, plan["warmup"] - 1), comm.barrier)
        iters = int(comm.broadcast(np.array([_pick_iters(plan, min(warm))], dtype=np.int64), root=0)[0])
        row["iters"] = iters

        progress.status(f"{tag}: {iters} steps", important=True)
        comm_s = []  # seconds in collectives of exactly the timed steps: stats() read right before / after

        def step_stamped():
            s0 = comm.stats()["seconds"]
            mlp(x)
            mlp.backward(dy)
            comm_s.append(comm.stats()["seconds"] - s0)

        steps = _timed(step_stamped, iters, comm.barrier)
        row["step_s"] = steps
        row["comm_s"] = comm_s
        row["fwd_s"] = _timed(fwd, max(1, iters), comm.barrier)

        # NumPy on the same shard shapes, same rank, same threads
        progress.status(f"{tag}: NumPy GEMMs", important=True)
        W1s, W2s = np.asarray(mlp.fc1.weight), np.asarray(mlp.fc2.weight)  # (fl, h), (h, fl)
        a = np.empty((t, fl), np.float32)
        a[...] = np.random.default_rng(7).standard_normal((t, fl), dtype=np.float32)
        dh = a.copy()
        yb = np.empty((t, h), np.float32)
        dW2 = np.empty((h, fl), np.float32)
        da = np.empty((t, fl), np.float32)
        dW1 = np.empty((fl, h), np.float32)
        dxb = np.empty((t, h), np.float32)

        def gemms():
            np.matmul(x, W1s.T, out=a)      # fc1 forward
            np.matmul(a, W2s.T, out=yb)     # fc2 forward
            np.matmul(dy.T, a, out=dW2)     # fc2 weight gradient
            np.matmul(dy, W2s, out=da)      # fc2 input gradient
            np.matmul(dh.T, x, out=dW1)     # fc1 weight gradient
            np.matmul(dh, W1s, out=dxb)     # fc1 input gradient

        def gemms_fwd():
            np.matmul(x, W1s.T, out=a)
            np.matmul(a, W2s.T, out=yb)

        _timed(gemms, 2, comm.barrier)
        row["numpy_s"] = _timed(gemms, iters, comm.barrier)
        row["numpy_fwd_s"] = _timed(gemms_fwd, iters, comm.barrier)
        row["param_bytes"] = int(sum(p.nbytes for p, _ in mlp.parameters()))
        row["memory"] = {k: v for k, v in mlp.memory().items() if k != "device"}   # after the timed steps
        row["rss_peak_bytes"] = _vmhwm()
        st = comm.stats()
        row["stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float))}
        rows.append(row)
        # released (the closures above hold these names: no del)
        mlp = y = dx = W1s = W2s = a = dh = yb = dW2 = da = dW1 = dxb = None
        gc.collect()
        comm.barrier()
    progress.done()
    return [{"numpy_threads": np_threads}] + rows

# ------------------------------------------------------------- combination

def _stats(xs: List[float]) -> dict:
    return {"mean": float(np.mean(xs)), "min": float(np.min(xs))}


def _combine_tpcore(per_rank: list, n: int) -> list:
    out = []
    for k in range(len(per_rank[0])):
        rr = [per_rank[r][k] for r in range(n)]
        r0 = rr[0]
        h, f, t, fl_max = r0["hidden"], r0["ffn"], r0["tokens"], max(r["f_local"] for r in rr)
        step_mean = max(np.mean(r["step_s"]) for r in rr)
        step_min = max(np.min(r["step_s"]) for r in rr)
        fwd_mean = max(np.mean(r["fwd_s"]) for r in rr)
        np_mean = max(np.mean(r["numpy_s"]) for r in rr)
        np_fwd_mean = max(np.mean(r["numpy_fwd_s"]) for r in rr)
        # per rank: its shard FLOPs over its own times; reported the slowest rank
        gf, gfc, gnp = [], [], []
        shares = []
        for r in rr:
            flops = 3 * 2 * t * h * r["f_local"] * 2
            st, cs = float(np.sum(r["step_s"])), float(np.sum(r["comm_s"]))
            gf.append(flops * len(r["step_s"]) / st / 1e9)
            gfc.append(flops * len(r["step_s"]) / max(st - cs, 1e-12) / 1e9)
            gnp.append(flops * len(r["numpy_s"]) / float(np.sum(r["numpy_s"])) / 1e9)
            shares.append(cs / st)
        full_bytes = (2 * h * f + f + h) * 4
        pr = [r["param_bytes"] / (full_bytes / n) for r in rr]
        rank_ratio = [a / b for a, b in zip(gf, gnp)]
        rank_ratio_c = [a / b for a, b in zip(gfc, gnp)]
        out.append({
            "hidden": h, "ffn": f, "tokens": t, "n": n, "threads": r0["threads"], "f_local": fl_max,
            "iters": r0["iters"], "step_ms": step_mean * 1e3, "step_min_ms": step_min * 1e3,
            "fwd_ms": fwd_mean * 1e3, "gflops": min(gf), "gflops_nocomm": min(gfc), "numpy_gflops": min(gnp),
            "numpy_ms": np_mean * 1e3, "numpy_fwd_ms": np_fwd_mean * 1e3,
            "ratio_numpy": min(rank_ratio), "ratio_numpy_nocomm": min(rank_ratio_c),
            "comm_share": max(shares), "comm_share_mean": float(np.mean(shares)),
            "param_ratio": max(pr), "param_bytes": [r["param_bytes"] for r in rr], "full_param_bytes": full_bytes,
            "memory": max((r["memory"] for r in rr), key=lambda m: m["total"]),
            "rss_peak_bytes": max(r["rss_peak_bytes"] for r in rr),
            "err_y": r0.get("err_y"), "err_dx": r0.get("err_dx"), "ref_max": r0.get("ref_max"),
            "per_rank": [{"step_ms": _scale(_stats(r["step_s"])), "fwd_ms": _scale(_stats(r["fwd_s"])),
                          "numpy_ms": _scale(_stats(r["numpy_s"])), "comm_share": s, "gflops": g,
                          "numpy_gflops": gn, "stats": r.get("stats")}
                         for r, s, g, gn in zip(rr, shares, gf, gnp)],
        })
    return out


def _scale(d):
    return {k: v * 1e3 for k, v in d.items()}
