"""Decode speed of each model family against a Llama of the same size, one run.

    python -m tpcore.bench families                      # every family, worlds 1,2, 3 rounds
    python -m tpcore.bench families --families llama,gemma2,qwen3 --worlds 1,2,4 --json f.json --plot f.png
    python -m tpcore.bench families --quick              # a tiny size (CI smoke test)

Every family is built at one size (hidden, layers, heads, KV heads, FFN, vocabulary: the same
weights' shapes as the Llama row, random weights) with what makes it that family at run time:
Qwen2's QKV biases, Qwen3's and Gemma 3's Q/K norms, Gemma 2's post norms, GeGLU, embedding
scale, attention and final logit soft-caps and alternating sliding windows, Gemma 3's 5:1 local
layers with their own rotary base, Mistral's window, Llama 3's and Phi-3's rotary scaling
tables.  Each (family, world size) decodes --new tokens after a --prompt-token prompt; the
rounds interleave the families so that a busy machine slows them alike, and each cell is the
median over the rounds.  Columns:

  decode tok/s   batch x (new - 1) / time of the decode steps (median of the rounds)
  vs llama       that / the Llama row's at the same world size (the issue's bar: >= 0.90)
  p50 ms         the median per-step latency
  kv MB          this rank's KV cache after the run (a sliding layer's ring holds 2 windows)

The rows name the CPU (/proc/cpuinfo) and the threads per rank.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import numpy as np

SIZES = {"default": dict(vocab_size=8192, hidden=512, layers=4, heads=8, kv_heads=2, ffn_hidden=1536),
         "quick": dict(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128)}
FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3")


def family_config(name: str, size: Dict, window: int):
    """The tpcore Config of family `name` at `size` (rotary, RMSNorm, gated MLP, no biases unless
    the family has them)."""
    from tpcore.nn.config import Config
    base = dict(size, norm="rmsnorm", eps=1e-6, activation="swiglu", positions="rope", max_positions=8192,
                rope_theta=10000.0, bias=False, tie_embeddings=False, model_type="llama")
    L, half = size["layers"], size["hidden"] // size["heads"] // 2
    extra = {
        "llama": {},
        "llama3": dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 1024}),
        "qwen2": dict(qkv_bias=True, tie_embeddings=True),
        "qwen3": dict(qk_norm=True, rope_theta=1000000.0),
        "mistral": dict(sliding_window=window),
        "gemma2": dict(activation="geglu", post_norms=True, norm_unit_offset=True,
                       embed_scale=float(size["hidden"]) ** 0.5, attn_softcap=50.0, final_softcap=30.0,
                       attn_scale=(size["hidden"] // size["heads"]) ** -0.5, sliding_window=window,
                       layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)),
                       tie_embeddings=True),
        "gemma3": dict(activation="geglu", post_norms=True, qk_norm=True, norm_unit_offset=True,
                       embed_scale=float(size["hidden"]) ** 0.5, sliding_window=window, rope_theta=1000000.0,
                       rope_local_theta=10000.0, tie_embeddings=True,
                       layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                         for i in range(L))),
        "phi3": dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [4.0] * half,
                                   "original_max_position_embeddings": 4096}),
    }
    if name not in extra:
        raise ValueError(f"families: unknown family {name!r} (known: {', '.join(FAMILIES)})")
    return Config(**{**base, **extra[name]})


def _rank(comm, names: List[str], size: Dict, window: int, batch: int, prompt: int, new: int, rounds: int):
    import tpcore
    from tpcore.models import TransformerLM
    models = {n: TransformerLM(family_config(n, size, window), comm, seed=0) for n in names}
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, size["vocab_size"], (batch, prompt))
    for m in models.values():  # warm-up: allocations, first touch
        m.generate(prompts[:, :4], max_new_tokens=2)
    times: Dict[str, List[float]] = {n: [] for n in names}
    steps: Dict[str, List[float]] = {n: [] for n in names}
    kv = {}
    for _ in range(rounds):
        for n in names:
            m = models[n]
            marks = []
            m._on_token = lambda step: marks.append(time.perf_counter())
            comm.barrier()
            m.generate(prompts, max_new_tokens=new)
            m._on_token = None
            d = np.diff(marks)  # marks[0]: after the prefill; then one per decode step
            times[n].append(float(d.sum()))
            steps[n].extend(d.tolist())
            kv[n] = m.memory()["kv_cache"]
    return {"times": times, "steps": steps, "kv": kv, "threads": tpcore.get_num_threads()}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--families", default=",".join(FAMILIES), help=f"a comma list of {', '.join(FAMILIES)}")
    p.add_argument("--worlds", default="1,2", help="world sizes (default 1,2)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 64; --quick 8)")
    p.add_argument("--new", type=int, default=None, help="new tokens (default 32; --quick 4)")
    p.add_argument("--window", type=int, default=None, help="the sliding window (default 32; --quick 4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")


def _args_checked(args):
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    bad = [n for n in names if n not in FAMILIES]
    if bad or not names:
        raise SystemExit(f"families: unknown families {bad} (known: {', '.join(FAMILIES)})")
    if "llama" not in names:
        names.insert(0, "llama")  # the reference row
    try:
        worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(f"families: --worlds must be a comma list of positive integers, got {args.worlds!r}") from None
    if not worlds or min(worlds) < 1:
        raise SystemExit(f"families: --worlds must be a comma list of positive integers, got {args.worlds!r}")
    q = args.quick
    prompt, new = args.prompt or (8 if q else 64), args.new or (4 if q else 32)
    window = args.window or (4 if q else 32)
    for name, v in (("--batch", args.batch), ("--prompt", prompt), ("--new", new), ("--window", window),
                    ("--rounds", args.rounds)):
        if v < 1 or (name == "--new" and v < 2):
            raise SystemExit(f"families: {name} must be >= {2 if name == '--new' else 1}, got {v}")
    return names, worlds, prompt, new, window


def run(args) -> int:
    import sys
    import tpcore
    try:
        names, worlds, prompt, new, window = _args_checked(args)
    except SystemExit as e:   # a bad argument: one line, exit status 2 (as argparse's)
        print(e, file=sys.stderr)
        return 2
    size = SIZES["quick" if args.quick else "default"]
    rows = []
    for w in worlds:
        with tpcore.Cluster(w) as cl:
            res = cl.run(_rank, names, size, window, args.batch, prompt, new, args.rounds)
        slow = {n: max(statistics.median(r["times"][n]) for r in res) for n in names}  # the slowest rank
        for n in names:
            tok_s = args.batch * (new - 1) / slow[n] if slow[n] > 0 else float("inf")
            ref = args.batch * (new - 1) / slow["llama"] if slow["llama"] > 0 else float("inf")
            rows.append(dict(family=n, world=w, decode_tok_s=tok_s, vs_llama=tok_s / ref,
                             p50_ms=1e3 * statistics.median(res[0]["steps"][n]), kv_mb=res[0]["kv"][n] / 2 ** 20,
                             threads=res[0]["threads"]))
    print(f"# {_cpu()}; size {size}; batch {args.batch}, prompt {prompt}, new {new}, window {window}, "
          f"{args.rounds} rounds")
    print(f"{'family':>8} {'world':>5} {'decode tok/s':>12} {'vs llama':>8} {'p50 ms':>8} {'kv MB':>7}")
    for r in rows:
        print(f"{r['family']:>8} {r['world']:>5} {r['decode_tok_s']:>12.1f} {r['vs_llama']:>8.2f} "
              f"{r['p50_ms']:>8.2f} {r['kv_mb']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu(), "size": size, "window": window, "rows": rows}, f, indent=1)
    if args.plot:
        _plot(args.plot, rows, names, worlds)
    return 0


def _plot(path, rows, names, worlds):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(worlds)
    for i, w in enumerate(worlds):
        v = [next(r["vs_llama"] for r in rows if r["family"] == n and r["world"] == w) for n in names]
        ax.bar(np.arange(len(names)) + i * width, v, width, label=f"{w} rank(s)")
    ax.axhline(0.9, color="k", linestyle="--", linewidth=0.8)
    ax.set_xticks(np.arange(len(names)) + width * (len(worlds) - 1) / 2, names)
    ax.set_ylabel("decode tok/s vs llama")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
