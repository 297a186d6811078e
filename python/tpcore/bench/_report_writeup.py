"""The write-up of the 1-vs-N report (tpcore.bench report): the numbers derived from the
measurements, the advice lines computed from them, the Markdown (one function per section)
and the PNG plots (matplotlib, optional)."""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

import numpy as np

from tpcore.bench._sweep import human_bytes

REGIONS = ("attention", "mlp", "embedding", "head", "other")


# ---------------------------------------------------------------- derived numbers and advice
def _mb(b) -> float:
    return b / 1e6


def _decode_comm_share(row: dict) -> Dict[str, float]:
    """Seconds per decode step in collectives per region (the slowest rank's), and "total"."""
    steps = max(len(row["steps_s"]), 1)
    return {k: v["seconds_max"] / steps for k, v in row["comm_decode"].items()}


def _bench_at(row: dict, op: str, nbytes: int) -> Optional[dict]:
    for b in row.get("bench", []):
        if b.get("op") == op and b.get("bytes") == nbytes:
            return b
    return None


def _bench_us(b: dict) -> float:
    """The benchmark's mean time per call on the rank that waited least (the model's numbers are
    taken the same way); the slowest rank's mean where the per-rank times are missing."""
    return min(b.get("rank_mean_us") or [b["time_us"]])


def _message_sizes(data: dict) -> dict:
    cfg, B, T = data["config"], data["batch"], data["prompt"]
    return {"decode": B * cfg["hidden"] * 4, "prefill": B * T * cfg["hidden"] * 4}


def _prefill_flops(data: dict) -> float:
    """2 x (weights used per token) x tokens + the attention's QK^T and PV, for the whole model."""
    c, B, T = data["config"], data["batch"], data["prompt"]
    C, L, F, H, Hk, D, V = (c["hidden"], c["layers"], c["ffn_hidden"], c["heads"], c["kv_heads"], c["head_dim"],
                            c["vocab_size"])
    mlp = C * F * (3 if c["activation"] in ("swiglu", "geglu") else 2)
    per_tok = L * (C * (H + 2 * Hk) * D + H * D * C + mlp)
    attn = L * 2 * H * D * T * (T + 1) / 2 * 2  # causal QK^T and PV
    return 2.0 * per_tok * B * T + B * attn + 2.0 * C * V * B  # + the head on the last rows


