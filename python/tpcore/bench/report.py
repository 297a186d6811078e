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
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Dict, List, Optional

import numpy as np

from tpcore.models.memory import memory_and_estimate
from tpcore.bench._sweep import Plan, Progress, env_info, human_bytes, sweep
from tpcore.bench.decode import GPT2_SMALL  # the decode benchmark's GPT-2-small shapes

# Llama 3.2 1B's shapes (GQA 32/8, SwiGLU, RMSNorm, RoPE, tied head), random weights
LLAMA_1B = dict(vocab_size=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn_hidden=8192, norm="rmsnorm",
                eps=1e-5, activation="swiglu", positions="rope", rope_theta=500000.0, max_positions=2048, bias=False,
                tie_embeddings=True, model_type="llama")
TINY = dict(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=192, norm="rmsnorm",
            activation="swiglu", positions="rope", max_positions=256, bias=False, model_type="llama")
MODELS = {"gpt2-small": GPT2_SMALL, "llama-1b-like": LLAMA_1B, "tiny": TINY}
REGIONS = ("attention", "mlp", "embedding", "head", "other")


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
    prefill_s, ttft_s = clock[0] - t0, clock[1] - t0
    steps = np.diff(clock[1:]).tolist()  # one decode step per new token after the first
    result = {"rank": comm.rank, "n": n, "prefill_s": prefill_s, "ttft_s": ttft_s, "steps_s": steps,
              "decode_s": t_end - clock[1] if len(clock) > 2 else float("nan"),
              "comm_prefill": _delta(s0, snaps[0]), "comm_head0": _delta(snaps[0], snaps[1]),
              "comm_decode": _delta(snaps[1], s_end),
              "param_bytes": model.param_bytes(), "kv_bytes": _kv_bytes(model, B, T + new),
              "memory": memory_and_estimate(model, B, T + new, T),
              "tokens": np.asarray(out)[:, T:].tolist(), "threads": tpcore.get_num_threads(),
              "config": dict(vars(cfg))}
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
                np.asarray(model.generate([p], max_new_tokens=k)[0])[p.size:p.size + len(toks)].tolist() == toks
                for (p, k), toks in check)
            m["checked_against_generate"] = len(check)
            for key in ("ttft_s", "latency_s", "tokens"):  # per-request lists: the percentiles stay
                m.pop(key, None)
            result["serve"][c] = m
    result.update(loaded)
    result["rss_peak_bytes"] = _proc_status("VmHWM")
    prog.done()
    return result


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
           "rss_peak_bytes": [r["rss_peak_bytes"] for r in res], "rss_load_bytes": [r["rss_load_bytes"] for r in res],
           "rss_load_peak_bytes": [r["rss_load_peak_bytes"] for r in res], "tokens": res[0]["tokens"],
           "rss_before_load_bytes": [r.get("rss_before_load_bytes") or 0 for r in res],
           "memory": [r["memory"] for r in res],
           "load_staging_bytes": res[0].get("load_staging_bytes", 0),
           "checkpoint_bytes": res[0].get("checkpoint_bytes", 0),
           "same_tokens_across_ranks": all(r["tokens"] == res[0]["tokens"] for r in res)}
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
    spec = {"config": cfgd, "checkpoint": args.checkpoint, "device": args.device, "new": new, "quick": quick,
            "progress": args.progress}
    backend = "nccl" if args.device == "cuda" else "shm"
    rows = []
    t_all = time.perf_counter()
    for i, n in enumerate(worlds):
        progress.status(f"[report] world {n} ({i + 1}/{len(worlds)})", important=True)
        res = tpcore.spawn(_rank, n, args=(spec, prompts, serve_reqs), backend=backend, deadline=args.timeout)
        rows.append(_world_row(res, B, T, new))
        if cfg is None:
            cfg = tpcore.Config(**{k: v for k, v in res[0]["config"].items()})
    het = None
    if hetero:
        progress.status("[report] mismatched devices (tpcore.bench hetero)", important=True)
        from tpcore.bench import hetero as hetero_bench
        het = hetero_bench.run(quick=quick, progress=args.progress)
    llama = None
    gpath = gguf_path(args.checkpoint) if args.checkpoint else None
    # the same file in llama.cpp, the same cores (tpcore.bench decode's peer); last, in this process:
    # its OpenMP threads would hang forked children that use OpenMP
    if gpath and args.device == "cpu":
        import importlib.util
        if importlib.util.find_spec("llama_cpp") is not None:
            from tpcore.bench.decode import _llamacpp_peer
            progress.status("[report] llama.cpp on the same file", important=True)
            llama = _llamacpp_peer(gpath, prompts, new, limits["cores"])
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
    mlp = C * F * (3 if c["activation"] == "swiglu" else 2)
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
        wb = sum(r["param_bytes"])
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
        out.append(f"serving at TP={r['n']}: concurrency {cs[-1]} gives {hi['throughput_tok_s'] / lo['throughput_tok_s']:.2f}x "
                   f"the throughput of concurrency {cs[0]} ({hi['throughput_tok_s']:.1f} vs "
                   f"{lo['throughput_tok_s']:.1f} tok/s) at {hi['latency_p50_s'] / lo['latency_p50_s']:.2f}x the per-token "
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


def markdown(data: dict, plots: List[str]) -> str:
    rows, lim, env = data["worlds"], data["limits"], data["env"]
    c = data["config"]
    base = rows[0]
    msg = _message_sizes(data)
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
