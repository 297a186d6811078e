"""1-vs-N report: one model, prompt, context and batch at each world size, written as Markdown.

    python -m tpcore.bench report                                   # GPT-2-small-sized (random), worlds 1,2,4
    python -m tpcore.bench report --quick                           # a tiny model, worlds 1,2 (smoke test)
    python -m tpcore.bench report --model llama-1b-like --worlds 1,2
    python -m tpcore.bench report --checkpoint DIR --worlds 1,2,4 --concurrency 1,4,16 --out report/
    python -m tpcore.bench report --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf --worlds 1,2   # a GGUF file
    python benchmarks/report.py --json report.json

The method: measure one device first, then two or more with the same model,
prompt, context and batch, and record per-device memory, tokens/s, latency, collective time
and link use.  For each world size the same model (the same seed, or --checkpoint) runs, on
every rank of one tpcore.spawn:

  generate     a batched prefill of --prompt tokens per sequence, then --new greedy tokens:
               prefill tok/s, TTFT, decode tok/s, per-token latency p50/p99 (the slowest rank's
               clock), the greedy tokens (they must equal world 1's)
  collectives  the time and bytes of every collective of the prefill and of the decode steps,
               per layer kind (comm.stats()["regions"]: attention, mlp, embedding, head, other),
               and the same collectives in the collectives benchmark at the same message sizes
               (registered memory, as the layers use): the link bandwidth the model achieved
               against what the link gives
  parity       the perplexity of a text (teacher forcing), KL(world 1 || world n) of its next-token
               distributions, mean and max, and the greedy agreement (tpcore.bench parity's numbers)
  memory       per rank: parameter bytes, KV-cache bytes, peak resident memory (VmHWM)
  serving      tpcore.serve.Engine (continuous batching) at each --concurrency: throughput over
               all requests, TTFT and per-token latency p50/p99

and once, in this process: the host's memory-read bandwidth (one reader thread per core, 1 to all
cores) and its GEMM peak (tpcore's BLAS, 1 thread and all threads; NumPy's matmul beside it).
With --hetero (default on unless --quick), the mismatched-devices benchmark (tpcore.bench
hetero): one rank made 2x slower, equal shards against planned shards.

Everything lands in --out (default ./tpcore-report): report.md, the PNG plots (matplotlib,
optional) and, with --json, the raw numbers.  The advice lines at the end are computed from the
measurements of this run.  Machines here are shared and have few cores: ranks beyond the cores
compete for them; the report says so where it happens.

This module holds the options, the measurements and the driver; the derived numbers, the
advice, the Markdown and the plots are in _report_writeup.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Dict, List, Optional

import numpy as np

from tpcore.models.memory import memory_and_estimate
from tpcore.bench._report_writeup import _plots, advice, markdown
from tpcore.bench._sweep import Plan, Progress, env_info, human_bytes, sweep
from tpcore.bench.decode import GPT2_SMALL  # the decode benchmark's GPT-2-small shapes

# Llama 3.2 1B's shapes (GQA 32/8, SwiGLU, RMSNorm, RoPE, tied head), random weights
LLAMA_1B = dict(vocab_size=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn_hidden=8192, norm="rmsnorm",
                eps=1e-5, activation="swiglu", positions="rope", rope_theta=500000.0, max_positions=2048, bias=False,
                tie_embeddings=True, model_type="llama")
TINY = dict(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=192, norm="rmsnorm",
            activation="swiglu", positions="rope", max_positions=256, bias=False, model_type="llama")
MODELS = {"gpt2-small": GPT2_SMALL, "llama-1b-like": LLAMA_1B, "tiny": TINY}


def _ints(text):
    try:
        v = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="a Hugging Face or tpcore checkpoint directory")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="random weights of these shapes (default gpt2-small; --quick: tiny)")
    p.add_argument("--worlds", type=_ints, default=None, help="world sizes (default 1,2,4; --quick 1,2)")
    p.add_argument("--concurrency", type=_ints, default=None,
                   help="serving: requests in flight (default 1,4,16; --quick 1,4)")
    p.add_argument("--batch", type=int, default=1, help="sequences of the generate measurement")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens per sequence (default 64; --quick 16)")
    p.add_argument("--new", type=int, default=None, help="new tokens per sequence (default 32; --quick 8)")
    p.add_argument("--requests", type=int, default=None,
                   help="serving: requests per concurrency level (default max(8, 2 x concurrency))")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: one GPU per rank (the nccl backend)")
    p.add_argument("--no-serve", dest="serve", action="store_false", help="skip the serving measurement")
    p.add_argument("--hetero", dest="hetero", action="store_true", default=None,
                   help="run the mismatched-devices section (default: on, off with --quick)")
    p.add_argument("--no-hetero", dest="hetero", action="store_false")
    p.add_argument("--out", default="tpcore-report", help="directory of report.md and the plots")
    p.add_argument("--json", metavar="FILE", nargs="?", const="", default=None,
                   help="write the raw numbers (FILE, or OUT/report.json)")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--quick", action="store_true", help="a tiny model and short runs (CI smoke test)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one world size may take")


# ---------------------------------------------------------------- the host's own limits
def _threads_read(a: np.ndarray, t: int, reps: int) -> float:
    """GB/s of t threads reading disjoint parts of a at once (best of reps)."""
    from tpcore import _C
    parts = np.array_split(a, t)
    best = float("inf")
    for _ in range(reps):
        go = threading.Barrier(t + 1)

        def reader(part):
            go.wait()
            _C.read_bytes(part)

        ths = [threading.Thread(target=reader, args=(p,)) for p in parts]
        for th in ths:
            th.start()
        go.wait()
        t0 = time.perf_counter()
        for th in ths:
            th.join()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def host_limits(quick: bool, progress: Progress) -> dict:
    """Memory-read bandwidth at 1..cores threads and the GEMM peak (tpcore's BLAS and NumPy's),
    measured in this process.  Read bandwidth is the better of two probes over one buffer: plain
    reader threads (_C.read_bytes, each its part) and tpcore's GEMV (one row times the buffer as a
    weight, on t BLAS threads: how decode reads its weights)."""
    import tpcore
    from tpcore import _C
    cores = os.cpu_count() or 1
    nbytes = (64 if quick else 1024) << 20
    reps = 2 if quick else 3
    progress.status(f"[report] host: memory read bandwidth over {human_bytes(nbytes)}", important=True)
    K = 1024
    a = np.ones(nbytes // 4, np.float32)  # touched: its pages exist
    w = a.reshape(-1, K)
    x1, y1 = np.ones((1, K), np.float32), np.empty((1, w.shape[0]), np.float32)
    threads = sorted({1, cores} | {t for t in (2, 4, 8, 16, 32) if t < cores})
    before = tpcore.get_num_threads()
    plain, gemv, gemm = {}, {}, {}
    try:
        for t in threads:
            plain[t] = _threads_read(a, t, reps)
            tpcore.set_num_threads(t)
            _C.linear_forward(x1, w, None, y1)
            gemv[t] = a.nbytes / min(_timed(lambda: _C.linear_forward(x1, w, None, y1)) for _ in range(reps)) / 1e9
        a = w = None  # free the buffer before the GEMM
        n = 256 if quick else 1024
        rng = np.random.default_rng(1)
        x = rng.standard_normal((n, n), dtype=np.float32)
        wg = rng.standard_normal((n, n), dtype=np.float32)
        y = np.empty((n, n), np.float32)
        progress.status(f"[report] host: GEMM peak ({n}^3 float32)", important=True)
        for t in sorted({1, cores}):
            tpcore.set_num_threads(t)
            _C.linear_forward(x, wg, None, y)
            best = min(_timed(lambda: _C.linear_forward(x, wg, None, y)) for _ in range(3 if quick else 5))
            gemm[t] = 2.0 * n ** 3 / best / 1e9
    finally:
        tpcore.set_num_threads(before)
    x @ wg.T
    npg = 2.0 * n ** 3 / min(_timed(lambda: x @ wg.T) for _ in range(3 if quick else 5)) / 1e9
    return {"cores": cores, "read_gbs": {t: max(plain[t], gemv[t]) for t in threads}, "read_plain_gbs": plain,
            "read_gemv_gbs": gemv, "read_bytes": nbytes, "gemm_n": n, "gemm_gflops": gemm, "numpy_gemm_gflops": npg}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- one world size (every rank)
def _proc_status(key: str) -> Optional[int]:
    """A byte count of /proc/self/status (VmRSS: resident now, VmHWM: the peak so far)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if key == "VmHWM":
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return None


