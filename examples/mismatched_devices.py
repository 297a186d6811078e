"""Mismatched devices: shards sized by measured speed, against equal shards, one rank slowed.

    python examples/mismatched_devices.py                    # 2 ranks, rank 1 made 3x slower
    python examples/mismatched_devices.py -n 3 --factor 2 --hidden 512 --ffn 4096 --rows 256

Tensor parallelism waits for the slowest shard at every collective: with equal shards a
device half as fast doubles the step.  Here rank 1 is made --factor times slower with
tpcore.set_throttle (it sleeps (factor - 1) x the time of each compute kernel; its
collectives stay real), as a slower GPU or CPU would be.  Then:

  1. tpcore.plan_from_measurements(dims, speeds) shows the plan for the speeds one expects
     (a pure function: [1, 1/factor, ...]) without measuring anything;
  2. tpcore.plan_partition(comm, dims) measures every rank (the throttle included), shares
     the measurements and gives every rank the same Plan: MLP columns (and, for a
     transformer, heads and vocabulary rows) in proportion to speed;
  3. a ParallelMLP forward and a TransformerLM prefill run on equal shards and on the
     planned shards (plan=plan), alternating, and the slowest rank's step time is printed.

Checks (exit status 1 when one fails): the planned split gives the slow rank fewer
columns than the others; the MLP's output on both splits equals a float64 NumPy
reference, and the transformer's logits on both splits agree.  Times are printed, not
checked: on a shared machine they move with its load.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import tpcore

SLOW = 1


def best_time(comm, fns, reps: int) -> list:
    """Per function: the fastest of reps calls, the slowest rank's (the job's step time); the
    functions alternate so that each sees the same machine."""
    for fn in fns:
        fn()  # warm-up
    best = [math.inf] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            comm.barrier()
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return comm.all_reduce(np.array(best), op="max").tolist()


def gelu_ref(h):
    return 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))


def job(comm, a):
    if comm.rank == SLOW:
        tpcore.set_throttle(a.factor)
    out = {}
    # --- a plain MLP: (hidden, ffn) dims
    dims = (a.hidden, a.ffn)
    expected = tpcore.plan_from_measurements(dims, [1.0 if r != SLOW else 1 / a.factor for r in range(comm.size)])
    plan = tpcore.plan_partition(comm, dims)
    g = np.random.default_rng(a.seed)
    W1 = (g.standard_normal((a.ffn, a.hidden)) / math.sqrt(a.hidden)).astype(np.float32)
    b1 = g.standard_normal(a.ffn).astype(np.float32)
    W2 = (g.standard_normal((a.hidden, a.ffn)) / math.sqrt(a.ffn)).astype(np.float32)
    b2 = g.standard_normal(a.hidden).astype(np.float32)
    x = g.standard_normal((a.rows, a.hidden)).astype(np.float32)
    mlps = []
    for kw in ({}, {"plan": plan}):
        m = tpcore.ParallelMLP(a.hidden, a.ffn, comm, activation="gelu_tanh", **kw)
        m.fc1.load_full(W1, b1)
        m.fc2.load_full(W2, b2)
        mlps.append(m)
    ref = gelu_ref(x.astype(np.float64) @ W1.T + b1) @ W2.astype(np.float64).T + b2
    out["mlp_err"] = [float(np.abs(m.forward(x) - ref).max()) for m in mlps]
    out["mlp_times"] = best_time(comm, [lambda m=m: m.forward(x) for m in mlps], a.reps)
    out["mlp_plan"], out["mlp_expected"] = str(plan), list(expected.ffn)
    out["mlp_cols"] = [[s for _, s in tpcore.partition(a.ffn, comm.size)], list(plan.ffn)]
    # --- a transformer: heads, MLP columns and vocabulary rows planned together
    cfg = tpcore.Config(vocab_size=a.vocab, hidden=a.hidden, layers=2, heads=8, ffn_hidden=a.ffn,
                        max_positions=max(64, a.rows), activation="gelu_tanh", positions="learned")
    tplan = tpcore.plan_partition(comm, cfg)
    prompt = g.integers(0, a.vocab, (1, a.rows))
    models = [tpcore.models.TransformerLM(cfg, comm, seed=a.seed, **kw) for kw in ({}, {"plan": tplan})]
    logits = [m.logits(prompt) for m in models]
    out["lm_diff"] = float(np.abs(logits[0] - logits[1]).max())
    out["lm_scale"] = float(np.abs(logits[0]).max())
    out["lm_times"] = best_time(comm, [lambda m=m: m.logits(prompt) for m in models], a.reps)
    out["lm_plan"] = str(tplan)
    tpcore.set_throttle(1.0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=2, help="ranks (default 2; rank 1 is the slow one)")
    ap.add_argument("--factor", type=float, default=3.0, help="how much slower rank 1 is (default 3)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=1024, help="MLP columns to split (default 1024)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--rows", type=int, default=32, help="tokens per step (default 32)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.n < 2:
        ap.error("-n must be at least 2 (rank 1 is the slow one)")
    r = tpcore.spawn(job, a.n, args=(a,), deadline=1200)[0]
    print(f"{a.n} ranks, rank {SLOW} throttled {a.factor:g}x (tpcore.set_throttle)")
    print(f"\nexpected from the speeds alone (plan_from_measurements): MLP columns {r['mlp_expected']}")
    print(f"\nParallelMLP {a.hidden} -> {a.ffn} -> {a.hidden}, {a.rows} rows: measured plan (plan_partition)\n"
          f"{r['mlp_plan']}")
    print(f"\nTransformerLM (2 blocks, 8 heads, vocab {a.vocab}), prefill of {a.rows} tokens: measured plan\n"
          f"{r['lm_plan']}")
    print(f"\n{'step':>14} {'equal ms':>9} {'planned ms':>11} {'speed-up':>9}")
    for name, (te, tp) in (("MLP forward", r["mlp_times"]), ("LM prefill", r["lm_times"])):
        print(f"{name:>14} {te * 1e3:>9.2f} {tp * 1e3:>11.2f} {te / tp:>8.2f}x")
    equal, planned = r["mlp_cols"]
    fewer = all(planned[SLOW] < planned[q] for q in range(a.n) if q != SLOW)
    mlp_ok = max(r["mlp_err"]) < 1e-4 * (1 + a.hidden ** 0.5)
    lm_ok = r["lm_diff"] < 1e-4 * (1 + r["lm_scale"])
    print(f"\nMLP columns per rank: equal {equal}, planned {planned} "
          f"({'the slow rank holds fewer' if fewer else 'THE SLOW RANK DOES NOT HOLD FEWER'})")
    print(f"MLP output vs float64 NumPy: max abs err {max(r['mlp_err']):.2e} (equal and planned shards)")
    print(f"transformer logits, planned vs equal shards: max abs diff {r['lm_diff']:.2e}")
    ok = fewer and mlp_ok and lm_ok
    print("check passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
