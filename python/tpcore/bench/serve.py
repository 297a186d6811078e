"""Serving benchmark: continuous batching (tpcore.Engine) at concurrency 1, 4, 16 per world size.

    python -m tpcore.bench serve                            # GPT-2-small-sized (124M), random weights
    python -m tpcore.bench serve --quick                    # a tiny model, short requests (CI smoke test)
    python -m tpcore.bench serve --worlds 1,2 --concurrency 1,4,16 --requests 32 --json s.json --plot s.png
    python benchmarks/serve.py --checkpoint DIR
    python -m tpcore.bench serve --http --checkpoint FILE.gguf  # over HTTP: see tpcore.bench.serve_http

For each world size and concurrency c (the engine's max_batch: how many independent
contexts share the split model at once), N requests (default max(8, 2 c)) with prompt and
output lengths drawn from a fixed seed (prompt 8-64, output 8-32 tokens; --quick 4-16 and
4-12) are all submitted at t = 0 and served to completion; greedy decoding.  Every world
size and concurrency serves the same requests (the first N of one stream).  Columns (the
slowest rank's time where ranks differ):

  tok/s           generated tokens of all requests / wall time from submit to the last token
  TTFT p50/p99    time to first token per request (ms): queueing for a slot + its prefill
  lat p50/p99     time between consecutive tokens of a request (ms), over all requests
  steps           engine iterations (each: a prefill of the admitted, a decode of the running)
  same            the tokens of a sample of requests equal model.generate([prompt]) alone

Every rank calls tpcore.bench.serve.measure(model, concurrency, requests), which the
report (python -m tpcore.bench report) uses too.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import List, Sequence, Tuple

import numpy as np

from tpcore.bench.decode import GPT2_SMALL, TINY  # the same model shapes as the decode benchmark


def _ints(text):
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text):
    return [float(v) for v in text.split(",") if v.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", type=_ints, default=[1, 2], help="world sizes (default 1,2)")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16], help="max_batch values (default 1,4,16)")
    p.add_argument("--requests", type=int, default=None, help="requests per concurrency (default max(8, 2 x c))")
    p.add_argument("--checkpoint", default=None, help="a Hugging Face or tpcore checkpoint directory")
    p.add_argument("--prompt", type=_ints, default=None, help="prompt length range LO,HI (default 8,64; --quick 4,16)")
    p.add_argument("--new", type=_ints, default=None, help="output length range LO,HI (default 8,32; --quick 4,12)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the request lengths and tokens")
    p.add_argument("--check", type=int, default=3, help="requests per run checked against generate() (default 3)")
    p.add_argument("--quick", action="store_true", help="a tiny model and short requests (smoke test)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--max-prefill-tokens", type=int, default=None, help="the engine's per-step budget of padded "
                                                                         "prompt tokens (default: none)")
    p.add_argument("--threads", type=int, default=None, help="BLAS threads per rank (default: tpcore's, the "
                                                              "cores split over the ranks)")
    p.add_argument("--timeout", type=float, default=1800.0)
    h = p.add_argument_group("over HTTP (--http; see tpcore.bench.serve_http)")
    h.add_argument("--http", action="store_true", help="load an OpenAI-compatible server over HTTP (--url, or tpcore's "
                                                       "server started on --checkpoint per world size)")
    h.add_argument("--url", default=None, help="a running server's base URL (default: start tpcore's)")
    h.add_argument("--rate", type=_floats, default=None, help="request rates to sweep, requests/s (Poisson arrivals; "
                                                              "default: the fixed --concurrency)")
    h.add_argument("--api-key", default=None, help="sent as a Bearer token (and given to the started server)")
    h.add_argument("--no-engine", action="store_true", help="skip the in-process Engine baseline rows")
    h.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's server")
    h.add_argument("--server-log", default=None, metavar="FILE", help="the started servers' output (default: none)")
    h.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")


def make_requests(n: int, vocab: int, prompt=(8, 64), new=(8, 32), seed: int = 0) -> List[Tuple[np.ndarray, int]]:
    """n requests (prompt int64 array, max_new_tokens), lengths uniform in the inclusive ranges,
    from `seed`: the first k of n are the same for any n >= k."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = int(g.integers(prompt[0], prompt[1] + 1))
        m = int(g.integers(new[0], new[1] + 1))
        out.append((g.integers(0, vocab, p).astype(np.int64), m))
    return out


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")


