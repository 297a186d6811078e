#!/usr/bin/env python
"""What the collective history costs per call, measured paired in one job.

    python benchmarks/history_overhead.py -n 2 --bytes 4096 --rounds 40

Each rank holds two communicators over the same ranks, one with the history on
(TPCORE_HISTORY unset: 64 entries, call sites captured) and one with it off
(TPCORE_HISTORY=0), and times blocks of back-to-back float32 all_reduce calls from
Python on each in turn (AB BA AB ...), so load from other processes on a shared machine
falls on both alike.  Per block: mean microseconds per call, the max over ranks.
Printed: the median and the minimum over blocks of each, and their differences.
`python -m tpcore.bench collectives --history on|off` measures the same switch with
the nccl-tests method (a barrier before each call) in separate runs.
"""
import argparse
import os
import statistics
import sys
import time

try:
    import tpcore
except ImportError:  # a source checkout that is not installed (the extension must be built)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import tpcore

import numpy as np


def _rank(comm, nbytes, rounds, calls):
    os.environ.pop("TPCORE_HISTORY", None)
    on = comm.split(0)
    os.environ["TPCORE_HISTORY"] = "0"
    off = comm.split(0)
    x = np.ones(max(1, nbytes // 4), np.float32)
    times = {"on": [], "off": []}
    for c in (on, off):  # warm up
        for _ in range(calls):
            c.all_reduce(x)
    for i in range(rounds):
        pair = (("on", on), ("off", off))
        for name, c in pair if i % 2 == 0 else pair[::-1]:  # ABBA: neither goes first always
            c.barrier()
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                c.all_reduce(x)
            times[name].append((time.perf_counter_ns() - t0) / calls / 1e3)
    assert len(on.history()) == 64 and off.history() == []
    on.close()
    off.close()
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nranks", type=int, default=2)
    p.add_argument("--bytes", type=int, default=4096, help="all_reduce size in bytes, default 4096")
    p.add_argument("--rounds", type=int, default=40, help="block pairs, default 40")
    p.add_argument("--calls", type=int, default=2000, help="calls per block, default 2000")
    a = p.parse_args(argv)
    per_rank = tpcore.spawn(_rank, a.nranks, args=(a.bytes, a.rounds, a.calls), deadline=600)
    blocks = {k: [max(r[k][i] for r in per_rank) for i in range(a.rounds)] for k in ("on", "off")}
    med = {k: statistics.median(v) for k, v in blocks.items()}
    low = {k: min(v) for k, v in blocks.items()}
    diffs = sorted(on - off for on, off in zip(blocks["on"], blocks["off"]))
    print(f"all_reduce {a.bytes} B float32, {a.nranks} ranks, {a.rounds} x {a.calls} calls per setting (us per call)")
    print(f"  history on : median {med['on']:.3f}  min {low['on']:.3f}")
    print(f"  history off: median {med['off']:.3f}  min {low['off']:.3f}")
    print(f"  on - off   : median of paired differences {statistics.median(diffs) * 1e3:+.0f} ns "
          f"({statistics.median(diffs) / med['off'] * 100:+.1f}% of the median), "
          f"min vs min {(low['on'] - low['off']) * 1e3:+.0f} ns ({(low['on'] / low['off'] - 1) * 100:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
