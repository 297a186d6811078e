"""Layers benchmark: ParallelMLP forward+backward vs NumPy GEMMs and torch.distributed/gloo.

    python -m tpcore.bench layers                       # h 1024,4096 x T 8,512 x worlds 1,2,4
    python -m tpcore.bench layers --quick               # h 256, T 8, worlds 1,2 (CI smoke test)
    python benchmarks/layers.py --hidden 1024 --tokens 8 --worlds 2 --json out.json --plot out.png

Each configuration (hidden h, tokens T, ranks n) is a tpcore.ParallelMLP(h,
ffn_mult*h, activation="gelu", bias=True): column-parallel fc1, GELU, row-
parallel fc2; one all-reduce forward, one backward.  Input x (T, h) float32,
the same on every rank.  Columns:

  step ms   forward + backward of one step (x -> y, dy -> dx, gradients
            accumulated), mean and min over the timed iterations; per rank
            the mean (min), reported: the max over ranks
  fwd ms    forward only, mean, max over ranks
  GF/s      FLOPs of the rank's shard GEMMs (forward 2*T*h*f_local*2,
            backward twice that) / step time; the slowest rank
  GF/s-c    the same over (step time - time in collectives): the layer's
            compute without communication
  NumPy     GF/s of np.matmul on the same rank, in the same run, on the same
            shard shapes (x@W1.T, a@W2.T; dy.T@a, dy@W2, dh.T@x, dh@W1) with
            float32 arrays and out=, with NumPy's BLAS set to the same thread
            count as tpcore's (threadpoolctl; see the header)
  /NP       tpcore GF/s / NumPy GF/s (step, and -c: without communication);
            target >= 0.9.  tpcore's weight gradients accumulate (GEMM beta 1:
            read + write the gradient) while np.matmul(out=) only writes: at
            small T, where the weight-gradient GEMMs are memory bound, NumPy
            has that advantage
  comm%     time in tpcore collectives during the timed steps (delta of
            comm.stats()['seconds'], which includes waiting for the slowest
            rank) / step time; the max over ranks
  param     bytes of the rank's parameters / (bytes of the full MLP / n);
            the max over ranks (fc2's bias is replicated, so slightly > 1)
  err y/dx  max abs error of rank 0's y and dx (first --check-rows tokens)
            against a float64 NumPy reference from the full weights
            (fc1.gather_full(), fc2.gather_full())

Method.  Before each timed step every rank passes a barrier (untimed); the
step is timed with time.perf_counter_ns.  Warm-up steps come first (the
first is the float64 check); rank 0 takes the fastest of the others and picks
the iteration count so that the timed steps take about --target-time seconds
(3 .. --max-iters); every rank uses that count, for forward-only, for the
NumPy GEMMs (after 2 warm-up calls) and for the torch peer too.  NumPy runs
after tpcore's steps on the same ranks, torch afterwards in its own processes.

Peer (optional, --peers auto|none): torch.distributed with gloo on as many
processes (multiprocessing "spawn", TCP rendezvous on 127.0.0.1), each with
torch.set_num_threads = tpcore's BLAS thread count at that world size; the
same MLP Megatron style: fc1 weight shard (f/n, h) + bias shard, GELU, fc2
weight shard (h, f/n), all_reduce of fc2's output, then fc2's bias; autograd
with custom Functions (copy-to-parallel: identity forward / all_reduce
backward at fc1's input; reduce-from-parallel: all_reduce forward / identity
backward at fc2's output).  Checked the same way against float64 (per-rank
partial sums all-reduced).  speed-up = torch time / tpcore time (> 1: tpcore
faster).
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time
from typing import List, Optional

import numpy as np

from tpcore.bench.collectives import _iters  # the same --iters parser
from tpcore.bench._sweep import Progress, env_info

PEERS = ("gloo",)
TARGETS = {"numpy_ratio": 0.9, "comm_share": 0.10, "param_ratio": 0.01}
CHECK_TOL = 1e-3  # relative to max(1, max |reference|)


# ----------------------------------------------------------------- arguments

def _ints(what):
    def parse(text):
        try:
            vals = [int(s) for s in text.split(",") if s.strip()]
        except ValueError:
            vals = []
        if not vals or any(v < 1 for v in vals):
            raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list of ints >= 1, got {text!r}")
        return vals
    return parse


def _peers(text):
    if text in ("auto", "none"):
        return text
    items = [s.strip() for s in text.split(",") if s.strip()]
    items = ["gloo" if s == "torch" else s for s in items]
    if not items or any(s not in PEERS for s in items):
        raise argparse.ArgumentTypeError(f"--peers must be auto, none or gloo (torch), got {text!r}")
    return items


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=_ints("--hidden"), default=None, help="hidden sizes, default 1024,4096 "
                   "(--quick: 256)")
    p.add_argument("--tokens", type=_ints("--tokens"), default=None, help="tokens T, default 8,512 (--quick: 8)")
    p.add_argument("--worlds", type=_ints("--worlds"), default=None, help="rank counts, default 1,2,4 "
                   "(--quick: 1,2)")
    p.add_argument("--ffn-mult", type=int, default=4, help="ffn_hidden = ffn_mult * hidden, default 4")
    p.add_argument("--iters", type=_iters, default=None, metavar="auto|N",
                   help="timed steps per configuration; auto (default) aims at --target-time")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps, default 3 (--quick: 2)")
    p.add_argument("--target-time", type=float, default=None,
                   help="auto iterations: seconds of timed forward+backward steps per configuration, "
                        "default 0.5 (--quick: 0.05)")
    p.add_argument("--max-iters", type=int, default=None, help="auto iterations cap, default 100 (--quick: 10)")
    p.add_argument("--check-rows", type=int, default=16, help="tokens checked against float64, default 16")
    p.add_argument("--peers", type=_peers, default="auto", help="auto (default: torch/gloo if installed), none, "
                   "or gloo")
    p.add_argument("--json", metavar="FILE", help="write environment, configuration and all rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot step time vs ranks per shape (needs matplotlib)")
    p.add_argument("--quick", action="store_true", help="tiny and short (h 256, T 8, worlds 1,2)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the float64 check")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress on stderr")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds any one world's run (tpcore or torch) may take, default 1800")


def make_plan(args) -> dict:
    hidden = args.hidden or ([256] if args.quick else [1024, 4096])
    tokens = args.tokens or ([8] if args.quick else [8, 512])
    worlds = args.worlds or ([1, 2] if args.quick else [1, 2, 4])
    if args.ffn_mult < 1:
        raise ValueError(f"--ffn-mult must be >= 1, got {args.ffn_mult}")
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if warmup < 1:
        raise ValueError(f"--warmup must be >= 1 (the first step is also the float64 check), got {warmup}")
    target = args.target_time if args.target_time is not None else (0.05 if args.quick else 0.5)
    if not target > 0:
        raise ValueError(f"--target-time must be > 0, got {target}")
    max_iters = args.max_iters if args.max_iters is not None else (10 if args.quick else 100)
    if max_iters < 1:
        raise ValueError(f"--max-iters must be >= 1, got {max_iters}")
    if args.check_rows < 1:
        raise ValueError(f"--check-rows must be >= 1, got {args.check_rows}")
    shapes = [{"hidden": h, "ffn": args.ffn_mult * h, "tokens": t} for h in hidden for t in tokens]
    return {"shapes": shapes, "worlds": worlds, "warmup": warmup, "target_s": target, "min_iters": 3,
            "max_iters": max_iters, "iters": args.iters, "check": args.check, "check_rows": args.check_rows,
            "progress": args.progress}


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
        del mlp, y, dx, W1s, W2s, a, dh, yb, dW2, da, dW1, dxb
        gc.collect()
        comm.barrier()
    progress.done()
    return [{"numpy_threads": np_threads}] + rows


# -------------------------------------------------------------- torch peer

def _torch_worker(rank: int, n: int, port: int, plan: dict, iters: list, threads: int, conn) -> None:
    """One gloo rank (a multiprocessing "spawn" child): all shapes."""
    from tpcore.bench._peers import gloo_rank

    with gloo_rank(rank, n, port, conn, threads, timeout_s=600) as (torch, dist):
        import torch.nn.functional as F

        progress = Progress(plan["progress"] and rank == 0)
        comm_t = [0.0]

        def all_reduce(t):
            t0 = time.perf_counter_ns()
            dist.all_reduce(t)
            comm_t[0] += (time.perf_counter_ns() - t0) * 1e-9
            return t

        class CopyToParallel(torch.autograd.Function):
            """fc1's input: identity forward, all-reduce of the gradient backward."""
            @staticmethod
            def forward(ctx, t):
                return t

            @staticmethod
            def backward(ctx, g):
                return all_reduce(g.contiguous())

        class ReduceFromParallel(torch.autograd.Function):
            """fc2's output: all-reduce forward, identity backward."""
            @staticmethod
            def forward(ctx, t):
                return all_reduce(t)

            @staticmethod
            def backward(ctx, g):
                return g

        def barrier():
            dist.barrier()

        rows = []
        for shape, it in zip(plan["shapes"], iters):
            h, f, t = shape["hidden"], shape["ffn"], shape["tokens"]
            tag = f"[layers] torch n={n} h={h} T={t}"
            progress.status(f"{tag}: setup", important=True)
            fl = f // n + (1 if rank < f % n else 0)
            g = torch.Generator().manual_seed(1234 + rank)
            W1 = torch.nn.Parameter(torch.randn(fl, h, generator=g) / math.sqrt(h))
            b1 = torch.nn.Parameter(torch.randn(fl, generator=g) * 0.1)
            W2 = torch.nn.Parameter(torch.randn(h, fl, generator=g) / math.sqrt(f))
            b2 = torch.nn.Parameter(torch.randn(h, generator=torch.Generator().manual_seed(99)) * 0.1)
            xn, dyn = _inputs(h, t)
            x = torch.from_numpy(xn).requires_grad_(True)
            dyt = torch.from_numpy(dyn)

            def forward(xin):
                hh = F.linear(CopyToParallel.apply(xin), W1, b1)
                return ReduceFromParallel.apply(F.linear(F.gelu(hh), W2)) + b2

            def step():
                x.grad = None
                forward(x).backward(dyt)

            def fwd():
                with torch.no_grad():
                    forward(x)

            row = {"hidden": h, "ffn": f, "tokens": t, "n": n, "rank": rank, "threads": torch.get_num_threads(),
                   "iters": it}
            y = forward(x)
            y.backward(dyt)
            if plan["check"]:  # float64, per-rank partial sums all-reduced (the TP math), on the first rows
                k = min(t, plan["check_rows"])
                with torch.no_grad():
                    x64, dy64 = x.detach()[:k].double(), dyt[:k].double()
                    W1d, b1d, W2d = W1.detach().double(), b1.detach().double(), W2.detach().double()
                    z = x64 @ W1d.T + b1d
                    yp = F.gelu(z) @ W2d.T
                    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2.0)))
                    dxp = ((dy64 @ W2d) * (cdf + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi))) @ W1d
                    dist.all_reduce(yp)
                    dist.all_reduce(dxp)
                    yref = yp + b2.detach().double()
                    if rank == 0:
                        row["err_y"] = float((y.detach()[:k].double() - yref).abs().max())
                        row["err_dx"] = float((x.grad[:k].double() - dxp).abs().max())
                        row["ref_max"] = float(max(yref.abs().max(), dxp.abs().max()))
                        row["check_rows"] = k
            for _ in range(max(0, plan["warmup"] - 1)):
                barrier()
                step()
            progress.status(f"{tag}: {it} steps", important=True)
            comm_t[0] = 0.0
            row["step_s"] = _timed(step, it, barrier)
            row["comm_total_s"] = comm_t[0]
            row["fwd_s"] = _timed(fwd, max(1, it), barrier)
            rows.append(row)
            del W1, b1, W2, b2, x, dyt, y
            gc.collect()
        progress.done()
        info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "interop_threads": torch.get_num_interop_threads(),
                "mkl": bool(torch.backends.mkl.is_available()), "mkldnn": bool(torch.backends.mkldnn.is_available())}
        try:
            import re
            m = re.search(r"BLAS_INFO=([\w.-]+)", torch.__config__.show())
            info["blas"] = f"BLAS_INFO={m.group(1)}" if m else None
        except Exception:  # noqa: BLE001
            pass
        conn.send(("ok", rows, info))