def advice(data: dict) -> List[str]:
    """Advice lines, each computed from this run's measurements."""
    rows, lim = data["worlds"], data["limits"]
    cores = lim["cores"]
    out: List[str] = []
    base = rows[0]
    msg = _message_sizes(data)
    on_host = data.get("device", "cpu") == "cpu"  # the host's bandwidth and GEMM peak bound CPU ranks only
    best = max(rows, key=lambda r: r["decode_tok_s"])
    read1 = lim["read_gbs"][1]
    read_all = max(lim["read_gbs"].values())
    # decode: weights read against the host's bandwidth
    for r in rows if on_host else []:
        step = r["p50_s"]
        if not step or step != step:
            continue
        wb = sum(r.get("read_bytes", r["param_bytes"]))   # a MoE model: only the experts a token used
        rate = wb / step / 1e9
        # the probe with as many reader threads as the ranks' BLAS threads (the nearest measured count)
        k = min(r["n"] * r["threads"], cores)
        tk = max((int(t) for t in lim["read_gbs"] if int(t) <= k), default=1)
        host = lim["read_gbs"].get(tk) or read_all
        share = rate / host
        if r is base:
            line = (f"decode at TP={r['n']} ({r['threads']} BLAS thread(s)) reads its {_mb(wb):.0f} MB of weights per "
                    f"token at {rate:.1f} GB/s = {100 * share:.0f}% of this host's measured read bandwidth with {tk} "
                    f"reader thread(s) ({host:.1f} GB/s)")
            if share > 0.7:
                ceiling = read_all / read1
                line += (f": decode is bound by memory; all {cores} cores together read {read_all:.1f} GB/s = "
                         f"{ceiling:.2f}x one, so more ranks (or threads) on the same memory can speed decode up at "
                         f"most {ceiling / max(host / read1, 1e-9):.2f}x")
            else:
                line += ": decode is not bound by memory here (per-step overheads or compute dominate)"
            out.append(line + ".")
        elif share > 0.7:
            out.append(f"at TP={r['n']} decode reads weights at {rate:.1f} GB/s, {100 * share:.0f}% of what "
                       f"{tk} reader thread(s) get here ({host:.1f} GB/s): the memory, not the split, sets its "
                       f"pace.")
    # collectives in decode: worth it or not
    for r in rows[1:]:
        per = _decode_comm_share(r)
        tot = per.get("total", 0.0)
        step = r["decode_s"] / max(len(r["steps_s"]), 1)  # the mean step, as the collectives' seconds are
        if not step or step != step:
            continue
        share = tot / step
        kinds = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in sorted(per.items(), key=lambda kv: -kv[1])
                          if k != "total" and v > 0)
        what = (f"at TP={r['n']} collectives take {100 * share:.0f}% of a decode step "
                f"({1e3 * tot:.2f} of {1e3 * step:.2f} ms; {kinds or 'no regions in this build'}); the all-reduce "
                f"message is {human_bytes(msg['decode'])}")
        if r["decode_tok_s"] < best["decode_tok_s"] and best["n"] < r["n"]:
            mem = _mb(max(r["param_bytes"])) / _mb(max(best["param_bytes"]))
            out.append(f"{what}: TP={best['n']} decodes faster here ({best['decode_tok_s']:.1f} vs "
                       f"{r['decode_tok_s']:.1f} tok/s); TP={r['n']} only for memory ({100 * mem:.0f}% of "
                       f"TP={best['n']}'s parameter bytes per rank).")
        else:
            out.append(f"{what}: TP={r['n']} decodes {r['decode_tok_s'] / base['decode_tok_s']:.2f}x as fast as "
                       f"TP={base['n']}.")
    # the link: achieved in the model against the benchmark at the same message size
    for r in rows[1:]:
        b = _bench_at(r, "all_reduce", msg["decode"])
        dec = r["comm_decode"]
        ar = {k: v for k, v in dec.items() if k in ("attention", "mlp")}
        calls = sum(v["calls"] for v in ar.values())
        if b is None or not calls:
            continue
        t_min = sum(v["seconds_min"] for v in ar.values()) / calls
        t_max = sum(v["seconds_max"] for v in ar.values()) / calls
        out.append(f"at TP={r['n']} a decode all-reduce of {human_bytes(msg['decode'])} takes {1e6 * t_min:.1f} us "
                   f"inside the model on the rank that waits least and {1e6 * t_max:.1f} us on the rank that waits "
                   f"most, against {_bench_us(b):.1f} us in the collectives benchmark at the same size "
                   f"({t_min * 1e6 / _bench_us(b):.2f}x): " +
                   (f"the extra time is ranks waiting for each other (their work between collectives ends at "
                    f"different times: uneven compute, shared cores or memory bandwidth), not the link; a faster "
                    f"link would save at most {_bench_us(b) * calls / max(len(r['steps_s']), 1) / 1e3:.2f} ms per "
                    f"step." if t_min * 1e6 > 2 * _bench_us(b)
                    else "the link runs at its benchmark speed inside the model."))
    # prefill: the GEMM rate against the host's peak
    fl = _prefill_flops(data)
    for r in rows if on_host else []:
        per_rank = fl / r["n"] / r["prefill_s"] / 1e9
        thr = r["threads"]
        # the best rate measured with at most thr threads (a noisy multi-thread run never lowers it)
        peak = max((v for t, v in lim["gemm_gflops"].items() if int(t) <= thr), default=None)
        if peak:
            out.append(f"prefill at TP={r['n']} runs at {per_rank:.1f} GFLOP/s per rank ({r['threads']} BLAS "
                       f"thread(s)), {100 * per_rank / peak:.0f}% of the GEMM peak measured here with "
                       f"{thr} thread(s) ({peak:.1f} GFLOP/s); {r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x "
                       f"TP={base['n']}'s prefill tokens/s.")
    # memory per rank
    for r in rows[1:]:
        p, p1 = max(r["param_bytes"]), max(base["param_bytes"])
        rss, rss1 = max(r["rss_peak_bytes"]), max(base["rss_peak_bytes"])
        out.append(f"TP={r['n']} holds {100 * p / p1:.0f}% of TP={base['n']}'s parameter bytes per rank "
                   f"({_mb(p):.0f} vs {_mb(p1):.0f} MB) and peaks at {100 * rss / rss1:.0f}% of its resident memory "
                   f"({_mb(rss):.0f} vs {_mb(rss1):.0f} MB).")
    for r in rows:
        load, peak_load = max(r["rss_load_bytes"] or [0]), max(r["rss_load_peak_bytes"] or [0])
        p = max(r["param_bytes"])
        if load and peak_load > 1.2 * load:
            out.append(f"at TP={r['n']} building or loading the model peaked at {_mb(peak_load):.0f} MB per rank, "
                       f"{peak_load / load:.2f}x the {_mb(load):.0f} MB resident after it ({_mb(p):.0f} MB of them "
                       f"parameters): plan memory for the load's peak, not the steady state.")
    # cores
    for r in rows:
        if r["n"] * r["threads"] > cores:
            out.append(f"TP={r['n']} runs {r['n']} ranks x {r['threads']} thread(s) on {cores} cores: the ranks "
                       f"compete for cores, so its times measure that contention as much as the split.")
    # serving
    for r in rows:
        sv = r.get("serve") or {}
        if len(sv) < 2:
            continue
        cs = sorted(sv)
        lo, hi = sv[cs[0]], sv[cs[-1]]
        out.append(f"serving at TP={r['n']}: concurrency {cs[-1]} gives "
                   f"{hi['throughput_tok_s'] / lo['throughput_tok_s']:.2f}x "
                   f"the throughput of concurrency {cs[0]} ({hi['throughput_tok_s']:.1f} vs "
                   f"{lo['throughput_tok_s']:.1f} tok/s) at {hi['latency_p50_s'] / lo['latency_p50_s']:.2f}x "
                   f"the per-token "
                   f"p50 latency ({1e3 * hi['latency_p50_s']:.1f} vs {1e3 * lo['latency_p50_s']:.1f} ms).")
    if rows and all(r.get("serve") for r in rows):
        top = max(data["concurrency"])
        bs = max(rows, key=lambda r: r["serve"][top]["throughput_tok_s"])
        out.append(f"at concurrency {top} the most throughput comes from TP={bs['n']} "
                   f"({bs['serve'][top]['throughput_tok_s']:.1f} tok/s over all requests).")
    het = data.get("hetero")
    if het:  # its own section has the per-case notes; here the one line that decides
        rows_h = [x for x in het.get("rows", []) if x.get("equal_ms") and x.get("planned_ms")]
        for w in sorted({x["world"] for x in rows_h}):
            g = [x["equal_ms"] / x["planned_ms"] for x in rows_h if x["world"] == w]
            out.append(f"with one rank {het.get('factor', 2.0):g}x slower at world {w}, speed-planned shards ran "
                       f"{min(g):.2f}-{max(g):.2f}x as fast as equal shards (tpcore.plan_partition).")
    return out