def measure(model, concurrency: int, requests: Sequence[Tuple[np.ndarray, int]], warmup: bool = True,
            max_prefill_tokens=None) -> dict:
    """Serve `requests` (a list of (prompt ids, max_new_tokens)) with an Engine of max_batch =
    concurrency over `model`, all submitted at t = 0.  Collective: every rank calls it with the
    same arguments.  Returns (seconds; this rank's clock): wall_s, generated tokens,
    throughput_tok_s, ttft_s (per request, in submission order), latency_s (every gap between
    consecutive tokens of every request), their p50/p99, steps, prefills, decodes, the time in
    collectives and bytes moved during the run, tokens (per request) and the engine's stats.
    max_prefill_tokens: the engine's per-step prefill budget (None: none)."""
    from tpcore.serve.engine import Engine
    from tpcore.utils.args import int_arg
    concurrency = int_arg(concurrency, "measure", "concurrency", lo=1, hi=2 ** 31 - 1)
    reqs = [(np.asarray(p, np.int64).reshape(-1), int(n)) for p, n in requests]
    if not reqs:
        raise ValueError("measure: needs at least one request")
    comm = model.comm
    max_len = max(p.size + n for p, n in reqs)
    eng = Engine(model, max_batch=concurrency, max_len=max_len, max_prefill_tokens=max_prefill_tokens)
    if warmup:  # the workspaces of the largest prefill and decode batches, first-touched once
        for p, n in reqs[:concurrency]:
            eng.submit(p, min(n, 2))
        for _ in eng.run():
            pass
        eng = Engine(model, max_batch=concurrency, max_len=max_len, max_prefill_tokens=max_prefill_tokens)
    comm.barrier()
    st0 = comm.stats()
    t0 = time.perf_counter()
    handles = [eng.submit(p, n) for p, n in reqs]
    for _ in eng.run():
        pass
    wall = max(h.finished for h in handles) - t0
    st1 = comm.stats()
    ttft = [h.first_token - h.submitted for h in handles]
    lat = [float(v) for h in handles for v in h.latencies]
    gen = int(sum(h.tokens.size for h in handles))
    s = eng.stats()
    return {"rank": comm.rank, "world": comm.size, "concurrency": concurrency, "requests": len(reqs),
            "generated_tokens": gen, "prompt_tokens": int(sum(p.size for p, _ in reqs)), "wall_s": wall,
            "throughput_tok_s": gen / wall if wall > 0 else float("nan"),
            "ttft_s": ttft, "latency_s": lat, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99),
            "max_prefill_tokens": max_prefill_tokens, "steps": s["steps"], "prefills": s["prefills"],
            "decodes": s["decodes"], "peak_running": s["peak_running"],
            "prefill_s": s["prefill_s"], "decode_s": s["decode_s"], "agree_s": s["agree_s"],
            "comm_s": st1["seconds"] - st0["seconds"], "comm_bytes": st1["bytes"] - st0["bytes"],
            "tokens": [h.tokens.tolist() for h in handles], "finish_reasons": [h.finish_reason for h in handles]}


def _model(comm, args):
    import tpcore
    if args.checkpoint:
        return tpcore.models.from_pretrained(args.checkpoint, comm, progress=comm.rank == 0)
    cfg = tpcore.Config(**(TINY if args.quick else GPT2_SMALL))
    return tpcore.models.TransformerLM(cfg, comm, seed=0)