def _run_torch(n: int, plan: dict, iters: list, threads: int, timeout: float):
    """(per-rank rows, info) or (None, note)."""
    from tpcore.bench._peers import run_ranks

    per_rank, info, note = run_ranks(n, _torch_worker, (plan, iters, threads), timeout, "torch")
    return (per_rank, info) if per_rank is not None else (None, note)


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


def _combine_torch(per_rank: list, n: int) -> list:
    out = []
    for k in range(len(per_rank[0])):
        rr = [per_rank[r][k] for r in range(n)]
        r0 = rr[0]
        out.append({"hidden": r0["hidden"], "ffn": r0["ffn"], "tokens": r0["tokens"], "n": n,
                    "threads": r0["threads"], "iters": r0["iters"],
                    "step_ms": max(np.mean(r["step_s"]) for r in rr) * 1e3,
                    "step_min_ms": max(np.min(r["step_s"]) for r in rr) * 1e3,
                    "fwd_ms": max(np.mean(r["fwd_s"]) for r in rr) * 1e3,
                    "comm_share": max(r["comm_total_s"] / float(np.sum(r["step_s"])) for r in rr),
                    "err_y": r0.get("err_y"), "err_dx": r0.get("err_dx"), "ref_max": r0.get("ref_max")})
    return out


