"""Parallelism benchmark: one model and global batch trained as data, tensor and pipeline parallel.

    python -m tpcore.bench parallelism                  # GPT-2-style 8 layers, h 256; 1, 2 and 4 ranks
    python -m tpcore.bench parallelism --quick          # a tiny model (CI smoke test)
    python benchmarks/parallelism.py --json par.json --plot par.png

The same model (random, seed 0), the same global batch (B sequences of T tokens, fresh random
tokens) and AdamW, trained one step at a time in each layout on n ranks of the shm backend:

  single      1 rank, the whole model and batch (the reference)
  data        ProcessGrid(dp=n): n replicas, each B/n sequences; gradients averaged (bucketed all-reduce)
  data-zero1  the same with tpcore.optim.ShardedAdamW: the optimizer state sharded over the replicas
              (ZeRO stage 1: reduce-scatter the gradients, step a slice, all-gather the parameters)
  tensor      ProcessGrid(tp=n): every layer split over n ranks (two all-reduces per block forward)
  pp-gpipe    ProcessGrid(pp=n): the blocks cut into n stages, --micro micro-batches, GPipe schedule
  pp-1f1b     the same with the 1F1B schedule
  tp2xpp2, tp2xdp2 (n = 4): the hybrids

Columns (per rank, the max over ranks where they differ):

  step ms     forward + backward + gradient averaging + optimizer step, the median of the timed
              steps (every step starts after a barrier), the slowest rank's
  tok/s       B * T / step time
  speed-up    single's step time / this one's (same run)
  params MB   this rank's parameter bytes (max over ranks)
  optim MB    this rank's AdamW state (two float32 moments per parameter; data-zero1: its slice's
              moments and float32 master)
  act MB      the step's working memory: peak RSS during the timed steps - RSS before the first
              step (activations, the logits shard, gradients' first touch, a stage's held inputs)
  comm MB     payload bytes this rank gave its communicators per step (collectives: the buffer;
              send/recv: the message, counted by sender and receiver)
  comm%       time inside the communicators / step time (waiting for peers included: for
              pipelines this is the bubble plus the transfers)
  bubble      pipelines: the stages' mean share of the step spent waiting in send/recv
              (measured) and (P-1)/(M+P-1), the ideal schedule's idle share (theory)

All layouts are checked: every layout's first-step loss must equal single's (rtol 1e-4), or the
run fails.  Machines here are shared and have few cores: n ranks on fewer than n cores compete
for them, which the step times show; memory and bytes do not depend on it.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import List

import numpy as np

from tpcore.bench._sweep import Progress, env_info

MODEL = dict(vocab_size=8192, hidden=256, layers=8, heads=8, head_dim=32, ffn_hidden=1024, norm="layernorm",
             activation="gelu", positions="learned", bias=True, max_positions=256, model_type="gpt2",
             tie_embeddings=True)
TINY = dict(vocab_size=512, hidden=64, layers=4, heads=4, head_dim=16, ffn_hidden=256, norm="layernorm",
            activation="gelu", positions="learned", bias=True, max_positions=64, model_type="gpt2",
            tie_embeddings=True)

WHAT = [  # the seed's table: what each layout splits, what it is for
    ("data", "the batch", "the whole model and optimizer", "gradients, once per step (all-reduce)",
     "throughput, when the model fits one device"),
    ("tensor", "each layer's weights", "1/n of every layer", "activations, twice per block (all-reduce)",
     "memory and latency of one step; needs a fast link"),
    ("pipeline", "the layers", "1/n of the layers", "activations between stages (send/recv)",
     "memory; throughput with many micro-batches (bubble (P-1)/(M+P-1))"),
]


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="a tiny model, worlds 1,2 (CI smoke test)")
    p.add_argument("--worlds", default=None, help="comma list of rank counts besides 1 (default 2,4; quick: 2)")
    p.add_argument("--batch", type=int, default=None, help="global batch, sequences (default 16; quick 8)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per sequence (default 64; quick 16)")
    p.add_argument("--micro", type=int, default=None, help="pipeline micro-batches (default 8; quick 4)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per layout (default 5; quick 2)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one layout may take")
    p.add_argument("--json", default=None, help="write the rows and the environment here")
    p.add_argument("--plot", default=None, help="write a PNG (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")


def _layouts(n: int):
    if n == 1:
        return [("single", 1, 1, 1, None)]
    out = [("data", 1, 1, n, None), ("data-zero1", 1, 1, n, None), ("tensor", n, 1, 1, None),
           ("pp-gpipe", 1, n, 1, "gpipe"), ("pp-1f1b", 1, n, 1, "1f1b")]
    if n == 4:
        out += [("tp2xpp2", 2, 2, 1, "1f1b"), ("tp2xdp2", 2, 1, 2, None)]
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(comm, cfg_dict, layout, B, T, M, iters):
    import tpcore
    name, tp, pp, dp, schedule = layout
    cfg = tpcore.Config(**cfg_dict)
    grid = tpcore.ProcessGrid(comm, tp=tp, pp=pp, dp=dp)
    if pp > 1:
        model = tpcore.PipelineLM(cfg, grid, seed=0)
        comms = [grid.tp, grid.pp, grid.dp, model.mp] + ([model._tied] if model._tied is not None else [])
    else:
        model = tpcore.models.TransformerLM(cfg, grid.tp, seed=0)
        comms = [grid.tp, grid.dp]
    zero = name == "data-zero1"
    opt = tpcore.optim.ShardedAdamW(model, grid.dp, lr=1e-4) if zero else tpcore.optim.AdamW(model, lr=1e-4)
    g = np.random.default_rng([7, 0])  # the same global batch on every rank
    tokens = g.integers(0, cfg.vocab_size, (B, T))
    targets = g.integers(0, cfg.vocab_size, (B, T))
    share = B // dp
    mine = slice(grid.dp_rank * share, (grid.dp_rank + 1) * share)

    def step():
        if pp > 1:
            loss = model.train_step(tokens[mine], targets[mine], micro_batches=min(M, share), schedule=schedule)
        else:
            loss = model.loss(tokens[mine], targets[mine])
            model.backward()
        if not zero:  # (ShardedAdamW averages the gradients itself: reduce-scatter, step, all-gather)
            grid.average_gradients(model)
        opt.step()
        model.zero_grad()
        return loss

    rss0 = _rss()
    loss0 = float(grid.dp.all_reduce(np.array([step()], np.float64), op="avg")[0])  # also the warm-up
    step()
    s0 = [c.stats() for c in comms]
    times, waits = [], []
    for _ in range(iters):
        comm.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        if pp > 1:
            st = model.last_stats
            waits.append(st["wait_s"] / st["step_s"] if st["step_s"] > 0 else 0.0)
    s1 = [c.stats() for c in comms]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = dict(layout=name, tp=tp, pp=pp, dp=dp, schedule=schedule, rank=comm.rank, loss0=loss0,
               step_s=float(np.median(times)), params=int(model.param_bytes()),
               optim=int(opt.state_bytes() if zero else sum(m.nbytes + v.nbytes for m, v in opt.state)),
               act=max(0, peak - rss0),
               comm_bytes=sum(b["bytes"] - a["bytes"] for a, b in zip(s0, s1)) / iters,
               comm_s=sum(b["seconds"] - a["seconds"] for a, b in zip(s0, s1)) / iters,
               wait=float(np.mean(waits)) if waits else None)
    if pp > 1:
        model.close()
    grid.close()
    return out


def _row(res: List[dict], single_s: float, B: int, T: int, M: int) -> dict:
    r0 = res[0]
    step = max(r["step_s"] for r in res)
    row = dict(layout=r0["layout"], ranks=len(res), tp=r0["tp"], pp=r0["pp"], dp=r0["dp"], schedule=r0["schedule"],
               step_ms=step * 1e3, tok_s=B * T / step, speedup=single_s / step if single_s else None,
               params_mb=max(r["params"] for r in res) / 2 ** 20, optim_mb=max(r["optim"] for r in res) / 2 ** 20,
               act_mb=max(r["act"] for r in res) / 2 ** 20, comm_mb=max(r["comm_bytes"] for r in res) / 2 ** 20,
               comm_pct=100 * max(r["comm_s"] / r["step_s"] for r in res), loss0=r0["loss0"])
    if r0["pp"] > 1:
        P, m = r0["pp"], min(M, B // r0["dp"])
        row["bubble_measured"] = float(np.mean([r["wait"] for r in res]))
        row["bubble_theory"] = (P - 1) / (m + P - 1)
        row["micro_batches"] = m
    return row


def _print(rows: List[dict]) -> None:
    head = (f"{'layout':<10} {'ranks':>5} {'tp/pp/dp':>8} {'step ms':>9} {'tok/s':>9} {'speed-up':>8} "
            f"{'params MB':>9} {'optim MB':>8} {'act MB':>7} {'comm MB':>8} {'comm%':>6} {'bubble meas/theory':>18}")
    print(head)
    print("-" * len(head))
    for r in rows:
        bub = f"{100 * r['bubble_measured']:.0f}% / {100 * r['bubble_theory']:.0f}%" if "bubble_theory" in r else "-"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"{r['layout']:<10} {r['ranks']:>5} {r['tp']}/{r['pp']}/{r['dp']:<4} {r['step_ms']:>9.1f} "
              f"{r['tok_s']:>9.0f} {sp:>8} {r['params_mb']:>9.2f} {r['optim_mb']:>8.2f} {r['act_mb']:>7.1f} "
              f"{r['comm_mb']:>8.2f} {r['comm_pct']:>5.0f}% {bub:>18}")


def _print_what(rows: List[dict]) -> None:
    """The seed's table, each line with what this run measured for that layout at the largest n."""
    n = max(r["ranks"] for r in rows)
    at = {r["layout"]: r for r in rows if r["ranks"] == n}
    single = next((r for r in rows if r["layout"] == "single"), None)
    print(f"\nWhat each splits, what it is for (measured at {n} ranks, against 1 rank):")
    for kind, splits, holds, talks, use in WHAT:
        r = at.get(kind) or at.get("pp-1f1b" if kind == "pipeline" else "")
        print(f"  {kind:<8}  splits {splits}; each rank holds {holds}; communicates {talks}; for {use}.")
        if r and single:
            mem = (r["params_mb"] + r["optim_mb"]) / max(single["params_mb"] + single["optim_mb"], 1e-9)
            print(f"            measured: params+optimizer {100 * mem:.0f}% of one rank's, {r['comm_mb']:.2f} MB "
                  f"communicated per step, step {r['speedup']:.2f}x as fast as one rank")