def _staging_bytes() -> int:
    """The staging buffer from_pretrained streams a checkpoint through (TPCORE_LOAD_STAGING_MB)."""
    from tpcore.io import stream as _stream
    return _stream.staging_arg(None, "report")


def _checkpoint_bytes(path) -> int:
    """N: the bytes of a checkpoint's weight files (*.safetensors, *.gguf); 0 without one."""
    if not path:
        return 0
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith((".safetensors", ".gguf")))


def _model(comm, spec: dict):
    import tpcore
    dev = None
    if spec["device"] != "cpu":
        dev = f"cuda:{comm.local_rank}"
    if spec["checkpoint"]:
        return tpcore.models.from_pretrained(spec["checkpoint"], comm, progress=False, device=dev)
    return tpcore.models.TransformerLM(tpcore.Config(**spec["config"]), comm, seed=0, device=dev)


def _regions(st: dict) -> Dict[str, dict]:
    """comm.stats()'s per-region counters ({} where the build has none)."""
    return {k: dict(v) for k, v in (st.get("regions") or {}).items()}


def _delta(a: dict, b: dict) -> dict:
    """Per-region counters between two comm.stats() snapshots, plus "total"."""
    ra, rb = _regions(a), _regions(b)
    out = {}
    for name in sorted(set(ra) | set(rb)):
        x, y = ra.get(name, {}), rb.get(name, {})
        d = {k: y.get(k, 0) - x.get(k, 0) for k in ("calls", "bytes", "seconds")}
        if d["calls"]:
            out[name] = d
    out["total"] = {"calls": b["calls"] - a["calls"], "bytes": b["bytes"] - a["bytes"],
                    "seconds": b["seconds"] - a["seconds"]}
    return out


