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

This module holds the options and the driver; the ranks' code is in _layers_tpcore
(tpcore) and _layers_torch (the peer), the output in _layers_table.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import threading
import time

from tpcore.bench.collectives import _iters  # the same --iters parser
from tpcore.bench._layers_table import plot, print_header, print_tables, summarize
from tpcore.bench._layers_torch import _combine_torch, _run_torch
from tpcore.bench._layers_tpcore import _combine_tpcore, _tpcore_rank
from tpcore.bench._sweep import Progress, env_info

PEERS = ("gloo",)


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
