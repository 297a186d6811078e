"""The engine's scheduling, measured: chunked prefill against a long newcomer, prefix caching, preemption.

    python -m tpcore.bench sched                               # a Llama-shaped model (random), worlds 1,2
    python -m tpcore.bench sched --checkpoint SmolLM2.gguf     # a real model
    python -m tpcore.bench sched --quick --json s.json         # a tiny model, short prompts (smoke test)

Three scenarios per world size, each in one run on the same model (so their ratios do not
depend on what else the machine does between runs):

  chunked    `--decoders` requests (default 8) decode; once every one has its first token, a
             prompt of `--long` tokens (default 2000) arrives.  Per-token latency of the
             decoding requests while the long prompt is prefilled, p50 and p99 over all their
             gaps, with the engine's chunk budget (max_prefill_tokens, default 256) and without
             (the whole prompt in one forward: the budget set to its length): the p99 / p50
             ratio is how much a newcomer stalls the others.
  prefix     two requests with the same `--system` tokens (default 1000) and different
             16-token questions, one after the other: time to first token of each, with prefix
             caching and without.  The second request's prompt is served from the cache but
             for its last block and its question.
  preempt    `--decoders` requests whose blocks together exceed a pool sized for half of
             them: the engine preempts and recomputes; every request completes, and its
             greedy tokens equal model.generate's of it alone.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", type=lambda s: [int(v) for v in s.split(",") if v.strip()], default=[1, 2])
    p.add_argument("--checkpoint", default=None, help="a GGUF file or safetensors folder (default: a random "
                                                      "Llama-shaped model of SmolLM2-135M's size)")
    p.add_argument("--decoders", type=int, default=8, help="requests decoding when the newcomer arrives")
    p.add_argument("--long", type=int, default=2000, help="the newcomer's prompt tokens")
    p.add_argument("--system", type=int, default=1000, help="the shared system prompt's tokens")
    p.add_argument("--budget", type=int, default=None, help="max_prefill_tokens (default: the engine's)")
    p.add_argument("--threads", type=int, default=None, help="BLAS threads per rank")
    p.add_argument("--quick", action="store_true", help="a tiny model and short prompts (smoke test)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--timeout", type=float, default=1800.0)


SMOLLM_SHAPE = dict(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3, ffn_hidden=1536, norm="rmsnorm",
                    eps=1e-5, activation="swiglu", positions="rope", rope_theta=100000.0, max_positions=8192,
                    causal=True, pre_norm=True, bias=False, tie_embeddings=True, model_type="llama")
TINY_SHAPE = dict(SMOLLM_SHAPE, vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128,
                  max_positions=1024)


def _model(comm, args):
    import tpcore
    if args.checkpoint:
        if args.checkpoint.endswith(".gguf"):
            return tpcore.models.from_gguf(args.checkpoint, comm)
        return tpcore.models.from_pretrained(args.checkpoint, comm)
    return tpcore.models.TransformerLM(tpcore.Config(**(TINY_SHAPE if args.quick else SMOLLM_SHAPE)), comm, seed=0)


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")


def _chunked(model, args, budget):
    """Per-token gaps of the decoders while the long prompt prefills (and before it)."""
    from tpcore.serve.engine import Engine
    g = np.random.default_rng(1)
    V = model.config.vocab_size
    new = 12 if args.quick else 48
    eng = Engine(model, max_batch=args.decoders + 1, max_len=args.long + 16, max_prefill_tokens=budget,
                 eos_token_id=-1)
    hs = [eng.submit(g.integers(0, V, 16), new) for _ in range(args.decoders)]
    while any(h.first_token is None for h in hs):
        eng.step()
    for _ in range(3):
        eng.step()
    t_arrive = time.perf_counter()
    big = eng.submit(g.integers(0, V, args.long), 2)
    steps = 0
    while big.first_token is None:
        eng.step()
        steps += 1
    t_first = time.perf_counter()   # the end of the step that gave the newcomer its first token
    ttft = big.first_token - t_arrive
    list(eng.run())
    during, before = [], []
    for h in hs:
        t = np.array(h.token_times)
        gaps = np.diff(t)
        ends = t[1:]
        during += gaps[(ends > t_arrive) & (ends <= t_first)].tolist()
        before += gaps[ends <= t_arrive].tolist()
    return {"budget": eng.max_prefill_tokens or f"auto; the newcomer's prompt took {steps} steps",
            "gaps_during": during, "gaps_before": before, "newcomer_ttft_s": ttft, "newcomer_steps": steps}


def _prefix(model, args, caching):
    from tpcore.serve.engine import Engine
    g = np.random.default_rng(2)
    V = model.config.vocab_size
    system = g.integers(0, V, args.system)
    eng = Engine(model, max_batch=2, max_len=args.system + 32, prefix_caching=caching, eos_token_id=-1,
                 max_prefill_tokens=args.system + 32)
    out = []
    for _ in range(2):
        h = eng.submit(np.concatenate([system, g.integers(0, V, 16)]), 2)
        list(eng.run())
        out.append({"ttft_s": h.ttft, "cached_tokens": h.num_cached_tokens, "tokens": h.tokens.tolist()})
    return out


def _preempt(model, args):
    from tpcore.serve.engine import Engine
    g = np.random.default_rng(3)
    V = model.config.vocab_size
    reqs = [(g.integers(0, V, int(g.integers(8, 40))), 24) for _ in range(args.decoders)]
    bs = 16
    per = -(-64 // bs)
    eng = Engine(model, max_batch=args.decoders, max_len=64, block_size=bs,
                 num_blocks=max(per, per * args.decoders // 2), eos_token_id=-1)
    hs = [eng.submit(p, n) for p, n in reqs]
    list(eng.run())
    same = all(h.tokens.tolist() == model.generate([p], n, eos_token_id=-1)[0][p.size:].tolist()
               for h, (p, n) in zip(hs, reqs))
    return {"preempted": eng.stats()["preempted"], "completed": sum(h.finish_reason == "length" for h in hs),
            "requests": len(hs), "same_tokens": bool(same)}


def _rank(comm, args):
    import tpcore
    if args.threads:
        tpcore.set_num_threads(args.threads)
    model = _model(comm, args)
    _chunked(model, argparse.Namespace(**{**vars(args), "long": 64, "decoders": 2}), None)  # warm the workspaces
    chunk = _chunked(model, args, args.budget)
    whole = _chunked(model, args, args.long)
    pre = [_prefix(model, args, True), _prefix(model, args, False)]
    return {"rank": comm.rank, "chunked": chunk, "unchunked": whole, "prefix": pre[0], "no_prefix": pre[1],
            "preempt": _preempt(model, args)}


def _summary(r, n):
    c, w = r["chunked"], r["unchunked"]
    p, q = r["prefix"], r["no_prefix"]
    row = {"world": n,
           "chunked_budget": c["budget"],
           "chunked_p50_ms": _pct(c["gaps_before"], 50) * 1e3,
           "chunked_p99_during_ms": _pct(c["gaps_during"], 99) * 1e3,
           "unchunked_p50_ms": _pct(w["gaps_before"], 50) * 1e3,
           "unchunked_p99_during_ms": _pct(w["gaps_during"], 99) * 1e3,
           "newcomer_ttft_chunked_s": c["newcomer_ttft_s"], "newcomer_ttft_unchunked_s": w["newcomer_ttft_s"],
           "prefix_first_ttft_s": p[0]["ttft_s"], "prefix_second_ttft_s": p[1]["ttft_s"],
           "prefix_second_cached_tokens": p[1]["cached_tokens"],
           "no_prefix_second_ttft_s": q[1]["ttft_s"], "prefix_same_tokens": p[1]["tokens"] == q[1]["tokens"],
           **{f"preempt_{k}": v for k, v in r["preempt"].items()}}
    row["chunked_ratio"] = row["chunked_p99_during_ms"] / row["chunked_p50_ms"]
    row["unchunked_ratio"] = row["unchunked_p99_during_ms"] / row["unchunked_p50_ms"]
    row["prefix_speedup"] = row["prefix_first_ttft_s"] / row["prefix_second_ttft_s"]
    return row


def run(args) -> int:
    import tpcore
    if args.quick:
        args.long, args.system = min(args.long, 300), min(args.system, 200)
    if min(args.worlds or [0]) < 1 or args.decoders < 1 or args.long < 2 or args.system < 1:
        raise SystemExit("--worlds, --decoders, --long and --system take positive integers")
    if args.budget is not None and args.budget < 1:
        raise SystemExit("--budget must be >= 1")
    model_name = args.checkpoint or ("tiny Llama-shaped (random)" if args.quick else
                                     "Llama-shaped of SmolLM2-135M's size (random)")
    print(f"# tpcore {tpcore.__version__} engine scheduling; {os.cpu_count()} cores; model {model_name}; "
          f"{args.decoders} decoders, a {args.long}-token newcomer, a {args.system}-token shared system prompt")
    rows, ok = [], True
    for n in args.worlds:
        res = tpcore.spawn(_rank, n, args=(args,), deadline=args.timeout)
        row = _summary(res[0], n)
        rows.append(row)
        print(f"# {n} rank{'s' if n > 1 else ''}:")
        print(f"  chunked prefill (budget {row['chunked_budget']}): decoders' gap p50 {row['chunked_p50_ms']:.1f} ms, "
              f"p99 while the newcomer prefills {row['chunked_p99_during_ms']:.1f} ms ({row['chunked_ratio']:.2f}x); "
              f"newcomer's TTFT {row['newcomer_ttft_chunked_s']:.2f} s")
        print(f"  whole prompt at once: p50 {row['unchunked_p50_ms']:.1f} ms, p99 {row['unchunked_p99_during_ms']:.1f} "
              f"ms ({row['unchunked_ratio']:.2f}x); newcomer's TTFT {row['newcomer_ttft_unchunked_s']:.2f} s")
        print(f"  prefix caching: TTFT first {row['prefix_first_ttft_s'] * 1e3:.1f} ms, second "
              f"{row['prefix_second_ttft_s'] * 1e3:.1f} ms ({row['prefix_speedup']:.1f}x sooner; "
              f"{row['prefix_second_cached_tokens']} tokens from the cache); without caching the second takes "
              f"{row['no_prefix_second_ttft_s'] * 1e3:.1f} ms; same tokens: {row['prefix_same_tokens']}")
        print(f"  preemption: {row['preempt_preempted']} preemptions, {row['preempt_completed']} of "
              f"{row['preempt_requests']} completed, tokens equal generate(): {row['preempt_same_tokens']}")
        ok = ok and row["prefix_same_tokens"] and row["preempt_same_tokens"] and \
            row["preempt_completed"] == row["preempt_requests"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model_name, "args": {k: v for k, v in vars(args).items() if k != "run"},
                       "rows": rows}, f, indent=1)
        print(f"# wrote {args.json}")
    return 0 if ok else 1