def _plot(path: str, rows: List[dict]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# --plot needs matplotlib (pip install 'tpcore[bench]')", file=sys.stderr)
        return False
    labels = [f"{r['layout']}\n{r['ranks']}r" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = np.arange(len(rows))
    axes[0].bar(x, [r["step_ms"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("step ms (lower is better)")
    axes[1].bar(x - 0.2, [r["params_mb"] + r["optim_mb"] for r in rows], 0.4, label="params + optimizer")
    axes[1].bar(x + 0.2, [r["act_mb"] for r in rows], 0.4, label="step working memory")
    axes[1].set_ylabel("MB per rank (max)")
    axes[1].legend(fontsize=8)
    axes[2].bar(x, [r["comm_mb"] for r in rows], color="tab:green")
    axes[2].set_ylabel("MB communicated per step per rank")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7, rotation=60)
    fig.suptitle("tpcore: the same model and batch as data, tensor and pipeline parallel")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def run(args) -> int:
    import tpcore
    q = args.quick
    cfg = TINY if q else MODEL
    B = args.batch or (8 if q else 16)
    T = args.tokens or (16 if q else 64)
    M = args.micro or (4 if q else 8)
    iters = args.iters or (2 if q else 5)
    worlds = [int(w) for w in (args.worlds or ("2" if q else "2,4")).split(",") if w.strip()]
    if any(w < 2 for w in worlds) or B < 1 or T < 1 or M < 1 or iters < 1:
        raise SystemExit("--worlds must list rank counts >= 2; --batch, --tokens, --micro, --iters >= 1")
    if T > cfg["max_positions"]:
        raise SystemExit(f"--tokens: at most {cfg['max_positions']} (the model's max_positions)")
    for w in worlds:
        if B % w or cfg["layers"] < w:
            raise SystemExit(f"--batch {B} must be a multiple of every world size, and the model's {cfg['layers']} "
                             f"layers at least the largest ({w})")
    env = env_info()
    prog = Progress(not args.no_progress)
    print(f"# tpcore {tpcore.__version__} parallelism benchmark; {env['nproc']} cores ({env.get('cpu')}); "
          f"BLAS {tpcore.build_info()['blas']}")
    print("# OPENBLAS_CORETYPE=%s OPENBLAS_L2_SIZE=%s" % tuple(os.environ.get(k, "unset") for k in
                                                             ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")))
    nparams = None
    print(f"# model: GPT-2 style, {cfg['layers']} layers, hidden {cfg['hidden']}, vocab {cfg['vocab_size']}; "
          f"global batch {B} x {T} tokens; AdamW; pipelines {M} micro-batches; median of {iters} steps")
    rows, single_s, loss_ref = [], None, None
    for n in [1] + worlds:
        for layout in _layouts(n):
            prog.status(f"{layout[0]} at {n} rank(s)")
            res = tpcore.spawn(_rank, n, args=(cfg, layout, B, T, M, iters), deadline=args.timeout)
            row = _row(res, single_s or 0.0, B, T, M)
            if layout[0] == "single":
                single_s, loss_ref = row["step_ms"] / 1e3, row["loss0"]
                row["speedup"] = 1.0
                nparams = res[0]["params"] // 4
            elif not np.isclose(row["loss0"], loss_ref, rtol=1e-4):
                raise SystemExit(f"{layout[0]} at {n} ranks: first-step loss {row['loss0']} differs from one "
                                 f"rank's {loss_ref}")
            rows.append(row)
    prog.done()
    print(f"# {nparams / 1e6:.2f} M parameters; every layout's first-step loss equals one rank's ({loss_ref:.6f})")
    _print(rows)
    _print_what(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "model": cfg, "batch": B, "tokens": T, "micro_batches": M, "rows": rows}, f,
                      indent=1, default=str)
        print(f"# wrote {args.json}")
    if args.plot and _plot(args.plot, rows):
        print(f"# wrote {args.plot}")
    return 0