def _rank(comm, args, runs):
    """Every rank (tpcore.spawn): each concurrency's measurement, then a sample of its requests
    against generate() alone (untimed)."""
    import tpcore
    if args.threads:
        tpcore.set_num_threads(args.threads)
    model = _model(comm, args)
    out = []
    for c, reqs in runs:
        m = measure(model, c, reqs, max_prefill_tokens=args.max_prefill_tokens)
        idx = np.linspace(0, len(reqs) - 1, min(args.check, len(reqs))).round().astype(int).tolist()
        same = all(model.generate([reqs[i][0]], reqs[i][1], temperature=0.0)[0][reqs[i][0].size:].tolist()
                   == m["tokens"][i] for i in sorted(set(idx)))
        m["checked"], m["same"], m["threads"] = len(set(idx)), bool(same), tpcore.get_num_threads()
        out.append(m)
    return out


def _combine(res):
    """One row from every rank's measurement of one run: the slowest rank's times."""
    r0 = res[0]
    wall = max(r["wall_s"] for r in res)
    ttft = np.max(np.array([r["ttft_s"] for r in res]), axis=0)
    lat = np.max(np.array([r["latency_s"] for r in res]), axis=0) if r0["latency_s"] else np.zeros(0)
    return {"world": r0["world"], "concurrency": r0["concurrency"], "requests": r0["requests"],
            "generated_tokens": r0["generated_tokens"], "prompt_tokens": r0["prompt_tokens"], "wall_s": wall,
            "throughput_tok_s": r0["generated_tokens"] / wall, "ttft_p50_ms": _pct(ttft, 50) * 1e3,
            "ttft_p99_ms": _pct(ttft, 99) * 1e3, "latency_p50_ms": _pct(lat, 50) * 1e3,
            "latency_p99_ms": _pct(lat, 99) * 1e3, "steps": r0["steps"], "prefills": r0["prefills"],
            "decodes": r0["decodes"], "peak_running": r0["peak_running"],
            "comm_share": max(r["comm_s"] / r["wall_s"] for r in res if r["wall_s"] > 0),
            "same_tokens": all(r["same"] for r in res) and all(r["tokens"] == r0["tokens"] for r in res),
            "checked": r0["checked"], "threads": r0["threads"]}