# ---------------------------------------------------------------- printing

def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _numpy_blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        libs = [d for d in threadpool_info() if d.get("user_api") == "blas"
                and not os.path.abspath(d["filepath"]).startswith(here + os.sep)]
        if libs:
            d = libs[0]
            return (f"{d.get('internal_api')} {d.get('version')} ({os.path.basename(d['filepath'])}, "
                    f"{d.get('architecture')}, {d.get('threading_layer')}, {d.get('num_threads')} threads by default)")
    except ImportError:
        pass
    try:
        cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{cfg.get('name')} {cfg.get('version')}"
    except Exception:  # noqa: BLE001
        return "unknown"


def print_header(env: dict, plan: dict, peers: List[str], worlds_threads: dict) -> None:
    import tpcore

    w = sys.stdout.write
    w("# tpcore layers benchmark: ParallelMLP (column fc1 -> GELU -> row fc2), forward + backward\n#\n")
    aff = env.get("affinity")
    w(f"#  host {env['hostname']}: nproc {env['nproc']}{f' ({aff} usable)' if aff and aff != env['nproc'] else ''}"
      f", {env.get('cpu') or 'unknown CPU'}\n")
    w(f"#  python {env['python']}, numpy {env['numpy']}, tpcore {env['tpcore']}, torch {_version('torch') or '-'}"
      f", threadpoolctl {_version('threadpoolctl') or '- (not installed)'}, scipy {_version('scipy') or '-'}\n")
    build = env.get("tpcore_build") or {}
    w(f"#  tpcore build: {build.get('build', '?')}, backends {build.get('backends')}, "
      f"sanitize {build.get('sanitize') or 'none'}\n")
    w(f"#  tpcore BLAS: {tpcore.build_info().get('blas')}\n")
    w(f"#  NumPy BLAS:  {_numpy_blas_info()}\n")
    w("#  " + "  ".join(f"{k}={env.get(k) if env.get(k) is not None else '(unset)'}"
                        for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")) + "\n")
    others = {k: v for k, v in env.get("env", {}).items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    if others:
        w("#  " + "  ".join(f"{k}={v}" for k, v in others.items()) + "\n")
    w(f"#  BLAS threads per rank (tpcore default: cores / local ranks; NumPy and torch set to the same): "
      + ", ".join(f"n={n}: {t}" for n, t in worlds_threads.items()) + "\n")
    cores = env.get("affinity") or env.get("nproc") or 1
    over = [n for n in plan["worlds"] if n > cores]
    if over:
        w(f"#  worlds {','.join(map(str, over))} exceed the {cores} usable cores: those ranks share cores "
          f"(oversubscribed), so their per-rank GF/s are a share of a core\n")
    shapes = ", ".join(f"h={s['hidden']} f={s['ffn']} T={s['tokens']}" for s in plan["shapes"])
    w(f"#  shapes {shapes}; worlds {','.join(map(str, plan['worlds']))}; float32\n")
    it = (f"{plan['iters']} per configuration" if plan["iters"] else
          f"auto (~{plan['target_s']:g} s of steps per configuration, {plan['min_iters']}..{plan['max_iters']})")
    w(f"#  iterations {it}; {plan['warmup']} warm-up step(s) (the first also checks against float64)\n")
    load = env.get("loadavg")
    if load:
        w(f"#  load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start (other work on the machine "
          f"disturbs the numbers)\n")
    if peers:
        from tpcore.bench._peers import availability
        why = availability("gloo")
        what = f"skipped, {why}" if why else f"torch {_version('torch')}"
        w(f"#  peer  torch.distributed gloo: {what}\n")
    else:
        w("#  peer  none\n")
    sys.stdout.flush()


def _f(v, spec, width):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return f"{'-':>{width}}"
    return f"{v:>{width}{spec}}"


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


def _err_flag(row) -> str:
    e = row.get("err_y")
    if e is None:
        return ""
    tol = CHECK_TOL * max(1.0, row.get("ref_max") or 0.0)
    return "" if max(row["err_y"], row["err_dx"]) <= tol else " BAD"


def print_tables(rows: list, torch_rows: list, torch_note: Optional[str]) -> None:
    w = sys.stdout.write
    w("#\n# tpcore ParallelMLP (times: per rank mean/min over iterations, max over ranks; GF/s: slowest rank)\n")
    w(f"#{'h':>5} {'f':>6} {'T':>4} {'n':>2} {'thr':>3} {'iters':>5} {'step ms':>9} {'min ms':>9} {'fwd ms':>9} "
      f"{'GF/s':>7} {'GF/s-c':>7} {'NumPy':>7} {'/NP':>5} {'/NP-c':>5} {'comm%':>6} {'param':>7} "
      f"{'err y':>8} {'err dx':>8}\n")
    for r in rows:
        w(f" {r['hidden']:>5} {r['ffn']:>6} {r['tokens']:>4} {r['n']:>2} {r['threads']:>3} {r['iters']:>5} "
          f"{r['step_ms']:>9.3f} {r['step_min_ms']:>9.3f} {r['fwd_ms']:>9.3f} {r['gflops']:>7.1f} "
          f"{r['gflops_nocomm']:>7.1f} {r['numpy_gflops']:>7.1f} {r['ratio_numpy']:>5.2f} "
          f"{r['ratio_numpy_nocomm']:>5.2f} {100 * r['comm_share']:>5.1f}% {r['param_ratio']:>7.4f} "
          f"{_f(r['err_y'], '.1e', 8)} {_f(r['err_dx'], '.1e', 8)}{_err_flag(r)}\n")
    w("#\n# where a rank's bytes are (ParallelMLP.memory() after the timed steps, the largest rank; MB) and the "
      "process's peak RSS\n")
    w(f"#{'h':>5} {'f':>6} {'T':>4} {'n':>2} {'params':>8} {'grads':>8} {'work':>8} {'comm':>7} {'total':>8} "
      f"{'peak RSS':>9}\n")
    for r in rows:
        m = r["memory"]
        w(f" {r['hidden']:>5} {r['ffn']:>6} {r['tokens']:>4} {r['n']:>2} {m['params'] / 1e6:>8.2f} "
          f"{m['grads'] / 1e6:>8.2f} {m['workspace'] / 1e6:>8.2f} {m['comm'] / 1e6:>7.2f} {m['total'] / 1e6:>8.2f} "
          f"{r['rss_peak_bytes'] / 1e6:>9.0f}\n")
    if torch_rows or torch_note:
        w("#\n# vs torch.distributed gloo (same shapes, threads and iterations; speed-up = torch / tpcore)\n")
    if torch_rows:
        idx = {(r["hidden"], r["tokens"], r["n"]): r for r in torch_rows}
        w(f"#{'h':>5} {'f':>6} {'T':>4} {'n':>2} {'thr':>3} {'tpcore ms':>10} {'torch ms':>10} {'speed-up':>9} "
          f"{'tp fwd':>9} {'torch fwd':>10} {'fwd s-up':>9} {'torch comm%':>12} {'torch err':>10}\n")
        for r in rows:
            q = idx.get((r["hidden"], r["tokens"], r["n"]))
            if q is None:
                continue
            err = None if q.get("err_y") is None else max(q["err_y"], q["err_dx"])
            w(f" {r['hidden']:>5} {r['ffn']:>6} {r['tokens']:>4} {r['n']:>2} {q['threads']:>3} "
              f"{r['step_ms']:>10.3f} {q['step_ms']:>10.3f} {q['step_ms'] / r['step_ms']:>8.2f}x "
              f"{r['fwd_ms']:>9.3f} {q['fwd_ms']:>10.3f} {q['fwd_ms'] / r['fwd_ms']:>8.2f}x "
              f"{100 * q['comm_share']:>11.1f}% {_f(err, '.1e', 10)}{_err_flag(q)}\n")
    if torch_note:
        w(f"#  torch: {torch_note}\n")
    sys.stdout.flush()


def summarize(rows: list, torch_rows: list) -> dict:
    w = sys.stdout.write
    s: dict = {"targets": TARGETS}
    w("#\n# " + "=" * 100 + "\n# Summary\n")
    lo = min(rows, key=lambda r: r["ratio_numpy"])
    lo_c = min(rows, key=lambda r: r["ratio_numpy_nocomm"])
    below = [r for r in rows if r["ratio_numpy_nocomm"] < TARGETS["numpy_ratio"]]
    s["numpy_ratio_min"] = lo["ratio_numpy"]
    s["numpy_ratio_nocomm_min"] = lo_c["ratio_numpy_nocomm"]
    s["numpy_below_target"] = [_key(r) for r in below]
    w(f"#  tpcore / NumPy GF/s: min {lo['ratio_numpy']:.2f} (step, at {_key(lo)}), min {lo_c['ratio_numpy_nocomm']:.2f}"
      f" without communication (at {_key(lo_c)}); target >= {TARGETS['numpy_ratio']}\n")
    if below:
        w(f"#    below target without communication at: "
          + ", ".join(f"{_key(r)} {r['ratio_numpy_nocomm']:.2f}" for r in below) + "\n")
    cs = [r for r in rows if r["hidden"] == 1024 and r["tokens"] == 8 and r["n"] == 2]
    if cs:
        r = cs[0]
        s["comm_share_h1024_T8_n2"] = r["comm_share"]
        ok = r["comm_share"] < TARGETS["comm_share"]
        w(f"#  comm share at h=1024 T=8 n=2: {100 * r['comm_share']:.1f}% (max over ranks; mean "
          f"{100 * r['comm_share_mean']:.1f}%), target < {100 * TARGETS['comm_share']:.0f}% -> "
          f"{'OK' if ok else 'MISSED'}\n")
    pr = max(rows, key=lambda r: r["param_ratio"])
    s["param_ratio_max"] = pr["param_ratio"]
    ok = abs(pr["param_ratio"] - 1) <= TARGETS["param_ratio"]
    w(f"#  per-rank parameter bytes / (full / n): max {pr['param_ratio']:.4f} (at {_key(pr)}), target within "
      f"{100 * TARGETS['param_ratio']:.0f}% -> {'OK' if ok else 'MISSED'}\n")
    bad = [r for r in rows if _err_flag(r)]
    s["check_failed"] = [_key(r) for r in bad]
    checked = [r for r in rows if r.get("err_y") is not None]
    if checked:
        w(f"#  float64 check: max err y {max(r['err_y'] for r in checked):.1e}, dx "
          f"{max(r['err_dx'] for r in checked):.1e}" + (f"; FAILED at {', '.join(_key(r) for r in bad)}" if bad
                                                         else " -> OK") + "\n")
    if torch_rows:
        idx = {(r["hidden"], r["tokens"], r["n"]): r for r in torch_rows}
        sp = []
        for r in rows:
            q = idx.get((r["hidden"], r["tokens"], r["n"]))
            if q:
                sp.append((r, q["step_ms"] / r["step_ms"], q["fwd_ms"] / r["fwd_ms"]))
        s["speedup_vs_torch"] = [{"config": _key(r), "step": a, "fwd": b} for r, a, b in sp]
        slower = [(r, a, b) for r, a, b in sp if a < 1 or b < 1]
        if sp:
            w(f"#  speed-up vs torch/gloo (step): min {min(a for _, a, _ in sp):.2f}x, max "
              f"{max(a for _, a, _ in sp):.2f}x; forward only: min {min(b for _, _, b in sp):.2f}x, max "
              f"{max(b for _, _, b in sp):.2f}x\n")
            if slower:
                w("#  tpcore slower than torch at: " + ", ".join(f"{_key(r)} (step {a:.2f}x, fwd {b:.2f}x)"
                                                               for r, a, b in slower) + "\n")
            else:
                w(f"#  tpcore faster than torch at all {len(sp)} configurations (step and forward only)\n")
        tbad = [q for q in torch_rows if _err_flag(q)]
        if tbad:
            w(f"#  torch float64 check FAILED at {', '.join(_key(q) for q in tbad)} (its timings are suspect)\n")
    sys.stdout.flush()
    return s


def _key(r) -> str:
    return f"h={r['hidden']} T={r['tokens']} n={r['n']}"


def plot(path: str, rows: list, torch_rows: list, env: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("# --plot: matplotlib is not installed, so no plot was written (pip install matplotlib)",
              file=sys.stderr)
        return False
    shapes = sorted({(r["hidden"], r["tokens"]) for r in rows})
    ncols = 2 if len(shapes) > 1 else 1
    nrows = (len(shapes) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4 * nrows + 0.6), squeeze=False)
    legend: dict = {}
    for k, (h, t) in enumerate(shapes):
        ax = axes[k // ncols][k % ncols]
        for series, label, style in ((rows, "tpcore", dict(color="C0", marker="o")),
                                     (torch_rows, "torch gloo", dict(color="C2", marker="^"))):
            pts = sorted((r["n"], r["step_ms"], r["fwd_ms"]) for r in series if (r["hidden"], r["tokens"]) == (h, t))
            if not pts:
                continue
            ns, st, fw = zip(*pts)
            ax.plot(ns, st, label=f"{label} fwd+bwd", **style)
            ax.plot(ns, fw, label=f"{label} fwd", linestyle="--", alpha=0.7, **style)
        ax.set_xticks(sorted({r["n"] for r in rows}))
        ax.set_yscale("log")
        # labels at 1, 2, 5 x 10^k only (labelling every minor tick made 0.9 and 1 overlap)
        fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(base=10, subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(fmt)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(f"h={h}, f={4 * h if not rows else next(r['ffn'] for r in rows if r['hidden'] == h)}, T={t}")
        ax.set_xlabel("ranks")
        ax.set_ylabel("ms per step")
        ax.grid(True, alpha=0.3, which="both")
        for hd, lb in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lb, hd)
    for k in range(len(shapes), nrows * ncols):
        axes[k // ncols][k % ncols].set_visible(False)
    fig.suptitle(f"ParallelMLP step time on {env['hostname']} ({env['nproc']} CPUs; lower is better)", fontsize=11)
    cols = 4 if ncols > 1 else 2  # one panel wide: two legend rows, so that nothing is cut off
    fig.legend(list(legend.values()), list(legend.keys()), loc="lower center", ncol=cols, fontsize=9)
    rows_of_legend = -(-len(legend) // cols)
    fig.tight_layout(rect=(0, 0.35 * rows_of_legend / (4 * nrows + 0.6), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# wrote {path}")
    return True


# --------------------------------------------------------------------- run

def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _threads_for(n: int) -> int:
    from tpcore.utils.runtime import default_threads
    return default_threads(n)


def run(args) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    import tpcore

    try:
        plan = make_plan(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    peers = [] if args.peers == "none" else (list(PEERS) if args.peers == "auto" else args.peers)
    if args.peers == "auto" and importlib.util.find_spec("torch") is None:
        torch_note = "not measured: torch is not installed (pip install torch)"
        peers = []
    else:
        torch_note = None if peers else "not measured (--peers none)"
    env = env_info()
    print_header(env, plan, peers, {n: _threads_for(n) for n in plan["worlds"]})
    progress = Progress(args.progress)
    t_start = time.perf_counter()
    rows, torch_rows, np_threads, torch_info = [], [], {}, {}
    for n in plan["worlds"]:
        t0 = time.perf_counter()
        per_rank = tpcore.spawn(_tpcore_rank, n, args=(plan,), deadline=args.timeout)
        np_threads[n] = per_rank[0][0]["numpy_threads"]
        mine = _combine_tpcore([pr[1:] for pr in per_rank], n)
        rows += mine
        progress.done(f"[layers] tpcore n={n}: {time.perf_counter() - t0:.1f} s")
        if peers:
            t0 = time.perf_counter()
            res, info = _run_torch(n, plan, [r["iters"] for r in mine], mine[0]["threads"], args.timeout)
            if res is None:
                torch_note = info
                peers = []
            else:
                torch_rows += _combine_torch(res, n)
                torch_info = info
            progress.done(f"[layers] torch n={n}: {time.perf_counter() - t0:.1f} s")
    first = next(iter(np_threads.values()))
    print(f"#  NumPy BLAS threads set by: {first['method']} ("
          + ", ".join(f"n={n}: {v['threads']}" for n, v in np_threads.items()) + ")")
    if torch_info:
        print(f"#  torch ranks: torch {torch_info.get('torch')}, mkl {torch_info.get('mkl')}, mkldnn "
              f"{torch_info.get('mkldnn')}, interop threads {torch_info.get('interop_threads')}"
              + (f", {torch_info['blas']}" if torch_info.get("blas") else ""))
    print_tables(rows, torch_rows, torch_note)
    summary = summarize(rows, torch_rows)
    elapsed = time.perf_counter() - t_start
    print(f"# total time {elapsed:.1f} s")
    if args.json:
        try:
            env["loadavg_end"] = list(os.getloadavg())
        except OSError:
            pass
        options = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
        doc = {"env": env, "argv": sys.argv, "options": options, "plan": plan, "rows": rows,
               "torch_rows": torch_rows, "torch_info": torch_info, "torch_note": torch_note,
               "numpy_threads": {str(k): v for k, v in np_threads.items()}, "summary": summary,
               "seconds": round(elapsed, 1)}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"# wrote {args.json}")
    if args.plot:
        plot(args.plot, rows, torch_rows, env)
    failed = summary.get("check_failed")
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tpcore.bench layers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


__all__ = ["add_arguments", "run", "main"]