# ---------------------------------------------------------------- Markdown and plots
def _table(head: List[str], body: List[List[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"



def _md_intro(data: dict) -> List[str]:
    """The title, the host and build, the model and the prompt."""
    lim, env = data["limits"], data["env"]
    c = data["config"]
    w = []
    w.append(f"# tpcore 1-vs-N report: {data['model']}\n")
    w.append(f"tpcore {data['tpcore']}; {lim['cores']} cores ({env.get('cpu') or 'cpu ?'}); "
             f"BLAS {(env.get('tpcore_build') or {}).get('blas', '?')}; device {data['device']}; "
             f"OPENBLAS_CORETYPE={data['openblas']['OPENBLAS_CORETYPE']}, "
             f"OPENBLAS_L2_SIZE={data['openblas']['OPENBLAS_L2_SIZE']}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n")
    w.append(f"Model: {c['model_type']}, {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads "
             f"({c['kv_heads']} KV), FFN {c['ffn_hidden']}, vocab {c['vocab_size']}. The same prompt at every world "
             f"size: batch {data['batch']}, prompt {data['prompt']} tokens, {data['new']} new tokens (greedy).\n")
    return w


def _md_limits(lim: dict) -> List[str]:
    """The host's memory-read bandwidth and GEMM peak."""
    w = []
    w.append("\n## The host's own limits\n\n")
    probes = [["memory read GB/s (the better)"] + [f"{v:.1f}" for v in lim["read_gbs"].values()]]
    for key, name in (("read_plain_gbs", "reader threads (_C.read_bytes)"), ("read_gemv_gbs", "tpcore GEMV")):
        if key in lim:
            probes.append([name] + [f"{v:.1f}" for v in lim[key].values()])
    w.append(_table([f"threads, over {human_bytes(lim['read_bytes'])}"] + [str(t) for t in lim["read_gbs"]], probes))
    w.append("\n" + _table(["GEMM float32 " + str(lim["gemm_n"]) + "^3"] +
                           [f"tpcore, {t} thread(s)" for t in lim["gemm_gflops"]] + ["NumPy matmul"],
                           [["GFLOP/s"] + [f"{v:.1f}" for v in lim["gemm_gflops"].values()] +
                            [f"{lim['numpy_gemm_gflops']:.1f}"]]))
    return w


def _md_speed(data: dict) -> List[str]:
    """Prefill and decode speed at each world size (and llama.cpp's on the same file)."""
    rows = data["worlds"]
    base = rows[0]
    w = []
    w.append("\n## Speed at each world size\n\n")
    body = []
    for r in rows:
        body.append([r["n"], r["threads"], f"{r['prefill_tok_s']:.1f}", f"{1e3 * r['ttft_s']:.1f}",
                     f"{r['decode_tok_s']:.2f}", f"{1e3 * r['p50_s']:.2f}", f"{1e3 * r['p99_s']:.2f}",
                     f"{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x",
                     f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x", "yes" if r["same_tokens"] else "NO"])
    w.append(_table(["ranks", "threads", "prefill tok/s", "TTFT ms", "decode tok/s", "p50 ms/token", "p99 ms/token",
                     "prefill speed-up", "decode speed-up", "same tokens as world 1"], body))
    lc = data.get("llama_cpp")
    if lc:
        fb = lc["file_bytes"]
        w.append(f"\nllama.cpp (llama-cpp-python {lc['llama_cpp']}) on the same GGUF file, prompt and {lc['threads']} "
                 f"threads, one process: TTFT {1e3 * lc['ttft_s']:.1f} ms, decode {lc['decode_tok_s']:.2f} tok/s; "
                 f"greedy tokens {'equal to' if lc['same_tokens'] else 'NOT equal to'} tpcore's world 1 (llama.cpp "
                 f"rounds activations to 8 bits, so near-ties may part).\n\n")
        w.append(_table(["ranks", "decode vs llama.cpp", "TTFT vs llama.cpp", "weights per rank MB",
                         "x file size / ranks"],
                        [[r["n"], f"{r['decode_tok_s'] / lc['decode_tok_s']:.2f}x",
                          f"{lc['ttft_s'] / r['ttft_s']:.2f}x", f"{_mb(max(r['param_bytes'])):.1f}",
                          f"{max(r['param_bytes']) / (fb / r['n']):.3f}"] for r in rows]))
    return w


def _md_parity(data: dict) -> List[str]:
    """Same results at every world size: the parity numbers of tpcore.bench parity, this run's model."""
    par, rows = data.get("parity"), data["worlds"]
    if not par or "parity" not in rows[0]:
        return []
    w = ["\n## Same results at every world size\n\n",
         f"Teacher forcing over {par['tokens']} tokens ({par['source']}) in windows of {par['window']}; "
         "KL(world 1 || world n) of the next-token distributions in nats (float64 log-softmax); agreement: the "
         "fraction of positions whose most likely next token is world 1's; diverges at: the first generated token "
         "(of the generate measurement above) that differs from world 1's. `python -m tpcore.bench parity` adds "
         "transformers' numbers.\n\n"]
    body = [[r["n"], f"{r['parity']['ppl']:.6g}", f"{r['parity']['kl_mean']:.2e}", f"{r['parity']['kl_max']:.2e}",
             f"{r['parity']['agree']:.4f}",
             "-" if r["parity"]["diverges_at"] is None else r["parity"]["diverges_at"],
             f"{r['parity']['ms_per_token']:.3f}"] for r in rows]
    w.append(_table(["ranks", "perplexity", "KL mean vs 1 rank", "KL max vs 1 rank", "greedy agreement",
                     "greedy diverges at", "ms/token (teacher forcing)"], body))
    return w


def _md_memory(data: dict) -> List[str]:
    """Memory per rank: parameters, KV cache, resident memory, the load's peak."""
    rows = data["worlds"]
    base = rows[0]
    w = []
    w.append("\n## Memory per rank\n\n")
    body = []
    for r in rows:
        p, kv, rss = max(r["param_bytes"]), max(r["kv_bytes"]), max(r["rss_peak_bytes"])
        body.append([r["n"], f"{_mb(p):.1f}", f"{_mb(kv):.2f}", f"{_mb(max(r['rss_load_bytes'])):.0f}",
                     f"{_mb(max(r['rss_load_peak_bytes'])):.0f}", f"{_mb(rss):.0f}",
                     " / ".join(f"{_mb(x):.0f}" for x in r["rss_peak_bytes"]),
                     f"{100 * p / max(base['param_bytes']):.0f}%", f"{100 * rss / max(base['rss_peak_bytes']):.0f}%"])
    w.append(_table(["ranks", "params MB", "KV cache MB", "RSS after load MB", "peak during load MB",
                     "peak RSS MB (whole run)", "peak RSS MB per rank", "params vs world 1", "peak RSS vs world 1"],
                    body))
    w.append("\nWhere the bytes are (`model.memory()` after the generate measurement, the largest rank), beside "
             "`tpcore.models.estimate_memory`'s total for the same model, split, batch, cache and prompt, computed "
             "from the config before anything was loaded.\n\n")
    body = []
    for r in rows:
        m = max(r.get("memory") or [{}], key=lambda x: x.get("total", 0))
        if m:
            body.append([r["n"], f"{_mb(m['params']):.1f}", f"{_mb(m['grads']):.1f}", f"{_mb(m['kv_cache']):.2f}",
                         f"{_mb(m['kv_cache_used']):.2f}", f"{_mb(m['workspace']):.2f}", f"{_mb(m['comm']):.2f}",
                         f"{_mb(m['total']):.1f}", f"{_mb(m['estimate']):.1f}"])
    w.append(_table(["ranks", "params MB", "grads MB", "KV cache MB", "KV used MB", "workspace MB", "comm MB",
                     "total MB", "estimate MB"], body))
    if any(r.get("checkpoint_bytes") for r in rows):
        w.append("\nThe load (from_pretrained streams each rank's slices through one staging buffer): its peak "
                 "above the RSS before it, beside N/w (the checkpoint's N bytes over the ranks) and the staging "
                 "buffer.\n\n")
        body = []
        for r in rows:
            if not r.get("checkpoint_bytes"):
                continue
            b0, nw, stg = r["rss_before_load_bytes"], r["checkpoint_bytes"] / r["n"], r["load_staging_bytes"]
            peak = max(x - b for x, b in zip(r["rss_load_peak_bytes"], b0))
            after = max(x - b for x, b in zip(r["rss_load_bytes"], b0))
            body.append([r["n"], f"{_mb(peak):.0f}", f"{_mb(after):.0f}", f"{_mb(nw):.0f}", f"{_mb(stg):.0f}",
                         f"{_mb(1.1 * nw + stg):.0f}"])
        w.append(_table(["ranks", "load peak - before MB", "after - before MB", "N/w MB", "staging MB",
                         "N/w + staging + 10% MB"], body))
    if data.get("device", "cpu") != "cpu":
        w.append("\nOn GPUs the RSS columns are the host processes' memory; the parameters and KV cache are on "
                 "the devices (their allocators' peaks are not measured in this version), and the host's limits "
                 "above do not bound the ranks (no advice is drawn from them).\n")
    w.append("\nKV cache: the generate measurement's (batch x (prompt + new) positions); the serving runs "
             "allocate their own slots (concurrency x their longest request) and are in the whole run's peak.\n")
    return w


def _md_collectives(rows: List[dict]) -> List[str]:
    """Time in collectives per layer kind, decode and prefill."""
    w = []
    w.append("\n## Time in collectives, per layer kind\n\nPer decode step (one token for every sequence) and for "
             "the prefill; seconds are the slowest rank's (waiting for peers included).\n\n")
    body = []
    for r in rows[1:]:
        steps = max(len(r["steps_s"]), 1)
        for phase in ("decode", "prefill"):
            d = r[f"comm_{phase}"]
            span = r["decode_s"] if phase == "decode" else r["prefill_s"]
            div = steps if phase == "decode" else 1
            for k in [k for k in REGIONS if k in d] + ["total"]:
                v = d.get(k)
                if not v:
                    continue
                body.append([r["n"], phase, k, f"{v['calls'] / div:.1f}", human_bytes(v["bytes"] / div),
                             f"{1e3 * v['seconds_max'] / div:.3f}", f"{100 * v['seconds_max'] / span:.1f}%"])
    w.append(_table(["ranks", "phase", "layer kind", "calls", "bytes", "ms (max rank)", "share of the phase"], body)
             if body else "(one world size: no collectives)\n")
    w.append("\nattention, mlp: the blocks' all-reduces; embedding: the vocab-parallel lookup's; head: the LM "
             "head's logits gather; other: generate's argument agreement and the KV cache's registered-buffer "
             "allocation (collective), where the ranks also absorb their skew on entry.\n")
    w.append("\nBytes through collectives per generated token (per rank): " +
             ", ".join(f"TP={r['n']} {human_bytes(r['bytes_per_token'])}" for r in rows) + ".\n")
    return w


def _md_link(data: dict) -> List[str]:
    """The link inside the model against the collectives benchmark at the same message sizes."""
    rows = data["worlds"]
    msg = _message_sizes(data)
    w = []
    w.append("\n## The link: inside the model against the collectives benchmark\n\n")
    body = []
    for r in rows[1:]:
        for phase in ("decode", "prefill"):
            b = _bench_at(r, "all_reduce", msg[phase])
            d = r[f"comm_{phase}"]
            calls = sum(d.get(k, {}).get("calls", 0) for k in ("attention", "mlp"))
            if not calls or b is None:
                continue
            t_min = sum(d.get(k, {}).get("seconds_min", 0) for k in ("attention", "mlp")) / calls
            body.append([r["n"], phase, human_bytes(msg[phase]), f"{1e6 * t_min:.1f}",
                         f"{msg[phase] / t_min / 1e9:.2f}", f"{_bench_us(b):.1f}", f"{b['algbw']:.2f}",
                         f"{b['busbw']:.2f}", f"{1e6 * t_min / _bench_us(b):.2f}x"])
        hb = next((b for b in r.get("bench", []) if b.get("op") == "all_gather"), None)
        hd = r["comm_decode"].get("head")
        if hb and hd and hd["calls"]:
            t = hd["seconds_min"] / hd["calls"]
            body.append([r["n"], "decode head", human_bytes(hb["bytes"]) + " gather", f"{1e6 * t:.1f}",
                         f"{hb['bytes'] / t / 1e9:.2f}", f"{_bench_us(hb):.1f}", f"{hb['algbw']:.2f}",
                         f"{hb['busbw']:.2f}", f"{1e6 * t / _bench_us(hb):.2f}x"])
    w.append(_table(["ranks", "phase", "message", "in model us", "in model algbw GB/s", "benchmark us",
                     "benchmark algbw GB/s", "benchmark busbw GB/s", "model time / benchmark time"], body)
             if body else "(no multi-rank world size, or no per-region counters)\n")
    w.append("\nBoth times are per call on the rank that waited least (closest to the transfer itself); the "
             "benchmark runs the same collective in registered memory after a barrier (tpcore.bench collectives; "
             "its algbw and busbw columns are the slowest rank's, as nccl-tests prints them).\n")
    return w


def markdown(data: dict, plots: List[str]) -> str:
    """The report as Markdown: data as run() gathered it, plots the PNG files' names."""
    rows = data["worlds"]
    w = _md_intro(data) + _md_limits(data["limits"]) + _md_speed(data) + _md_parity(data) + _md_memory(data)
    w += _md_collectives(rows) + _md_link(data)
    if any(r.get("serve") for r in rows):
        w.append("\n## Concurrent requests (continuous batching)\n\n")
        body = []
        for r in rows:
            for cc, s in sorted((r.get("serve") or {}).items()):
                body.append([r["n"], cc, s["requests"], s["generated_tokens"], f"{s['throughput_tok_s']:.1f}",
                             f"{1e3 * s['ttft_p50_s']:.1f}", f"{1e3 * s['ttft_p99_s']:.1f}",
                             f"{1e3 * s['latency_p50_s']:.2f}", f"{1e3 * s['latency_p99_s']:.2f}",
                             f"{'yes' if s.get('same_as_generate', True) else 'NO'} "
                             f"({s.get('checked_against_generate', 0)} of {s['requests']})"])
        w.append(_table(["ranks", "concurrency", "requests", "tokens", "tok/s (all requests)", "TTFT p50 ms",
                         "TTFT p99 ms", "per-token p50 ms", "per-token p99 ms", "tokens = generate (checked)"], body))
    het = data.get("hetero")
    if het:
        from tpcore.bench import hetero as hetero_bench
        w.append("\n## Mismatched devices: one rank made slower\n\n")
        w.append(hetero_bench.markdown(het).rstrip("\n") + "\n")
    w.append("\n## Advice from these measurements\n\n")
    w.extend(f"- {line}\n" for line in data["advice"])
    if plots:
        w.append("\n## Plots\n\n")
        w.extend(f"![{os.path.splitext(p)[0]}]({p})\n\n" for p in plots)
    return "".join(w)


def _plots(out: str, data: dict) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("# plots need matplotlib (pip install 'tpcore[bench]')")
        return []
    rows = data["worlds"]
    ns = [str(r["n"]) for r in rows]
    made = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=100)
        plt.close(fig)
        made.append(name)

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    ax[0].bar(ns, [r["prefill_tok_s"] for r in rows])
    ax[0].set_ylabel("prefill tokens/s")
    ax[1].bar(ns, [r["decode_tok_s"] for r in rows])
    ax[1].set_ylabel("decode tokens/s")
    ax[2].bar(ns, [1e3 * r["p50_s"] for r in rows], label="p50")
    ax[2].plot(ns, [1e3 * r["p99_s"] for r in rows], "ro", label="p99")
    ax[2].set_ylabel("ms per token")
    ax[2].legend()
    for a in ax:
        a.set_xlabel("ranks")
    fig.suptitle(f"{data['model']}: speed at each world size")
    save(fig, "speed.png")

    fig, ax = plt.subplots(figsize=(6, 3.8))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [_mb(max(r["param_bytes"])) for r in rows], 0.4, label="parameters")
    ax.bar(x + 0.2, [_mb(max(r["rss_peak_bytes"])) for r in rows], 0.4, label="peak RSS")
    ax.set_xticks(x, ns)
    ax.set_xlabel("ranks")
    ax.set_ylabel("MB per rank")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
    ax.legend(loc="upper center", ncol=2)
    fig.suptitle("memory per rank")
    save(fig, "memory.png")

    fig, ax = plt.subplots(figsize=(7, 3.8))
    bottom = np.zeros(len(rows))
    comp = []
    for r in rows:
        per = _decode_comm_share(r)
        comp.append(1e3 * (r["p50_s"] - per.get("total", 0.0)))
    ax.bar(ns, comp, label="compute (and the rest)", bottom=bottom)
    bottom += np.array(comp)
    for k in REGIONS:
        v = np.array([1e3 * _decode_comm_share(r).get(k, 0.0) for r in rows])
        if v.any():
            ax.bar(ns, v, bottom=bottom, label=f"{k} collectives")
            bottom += v
    ax.set_xlabel("ranks")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=8)
    fig.suptitle("where a decode step goes")
    save(fig, "decode_breakdown.png")

    if any(r.get("serve") for r in rows):
        fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
        for i, r in enumerate(rows):
            sv = r.get("serve") or {}
            cs = sorted(sv)
            who = f"{r['n']} rank" + ("s" if r["n"] != 1 else "")
            ax[0].plot(cs, [sv[c]["throughput_tok_s"] for c in cs], "o-", label=who, color=f"C{i}")
            ax[1].plot(cs, [1e3 * sv[c]["latency_p50_s"] for c in cs], "o-", label=f"{who} p50", color=f"C{i}")
            ax[1].plot(cs, [1e3 * sv[c]["latency_p99_s"] for c in cs], "x--", label=f"{who} p99", color=f"C{i}")
        conc = sorted({int(c) for r in rows for c in (r.get("serve") or {})})
        for a in ax:
            a.set_xscale("log", base=2)
            a.set_xticks(conc, [str(c) for c in conc])  # 1, 4, 16: not 2^0, 2^2
            a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            a.set_xlabel("concurrent requests")
            a.legend(fontsize=8)
        ax[0].set_ylabel("tokens/s over all requests")
        ax[1].set_ylabel("ms per token")
        fig.suptitle("continuous batching")
        save(fig, "serving.png")
    het = data.get("hetero")
    if het:
        from tpcore.bench import hetero as hetero_bench
        if hetero_bench.plot(het, os.path.join(out, "hetero.png")):
            made.append("hetero.png")
    return made