def run(args) -> int:
    import tpcore
    if getattr(args, "http", False):
        from tpcore.bench.serve_http import run_http
        return run_http(args)
    prompt = tuple(args.prompt or ((4, 16) if args.quick else (8, 64)))
    new = tuple(args.new or ((4, 12) if args.quick else (8, 32)))
    if len(prompt) != 2 or len(new) != 2 or not 1 <= prompt[0] <= prompt[1] or not 1 <= new[0] <= new[1]:
        raise SystemExit("--prompt and --new take LO,HI with 1 <= LO <= HI")
    if not args.concurrency or min(args.concurrency) < 1 or not args.worlds or min(args.worlds) < 1:
        raise SystemExit("--concurrency and --worlds take positive integers")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("--threads must be >= 1")
    if args.max_prefill_tokens is not None and args.max_prefill_tokens < 1:
        raise SystemExit("--max-prefill-tokens must be >= 1")
    if args.requests is not None and args.requests < 1:
        raise SystemExit("--requests must be >= 1")
    cfgd = TINY if args.quick else GPT2_SMALL
    vocab, max_pos = cfgd["vocab_size"], cfgd["max_positions"]
    if args.checkpoint:
        c = tpcore.Config.from_hf(args.checkpoint) if os.path.exists(os.path.join(args.checkpoint, "config.json")) \
            else None
        if c is not None:
            vocab, max_pos = c.vocab_size, c.max_positions
    if prompt[1] + new[1] > max_pos:
        raise SystemExit(f"--prompt and --new: {prompt[1]} + {new[1]} tokens exceed the model's max_positions "
                         f"({max_pos})")
    counts = {c: args.requests or max(8, 2 * c) for c in args.concurrency}
    stream = make_requests(max(counts.values()), vocab, prompt, new, args.seed)
    runs = [(c, stream[:counts[c]]) for c in args.concurrency]
    cores = os.cpu_count() or 1
    model_name = args.checkpoint or ("tiny GPT-2-style (random)" if args.quick else "GPT-2-small-sized, 124M (random)")
    print(f"# tpcore {tpcore.__version__} serve benchmark; {cores} cores; BLAS {tpcore.build_info()['blas']}")
    print(f"# model: {model_name}; prompts {prompt[0]}-{prompt[1]} tokens, outputs {new[0]}-{new[1]} tokens "
          f"(greedy), all requests submitted at t=0; seed {args.seed}"
          + (f"; prefill budget {args.max_prefill_tokens} tokens per step" if args.max_prefill_tokens else ""))
    hdr = (f"{'ranks':>5} {'thr':>3} {'conc':>4} {'reqs':>4} {'tokens':>6} {'wall s':>7} {'tok/s':>8} {'TTFT p50':>9} "
           f"{'TTFT p99':>9} {'lat p50':>8} {'lat p99':>8} {'steps':>5} {'comm%':>6} {'same':>4}")
    print(hdr)
    rows = []
    for n in args.worlds:
        res = tpcore.spawn(_rank, n, args=(args, runs), deadline=args.timeout)
        for i in range(len(runs)):
            row = _combine([r[i] for r in res])
            rows.append(row)
            print(f"{n:>5} {row['threads']:>3} {row['concurrency']:>4} {row['requests']:>4} "
                  f"{row['generated_tokens']:>6} {row['wall_s']:>7.2f} {row['throughput_tok_s']:>8.1f} "
                  f"{row['ttft_p50_ms']:>7.1f}ms "
                  f"{row['ttft_p99_ms']:>7.1f}ms {row['latency_p50_ms']:>6.1f}ms {row['latency_p99_ms']:>6.1f}ms "
                  f"{row['steps']:>5} {100 * row['comm_share']:>5.1f}% {'yes' if row['same_tokens'] else 'NO':>4}")
    print("#")
    for n in args.worlds:
        mine = [r for r in rows if r["world"] == n]
        base = mine[0]
        for r in mine[1:]:
            print(f"# {n} rank{'s' if n > 1 else ''}: concurrency {r['concurrency']} vs {base['concurrency']}: "
                  f"throughput {r['throughput_tok_s'] / base['throughput_tok_s']:.2f}x, per-token latency p50 "
                  f"{r['latency_p50_ms'] / base['latency_p50_ms']:.2f}x")
    first = [r for r in rows if r["world"] == args.worlds[0]]
    for n in args.worlds[1:]:
        for r in (r for r in rows if r["world"] == n):
            b = [f for f in first if f["concurrency"] == r["concurrency"]][0]
            print(f"# concurrency {r['concurrency']}: {n} ranks vs {args.worlds[0]}: throughput "
                  f"{r['throughput_tok_s'] / b['throughput_tok_s']:.2f}x")
    ok = all(r["same_tokens"] for r in rows)
    print(f"# tokens equal generate() alone for the checked requests, and across ranks: {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model_name, "prompt": list(prompt), "new": list(new), "seed": args.seed,
                       "max_prefill_tokens": args.max_prefill_tokens,
                       "rows": rows}, f, indent=1)
        print(f"# wrote {args.json}")
    if args.plot:
        _plot(args.plot, rows, model_name)
    return 0 if ok else 1


def _plot(path, rows, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# --plot needs matplotlib (pip install 'tpcore[bench]')")
        return
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for i, n in enumerate(sorted({r["world"] for r in rows})):
        mine = [r for r in rows if r["world"] == n]
        cs = [r["concurrency"] for r in mine]
        lab, col = f"{n} rank{'s' if n > 1 else ''}", f"C{i}"
        ax[0].plot(cs, [r["throughput_tok_s"] for r in mine], "o-", color=col, label=lab)
        ax[1].plot(cs, [r["ttft_p50_ms"] for r in mine], "o-", color=col, label=f"{lab} p50")
        ax[1].plot(cs, [r["ttft_p99_ms"] for r in mine], "x--", color=col, label=f"{lab} p99")
        ax[2].plot(cs, [r["latency_p50_ms"] for r in mine], "o-", color=col, label=f"{lab} p50")
        ax[2].plot(cs, [r["latency_p99_ms"] for r in mine], "x--", color=col, label=f"{lab} p99")
    for a, y in zip(ax, ["generated tokens/s", "time to first token (ms)", "per-token latency (ms)"]):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrency (max_batch)")
        a.set_ylabel(y)
        a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"# wrote {path}")
