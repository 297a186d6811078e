"""Collectives benchmark: tpcore against memcpy, torch.distributed/gloo and MPI.

    python -m tpcore.bench collectives -n 2                # 8 B .. 256 MiB, all ops, both modes
    python -m tpcore.bench collectives -n 2 --quick        # small and short (CI smoke test)
    python benchmarks/collectives.py -n 4 --ops all_reduce --json out.json --plot out.png

For each op and size the table shows, as nccl-tests does:

  size     bytes: the buffer of all_reduce and broadcast, the OUTPUT of
           all_gather (each rank contributes size/n), the INPUT of
           reduce_scatter (each rank receives size/n), each rank's input
           (and output) of all_to_all (size/n to each rank)
  count    elements of that buffer
  type     the dtype
  time     mean microseconds per call (per rank the mean over the timed
           iterations; reported: the max over ranks, since a collective is
           done when its slowest rank is)
  algbw    size / time, GB/s (10^9 bytes per second)
  busbw    algbw * 2(n-1)/n for all_reduce, * (n-1)/n for all_gather,
           reduce_scatter and all_to_all, * 1 for broadcast: the bandwidth per link that
           an optimal algorithm needs, comparable across ops and rank counts
           (0 for n = 1)
  #wrong   elements that differ from a NumPy reference in a check after
           the timing (summed over ranks): every rank fills its input with
           f(rank, i) = rank + 1 + i % 5, runs the op once and compares the
           result with what it computes itself
  iters    timed calls
  memcpy   single-thread np.copyto bandwidth at the same size, measured in
           the same run: the reference for what one core can move

Method.  Every op runs in place (NCCL's in-place mode; root 0 for broadcast,
sum for the reductions) except all_to_all, which has no in-place form (an output
beside the input, even splits as nccl-tests').  Before EACH timed call every rank rewrites its input
from a prepared source (np.copyto) and the ranks pass a barrier; neither is
timed: only the call itself, with time.perf_counter_ns.  Warm-up calls come
first; rank 0 times one whole iteration and picks the iteration count so a
size takes about --target-time seconds (at least 3, at most --max-iters), and
every rank uses that count.  Modes: "private" arrays are ordinary NumPy
arrays; "registered" arrays are views of one comm.alloc() allocation at the
same offset on every rank, so tpcore can take its zero-copy path (the JSON
records which calls did).

The sizes are min, min*factor, ... up to max, plus max itself and the
summary's reference sizes (4 KiB, 1 MiB, 16 MiB, 64 MiB) where they fall
between min and max.

Busy machine.  --background-load N starts N processes that only spin (one
Python loop each) for the whole run, beside the ranks, and stops them at the
end, on an error or on Ctrl-C / SIGTERM (each also exits by itself within
about 0.1 s of the benchmark's process going away).  The header and the line
above the tables state the load.  With more runnable processes than cores,
tpcore's waits stop spinning and sleep (see csrc/comm/shm/shm_wait.c).

Peers (optional, skipped with a note when missing): torch.distributed with
gloo and mpi4py over mpirun run the same loop on the same number of ranks;
see tpcore.bench._peers.  The summary compares all_reduce at the reference
sizes and lists every op and size where tpcore (private arrays) is slower
than a peer.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import List

from tpcore.bench import _report
from tpcore.bench._peers import PEERS, run_peer
from tpcore.bench._sweep import (MODES, OPS, Plan, Progress, combine, env_info, memcpy_reference, numpy_dtype,
                                 parse_bytes, size_list)

SUMMARY_SIZES = (4 << 10, 1 << 20, 16 << 20, 64 << 20)
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
QUICK_MAX_BYTES = 4 << 20


def _csv(choices, what):
    def parse(text):
        items = [s.strip() for s in text.split(",") if s.strip()]
        if items == ["all"]:
            return list(choices)
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list of "
                                             f"{', '.join(choices)} (or all), got {text!r}")
        return items
    return parse


def _bytes(text):
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _iters(text):
    if text == "auto":
        return None
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"--iters must be 'auto' or an int >= 1, got {text!r}")
    return v


def _peers(text):
    if text in ("auto", "none"):
        return text
    return _csv(PEERS, "--peers")(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nranks", type=int, default=2, help="ranks (local processes), default 2")
    p.add_argument("--ops", type=_csv(OPS, "--ops"), default=list(OPS),
                   help=f"comma-separated, default all: {','.join(OPS)}")
    p.add_argument("--min-bytes", type=_bytes, default=8, help="smallest size (8, 4K, 1M...), default 8")
    p.add_argument("--max-bytes", type=_bytes, default=None,
                   help=f"largest size, default 256M (--quick: {QUICK_MAX_BYTES >> 20}M)")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows, default 4")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="default float32")
    p.add_argument("--iters", type=_iters, default=None, metavar="auto|N",
                   help="timed calls per size; auto (default) aims at --target-time per size")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per size, default 2 (--quick: 1)")
    p.add_argument("--target-time", type=float, default=None,
                   help="auto iterations: seconds of timed calls per size, default 0.3 (--quick: 0.02)")
    p.add_argument("--max-iters", type=int, default=None, help="auto iterations cap, default 1000 (--quick: 50)")
    p.add_argument("--mode", type=_csv(MODES, "--mode"), default=None,
                   help="private,registered (default both)")
    p.add_argument("--no-registered", dest="registered", action="store_false", default=True,
                   help="private arrays only (same as --mode private)")
    p.add_argument("--peers", type=_peers, default="auto",
                   help="auto (default: every peer that is installed), none, or a list of gloo,mpi,tpcore-mpi")
    p.add_argument("--mpirun", default="mpirun", help="mpirun command for the MPI peer")
    p.add_argument("--mpi-args", default="", help="extra mpirun arguments, e.g. --mpi-args='--bind-to none'")
    p.add_argument("--json", metavar="FILE", help="write environment, configuration and all rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw vs size (needs matplotlib)")
    p.add_argument("--quick", action="store_true",
                   help="small and short: max 4 MiB unless --max-bytes, fewer iterations")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress on stderr")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds any one implementation's run may take, default 3600")
    p.add_argument("--history", choices=("on", "off"), default=None,
                   help="the communicators' call history (TPCORE_HISTORY): off measures without it; "
                        "default: as the environment says (on)")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="run N busy (spinning) processes beside the ranks for the whole run, default 0")


def make_plan(args) -> Plan:
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.target_time is not None and not args.target_time > 0:
        raise ValueError(f"--target-time must be > 0 seconds, got {args.target_time}")
    if args.max_iters is not None and args.max_iters < 3:
        raise ValueError(f"--max-iters must be >= 3, got {args.max_iters}")
    max_bytes = args.max_bytes if args.max_bytes is not None else (QUICK_MAX_BYTES if args.quick else 256 << 20)
    sizes = size_list(args.min_bytes, max_bytes, args.factor)
    extra = {max_bytes} | {s for s in SUMMARY_SIZES if args.min_bytes <= s <= max_bytes}
    sizes = sorted(set(sizes) | extra)
    if not args.registered and args.mode and "registered" in args.mode:
        raise ValueError("--no-registered contradicts --mode registered")
    modes = args.mode or (list(MODES) if args.registered else ["private"])
    return Plan(ops=args.ops, sizes=sizes, dtype=args.dtype, modes=modes, iters=args.iters,
                warmup=args.warmup if args.warmup is not None else (1 if args.quick else 2),
                target_s=args.target_time if args.target_time is not None else (0.02 if args.quick else 0.3),
                min_iters=3, max_iters=args.max_iters if args.max_iters is not None else (50 if args.quick else 1000),
                check=args.check)


# A busy process: spins, and leaves by itself once its parent (the benchmark) is gone.
_BUSY_CODE = ("import os, sys\n"
              "parent = int(sys.argv[1])\n"
              "while os.getppid() == parent:\n"
              "    for _ in range(200000):\n"
              "        pass\n")
BUSY_MARKER = "tpcore-bench-background-load"


class BackgroundLoad:
    """N processes that spin for as long as the `with` block runs; always stopped at its end."""

    def __init__(self, n: int):
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"--background-load must be an int >= 0, got {n!r}")
        self.n = n
        self.procs: List[subprocess.Popen] = []

    def __enter__(self) -> "BackgroundLoad":
        try:
            for _ in range(self.n):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", _BUSY_CODE, str(os.getpid()), BUSY_MARKER],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a killed process always goes
                pass
        self.procs = []

    def describe(self) -> str:
        if not self.n:
            return "none"
        return f"{self.n} busy process{'es' if self.n != 1 else ''} spinning beside the ranks for the whole run"


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the cleanup of ranks and peers


def run(args) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    if args.nranks < 1:
        raise SystemExit(f"-n must be >= 1, got {args.nranks}")
    import tpcore

    from tpcore.bench._tpcore import rank_main

    if args.background_load < 0:
        raise SystemExit(f"--background-load must be >= 0, got {args.background_load}")
    try:
        plan = make_plan(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    numpy_dtype(plan.dtype)  # a missing ml_dtypes (bfloat16) stops here, not in every rank
    peer_names = [] if args.peers == "none" else (list(PEERS) if args.peers == "auto" else args.peers)
    env = env_info()
    saved = os.environ.get("TPCORE_HISTORY")
    if args.history == "off":
        os.environ["TPCORE_HISTORY"] = "0"  # the ranks inherit it
    elif args.history == "on" and saved == "0":
        del os.environ["TPCORE_HISTORY"]
    try:
        with BackgroundLoad(args.background_load) as load:
            return _run_loaded(args, plan, peer_names, env, load, rank_main, tpcore)
    finally:
        if saved is None:
            os.environ.pop("TPCORE_HISTORY", None)
        else:
            os.environ["TPCORE_HISTORY"] = saved


def _run_loaded(args, plan, peer_names, env, load, rank_main, tpcore) -> int:
    _report.print_header(env, args, plan, peer_names, mpirun=args.mpirun)
    print(f"#  background load: {load.describe()}")
    print(f"#  call history: {'off (TPCORE_HISTORY=0)' if os.environ.get('TPCORE_HISTORY') == '0' else 'on'}")
    progress = Progress(args.progress)
    t_start = time.perf_counter()

    memcpy = memcpy_reference(plan.sizes, plan, progress)

    t0 = time.perf_counter()
    per_rank = tpcore.spawn(rank_main, args.nranks, args=(plan.to_json(), args.progress), deadline=args.timeout)
    rows = combine("tpcore", args.nranks, plan.dtype, per_rank)
    progress.done(f"[bench] tpcore: {time.perf_counter() - t0:.1f} s")

    peers = []
    for name in peer_names:
        p = run_peer(name, args.nranks, plan, args.timeout, args.progress, args.mpirun, args.mpi_args)
        peers.append(p)
        if p.rows is not None:
            rows += p.rows
            progress.done(f"[bench] {p.name}: {p.info.get('seconds', '?')} s")
        else:
            progress.done(f"[bench] {p.name}: {p.note}")

    if load.n:
        print(f"# background load during these tables: {load.describe()}")
    _report.print_tables(rows, memcpy, plan, args.nranks, peers)
    summary = _report.print_summary(rows, memcpy, plan, args.nranks, peers, SUMMARY_SIZES)
    elapsed = time.perf_counter() - t_start
    print(f"# total time {elapsed:.1f} s")

    if args.json:
        env["loadavg_end"] = _loadavg()
        env["background_load"] = load.n
        options = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
        doc = {"env": env, "argv": sys.argv, "options": options, "plan": plan.to_json(), "nranks": args.nranks,
               "memcpy": memcpy, "rows": rows, "summary": summary, "seconds": round(elapsed, 1),
               "peers": {p.name: {"measured": p.rows is not None, "note": p.note, "info": p.info} for p in peers}}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"# wrote {args.json}")
    if args.plot:
        _report.plot(args.plot, rows, memcpy, plan, args.nranks, env, args.factor)
    bad = [r for r in rows if r["impl"] in ("tpcore", "tpcore-mpi") and r.get("wrong")]
    return 1 if bad else 0


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tpcore.bench collectives", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


__all__ = ["add_arguments", "run", "main", "BackgroundLoad"]