def _kv_bytes(model, batch: int, length: int) -> int:
    """This rank's KV-cache bytes for batch sequences of length tokens (float32 K and V)."""
    return sum(2 * batch * length * b.nk * model.config.head_dim * 4 for b in model.blocks)


def _rank(comm, spec: dict, prompts: np.ndarray, serve_reqs: Dict[int, list]) -> dict:
    """Run on every rank by tpcore.spawn: the generate, collectives and serving measurements."""
    import tpcore
    prog = Progress(spec["progress"] and comm.rank == 0)
    n = comm.size
    tag = f"[report] world {n}"
    prog.status(f"{tag}: building the model", important=True)
    try:   # the load's own peak: VmHWM reset to VmRSS first (Linux), so it is not the imports'
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = _proc_status("VmRSS")
    model = _model(comm, spec)   # from_pretrained streams the files through one staging buffer
    loaded = {"rss_load_bytes": _proc_status("VmRSS"), "rss_load_peak_bytes": _proc_status("VmHWM"),
              "rss_before_load_bytes": before, "load_staging_bytes": _staging_bytes(),
              "checkpoint_bytes": _checkpoint_bytes(spec["checkpoint"])}
    cfg = model.config
    B, T, new = prompts.shape[0], prompts.shape[1], spec["new"]
    model.generate(prompts[:, :min(T, 4)], max_new_tokens=2)  # warm-up: allocations, first touch, threads
    comm.barrier()
    prog.status(f"{tag}: generate (batch {B}, prompt {T}, {new} new tokens)", important=True)
    clock: List[float] = []
    snaps: List[dict] = []

    def on_token(step):
        clock.append(time.perf_counter())
        if step <= 0:  # after the prefill, and after the first token (the head's gather)
            snaps.append(comm.stats())

    model._on_token = on_token
    s0 = comm.stats()
    t0 = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=new, eos_token_id=-1)
    t_end = time.perf_counter()
    s_end = comm.stats()
    model._on_token = None
    par = spec.get("parity")
    if par:  # the same text's teacher-forced logits at every world size (tpcore.bench parity)
        from tpcore.bench.parity import world_logits
        path = os.path.join(par["dir"], f"world{n}.npy") if comm.rank == 0 else None
        parity_s = world_logits(model, par["ids"], par["window"], path)
    prefill_s, ttft_s = clock[0] - t0, clock[1] - t0
    steps = np.diff(clock[1:]).tolist()  # one decode step per new token after the first
    result = {"rank": comm.rank, "n": n, "prefill_s": prefill_s, "ttft_s": ttft_s, "steps_s": steps,
              "decode_s": t_end - clock[1] if len(clock) > 2 else float("nan"),
              "comm_prefill": _delta(s0, snaps[0]), "comm_head0": _delta(snaps[0], snaps[1]),
              "comm_decode": _delta(snaps[1], s_end),
              "param_bytes": model.param_bytes(), "kv_bytes": _kv_bytes(model, B, T + new),
              "read_bytes": _weights_read(model),
              "memory": memory_and_estimate(model, B, T + new, T),
              "tokens": np.asarray(out)[:, T:].tolist(), "threads": tpcore.get_num_threads(),
              "config": dict(vars(cfg))}
    if par:
        result["parity_s"] = parity_s
    # the same collectives in the collectives benchmark, at the model's message sizes
    if n > 1:
        C, V = cfg.hidden, cfg.vocab_size
        sizes = sorted({B * C * 4, B * T * C * 4})
        plan = Plan(ops=["all_reduce"], sizes=sizes, modes=["registered"], target_s=0.05 if spec["quick"] else 0.2,
                    max_iters=2000)
        head = Plan(ops=["all_gather"], sizes=[B * V * 4 // n * n], modes=["private"],
                    target_s=0.05 if spec["quick"] else 0.2, max_iters=2000)
        prog.status(f"{tag}: the collectives benchmark at the model's message sizes", important=True)
        from tpcore.bench._tpcore import TpcoreImpl
        result["bench"] = sweep(TpcoreImpl(comm, plan), plan) + sweep(TpcoreImpl(comm, head), head)
    # serving: continuous batching at each concurrency
    if serve_reqs:
        from tpcore.bench import serve as serve_bench
        result["serve"] = {}
        for c, reqs in serve_reqs.items():
            prog.status(f"{tag}: serving {len(reqs)} requests at concurrency {c}", important=True)
            comm.barrier()
            m = serve_bench.measure(model, c, reqs)
            # untimed: the first requests' tokens against generate() alone
            # (a request that met EOS stops there; generate pads after it).  Every request with --quick,
            # else the first three: each check is a generate of its own
            check = list(zip(reqs, m["tokens"]))[:None if spec["quick"] else 3]
            m["same_as_generate"] = all(
                np.asarray(model.generate([p], max_new_tokens=k, temperature=0.0)[0])[p.size:p.size + len(toks)]
                .tolist() == toks
                for (p, k), toks in check)
            m["checked_against_generate"] = len(check)
            for key in ("ttft_s", "latency_s", "tokens"):  # per-request lists: the percentiles stay
                m.pop(key, None)
            result["serve"][c] = m
    result.update(loaded)
    result["rss_peak_bytes"] = _proc_status("VmHWM")
    prog.done()
    return result


def _weights_read(model) -> int:
    """The weight bytes the last decode step read on this rank: every parameter, except that a MoE
    model's experts count only as those that had tokens (top-k per layer, not all)."""
    from tpcore.models.moe_block import expert_bytes
    e = expert_bytes(model)
    return int(model.param_bytes() - e["held"] + e["read"])


# ---------------------------------------------------------------- the driver
def _pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")


def _world_row(res: List[dict], B: int, T: int, new: int) -> dict:
    """One world size's numbers: times are the slowest rank's, memory per rank."""
    n = res[0]["n"]
    steps = np.max(np.array([r["steps_s"] for r in res]), axis=0) if new > 1 else np.zeros(0)
    dec = max(r["decode_s"] for r in res)
    row = {"n": n, "threads": res[0]["threads"], "prefill_s": max(r["prefill_s"] for r in res),
           "ttft_s": max(r["ttft_s"] for r in res), "decode_s": dec,
           "p50_s": _pct(steps, 50), "p99_s": _pct(steps, 99), "steps_s": steps.tolist(),
           "param_bytes": [r["param_bytes"] for r in res], "kv_bytes": [r["kv_bytes"] for r in res],
           "read_bytes": [r.get("read_bytes", r["param_bytes"]) for r in res],
           "rss_peak_bytes": [r["rss_peak_bytes"] for r in res], "rss_load_bytes": [r["rss_load_bytes"] for r in res],
           "rss_load_peak_bytes": [r["rss_load_peak_bytes"] for r in res], "tokens": res[0]["tokens"],
           "rss_before_load_bytes": [r.get("rss_before_load_bytes") or 0 for r in res],
           "memory": [r["memory"] for r in res],
           "load_staging_bytes": res[0].get("load_staging_bytes", 0),
           "checkpoint_bytes": res[0].get("checkpoint_bytes", 0),
           "same_tokens_across_ranks": all(r["tokens"] == res[0]["tokens"] for r in res)}
    if "parity_s" in res[0]:
        row["parity_s"] = max(r["parity_s"] for r in res)
    row["prefill_tok_s"] = B * T / row["prefill_s"]
    row["decode_tok_s"] = B * (new - 1) / dec if new > 1 and dec > 0 else float("nan")
    # collectives per layer kind: the slowest rank's seconds (waiting included), rank 0's bytes
    for phase in ("prefill", "decode"):
        per = [r[f"comm_{phase}"] for r in res]
        names = sorted({k for p in per for k in p})
        row[f"comm_{phase}"] = {k: {"calls": per[0].get(k, {}).get("calls", 0),
                                    "bytes": per[0].get(k, {}).get("bytes", 0),
                                    "seconds_max": max(p.get(k, {}).get("seconds", 0.0) for p in per),
                                    "seconds_min": min(p.get(k, {}).get("seconds", 0.0) for p in per)}
                                for k in names}
    row["bytes_per_token"] = row["comm_decode"]["total"]["bytes"] / (B * max(new - 1, 1)) if new > 1 else 0.0
    if "bench" in res[0]:
        from tpcore.bench._sweep import combine
        row["bench"] = combine("tpcore", n, "float32", [r["bench"] for r in res])
    if "serve" in res[0]:
        row["serve"] = {}
        for c in res[0]["serve"]:
            per = [r["serve"][c] for r in res]
            s = dict(per[0])
            s["wall_s"] = max(p["wall_s"] for p in per)
            s["throughput_tok_s"] = s["generated_tokens"] / s["wall_s"] if s["wall_s"] > 0 else float("nan")
            s["same_as_generate"] = all(p.get("same_as_generate", True) for p in per)
            row["serve"][c] = s
    return row


def _serve_requests(vocab: int, conc: List[int], count: Optional[int], quick: bool, max_len: int) -> Dict[int, list]:
    """The serving workload: per concurrency level, requests of fixed-seed prompt and output lengths."""
    rng = np.random.default_rng(12)
    plo, phi, olo, ohi = (4, 17, 4, 9) if quick else (8, 65, 8, 33)
    phi, ohi = min(phi, max(plo + 1, max_len // 2)), min(ohi, max(olo + 1, max_len // 2))
    out = {}
    for c in conc:
        k = count or max(8 if not quick else 4, 2 * c)
        out[c] = [(rng.integers(0, vocab, int(rng.integers(plo, phi))).astype(np.int64), int(rng.integers(olo, ohi)))
                  for _ in range(k)]
    return out


def run(args) -> int:
    import tpcore
    quick = args.quick
    # every comparison is against one rank: world 1 runs first, whatever order was given
    worlds = sorted(set(args.worlds or ([1, 2] if quick else [1, 2, 4])) | {1})
    conc = sorted(set(args.concurrency or ([1, 4] if quick else [1, 4, 16])))
    T = (16 if quick else 64) if args.prompt is None else args.prompt
    new = (8 if quick else 32) if args.new is None else args.new
    B = args.batch
    if B < 1 or T < 1 or new < 2:
        raise SystemExit("report: --batch and --prompt must be >= 1 and --new >= 2")
    if args.requests is not None and args.requests < 1:
        raise SystemExit(f"report: --requests must be >= 1, got {args.requests}")
    if args.checkpoint and args.model:
        raise SystemExit("report: give --checkpoint or --model, not both")
    if args.device not in ("cpu", "cuda"):
        raise SystemExit(f"report: --device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not tpcore.cuda_available():
        raise SystemExit(f"report: --device cuda, but no usable GPU: {tpcore.build_info()['cuda'].get('status')}")
    hetero = (not quick) if args.hetero is None else args.hetero
    model_name = args.checkpoint or args.model or ("tiny" if quick else "gpt2-small")
    from tpcore.bench.decode import gguf_path
    if args.checkpoint and gguf_path(args.checkpoint):  # a GGUF file: its metadata (and its formats kept)
        import tpcore.models.gguf
        cfg = tpcore.models.gguf.read_gguf(gguf_path(args.checkpoint))[0]
        cfgd = None
    elif args.checkpoint:
        cfg = tpcore.Config.from_hf(args.checkpoint) if os.path.exists(os.path.join(args.checkpoint, "config.json")) \
            else None
        cfgd = None
    else:
        cfgd = dict(MODELS[model_name])
        cfg = tpcore.Config(**cfgd)
    vocab = cfg.vocab_size if cfg else 50257
    if cfg is not None and cfg.positions == "learned" and T + new > cfg.max_positions:
        raise SystemExit(f"report: prompt + new = {T + new} exceeds the model's max_positions {cfg.max_positions}")
    os.makedirs(args.out, exist_ok=True)
    progress = Progress(args.progress)
    env = env_info()
    limits = host_limits(quick, progress)
    prompts = np.random.default_rng(0).integers(0, vocab, (B, T)).astype(np.int64)
    max_len = cfg.max_positions if cfg is not None else 1024
    serve_reqs = _serve_requests(vocab, conc, args.requests, quick, max_len) if args.serve else {}
    from tpcore.bench import parity
    pids, pwin, psource = parity.report_tokens(args.checkpoint, cfg or parity.checkpoint_config(args.checkpoint),
                                               quick)
    pdir = tempfile.mkdtemp(prefix="tpcore-report-parity-")
    spec = {"config": cfgd, "checkpoint": args.checkpoint, "device": args.device, "new": new, "quick": quick,
            "progress": args.progress, "parity": {"ids": pids, "window": pwin, "dir": pdir}}
    backend = "nccl" if args.device == "cuda" else "shm"
    rows = []
    t_all = time.perf_counter()
    try:
        for i, n in enumerate(worlds):
            progress.status(f"[report] world {n} ({i + 1}/{len(worlds)})", important=True)
            res = tpcore.spawn(_rank, n, args=(spec, prompts, serve_reqs), backend=backend, deadline=args.timeout)
            rows.append(_world_row(res, B, T, new))
            if cfg is None:
                cfg = tpcore.Config(**{k: v for k, v in res[0]["config"].items()})
        parity.report_rows(rows, pids, pdir)
    finally:
        shutil.rmtree(pdir, ignore_errors=True)
    het = None
    if hetero:
        progress.status("[report] mismatched devices (tpcore.bench hetero)", important=True)
        from tpcore.bench import hetero as hetero_bench
        het = hetero_bench.run(quick=quick, progress=args.progress)
    llama = None
    gpath = gguf_path(args.checkpoint) if args.checkpoint else None
    # the same file in llama.cpp, the same cores (tpcore.bench decode's peer), in a spawned child: its
    # OpenMP threads would hang forked children that use OpenMP, and a llama.cpp built with AMX can crash
    if gpath and args.device == "cpu":
        import importlib.util
        if importlib.util.find_spec("llama_cpp") is not None:
            from tpcore.bench.decode import llamacpp_peer_in_child
            progress.status("[report] llama.cpp on the same file", important=True)
            llama, why = llamacpp_peer_in_child(gpath, prompts, new, limits["cores"])
            if llama is None:
                progress.status(f"[report] llama.cpp peer skipped: {why}", important=True)
            else:
                llama["same_tokens"] = llama.pop("tokens") == rows[0]["tokens"]
                llama["decode_tok_s"] = B * (new - 1) / llama["decode_s"]
                llama["file_bytes"] = os.path.getsize(gpath)
    progress.done(f"[report] measured in {time.perf_counter() - t_all:.0f} s")
    ref = rows[0]["tokens"]
    for r in rows:
        r["same_tokens"] = r["tokens"] == ref and r["same_tokens_across_ranks"]
    data = {"tpcore": tpcore.__version__, "env": env, "model": model_name, "config": dict(vars(cfg)),
            "batch": B, "prompt": T, "new": new, "device": args.device, "limits": limits, "worlds": rows,
            "concurrency": conc, "hetero": het, "llama_cpp": llama,
            "parity": {"tokens": int(pids.size), "window": pwin, "source": psource},
            "openblas": {k: os.environ.get(k, "unset") for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}}
    data["advice"] = advice(data)
    plots = _plots(args.out, data) if args.plots else []
    md = markdown(data, plots)
    path = os.path.join(args.out, "report.md")
    with open(path, "w") as f:
        f.write(md)
    print(md)
    print(f"# wrote {path}" + (f" and {len(plots)} plots" if plots else ""))
    if args.json is not None:
        jpath = args.json or os.path.join(args.out, "report.json")
        with open(jpath, "w") as f:
            json.dump(data, f, indent=1, default=_jsonable)
        print(f"# wrote {jpath}")
    ok = all(r["same_tokens"] for r in rows) and all(s.get("same_as_generate", True)
                                                      for r in rows for s in r.get("serve", {}).values())
    return 0 if ok else 1


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
