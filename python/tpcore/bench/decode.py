"""Decode benchmark: one model, prompt, context and batch at 1, 2, 4 ranks (and torch).

    python -m tpcore.bench decode                           # GPT-2-small-sized (124M), random weights
    python -m tpcore.bench decode --quick                   # a tiny model (CI smoke test)
    python -m tpcore.bench decode --checkpoint DIR --worlds 1,2 --batch 4 --prompt 128 --new 32
    python -m tpcore.bench decode --dtypes float32,bfloat16  # 16-bit weights against float32, one run
    python -m tpcore.bench decode --dtypes float32,q8_0,q4_k # quantized copies of the same model
    python -m tpcore.bench decode --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf --worlds 1,2   # vs llama.cpp
    python benchmarks/decode.py --json out.json --plot out.png

Every world size runs the same model (the same seed, or --checkpoint) on the
same prompts: a batched prefill of --prompt tokens per sequence into the KV
cache, then --new greedy decode steps.  Columns (per world size; the slowest
rank where ranks differ):

  prefill tok/s   batch x prompt / prefill time
  TTFT ms         time to the first new token (prefill + LM head + argmax)
  decode tok/s    batch x (new - 1) / time of the decode steps
  p50 / p99 ms    per-step decode latency (one token for every sequence)
  comm%           time in tpcore collectives during the decode steps / their time
  KB/tok          bytes through collectives per generated token (per rank)
  params MB       this rank's parameter bytes; RSS MB its peak resident memory
  same            the greedy tokens equal those of the first world size (of that dtype)

--dtypes runs every world size for each weight dtype (float32, bfloat16, float16, or a
quantized format of tpcore.quant: the TransformerLM dtype=, float32 activations; a float
model is quantized with tpcore.models.quantize), interleaved per world size, and prints each
row's decode speed against the first dtype's.  With a GGUF --checkpoint, "native" (the
default) keeps the file's own formats.

Peer with a GGUF --checkpoint (--peers auto): llama.cpp through llama-cpp-python on the
same file, prompt token ids and thread count (one sequence at a time), with its decode
tokens/s and TTFT against each world size, whether its greedy tokens equal tpcore's, and each
rank's weight bytes against the file's size / ranks.

Peer (optional, --peers auto|none) otherwise: the same weights in a PyTorch module
written here (the same architecture: GPT-2 or Llama style, KV cache,
scaled_dot_product_attention), one process with torch.set_num_threads(cores),
as the single-device reference.  Its greedy tokens are checked too.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time

import numpy as np

from tpcore.models.memory import memory_and_estimate
from tpcore.utils.dtypes import WEIGHT_FORMATS

GPT2_SMALL = dict(vocab_size=50257, hidden=768, layers=12, heads=12, ffn_hidden=3072, max_positions=1024,
                  activation="gelu_tanh", positions="learned", model_type="gpt2")
TINY = dict(vocab_size=512, hidden=64, layers=2, heads=4, ffn_hidden=256, max_positions=128,
            activation="gelu_tanh", positions="learned", model_type="gpt2")


def _ints(text):
    return [int(v) for v in text.split(",") if v.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", type=_ints, default=None, help="world sizes (default 1,2,4; --quick: 1,2)")
    p.add_argument("--checkpoint", default=None, help="a Hugging Face or tpcore checkpoint directory")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens per sequence (default 64; --quick 16)")
    p.add_argument("--new", type=int, default=None, help="new tokens per sequence (default 32; --quick 8)")
    p.add_argument("--peers", choices=["auto", "none"], default="auto")
    p.add_argument("--quick", action="store_true", help="a tiny model, worlds 1,2 (smoke test)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--dtypes", default=None, help="weight dtypes, a comma list of float32, bfloat16, float16, int8, "
                                                    "q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, native (a GGUF file's own "
                                                    "formats; default: native for a .gguf, else float32)")


def _rss_peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def gguf_path(checkpoint):
    """The .gguf file a --checkpoint names (a file, or a directory holding exactly one), else None."""
    if not checkpoint:
        return None
    if os.path.isfile(checkpoint) and checkpoint.endswith(".gguf"):
        return checkpoint
    if os.path.isdir(checkpoint):
        found = [f for f in os.listdir(checkpoint) if f.endswith(".gguf")]
        if len(found) == 1 and not os.path.exists(os.path.join(checkpoint, "config.json")):
            return os.path.join(checkpoint, found[0])
    return None


def _model(comm, args, dtype="float32"):
    import tpcore
    if args.checkpoint:
        if gguf_path(args.checkpoint):  # native: the file's own formats
            return tpcore.models.from_pretrained(args.checkpoint, comm, progress=comm.rank == 0,
                                                 dtype="gguf" if dtype == "native" else dtype)
        if tpcore.quant.is_quantized(dtype):  # a float checkpoint, quantized after loading
            m = tpcore.models.from_pretrained(args.checkpoint, comm, progress=comm.rank == 0)
            return tpcore.models.quantize(m, dtype)
        return tpcore.models.from_pretrained(args.checkpoint, comm, progress=comm.rank == 0, dtype=dtype)
    cfg = tpcore.Config(**(TINY if args.quick else GPT2_SMALL))
    if tpcore.quant.is_quantized(dtype):
        return tpcore.models.quantize(tpcore.models.TransformerLM(cfg, comm, seed=0), dtype)
    return tpcore.models.TransformerLM(cfg, comm, seed=0, dtype=dtype)


def _gguf_vocab(path):
    """The vocabulary size of a GGUF file (its metadata, else its token list)."""
    from tpcore.io.gguf import GGUFFile
    fields = GGUFFile(path).fields
    arch = fields["general.architecture"].contents()
    f = fields.get(f"{arch}.vocab_size")
    return int(f.contents()) if f is not None else fields["tokenizer.ggml.tokens"].count


TEXT = ("Tensor parallelism splits each layer of a model across several devices: the attention heads and the "
        "columns of the feed-forward network are divided, every device computes its share, and a collective "
        "operation such as an all-reduce combines the partial results. The question is how fast the split model "
        "runs compared with one device, and how much memory each device needs. ")


def _text_prompts(path, batch, T):
    """batch prompts of T token ids: TEXT through the GGUF file's tokenizer, repeated as needed, each
    sequence starting a few tokens further in."""
    import tpcore.models.gguf
    ids = tpcore.models.gguf.tokenizer(path).encode(TEXT).ids
    ids = ids * (-(-(T + 8 * batch) // len(ids)))
    return np.array([ids[8 * b:8 * b + T] for b in range(batch)], np.int64)


def _llamacpp_peer(path, prompts, new, threads):
    """llama.cpp (llama-cpp-python) on the same file, prompts (token ids) and threads: greedy, one
    sequence at a time (its Python API has no batched decode); times summed over the batch."""
    import llama_cpp
    B, T = prompts.shape
    llm = llama_cpp.Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=T + new + 8, n_batch=max(T, 8),
                          logits_all=True, verbose=False)
    llm.reset()
    llm.eval([int(t) for t in prompts[0, :4]])  # warm-up
    ttft, steps, tokens = 0.0, [0.0] * (new - 1), []
    for b in range(B):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval([int(t) for t in prompts[b]])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        ttft += time.perf_counter() - t0
        out = [tok]
        for i in range(new - 1):
            s = time.perf_counter()
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            steps[i] += time.perf_counter() - s
            out.append(tok)
        tokens.append(out)
    return {"ttft_s": ttft, "steps_s": steps, "decode_s": float(sum(steps)), "tokens": tokens, "threads": threads,
            "llama_cpp": llama_cpp.__version__}


def llamacpp_peer_in_child(path, prompts, new, threads):
    """`_llamacpp_peer` in a spawned child process: (result, None), or (None, why) when llama.cpp
    failed or crashed there (a llama-cpp-python built with -march=native and AMX segfaults on some
    AVX-512 machines at its first evaluation; the benchmark goes on without the peer).  A child
    also keeps llama.cpp's OpenMP threads out of this process, whose forked children use OpenMP."""
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        try:
            return ex.submit(_llamacpp_peer, path, prompts, new, threads).result(), None
        except concurrent.futures.process.BrokenProcessPool:
            return None, ("llama.cpp's process died (a crash: llama-cpp-python built with AMX segfaults on some "
                          "machines; build it with CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX512=ON "
                          "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\")")
        except Exception as e:  # noqa: BLE001 - any failure of the peer is reported, the benchmark goes on
            return None, f"llama.cpp failed: {type(e).__name__}: {e}"


def _llamacpp_row(gpath, prompts, new, cores, want):
    """The llama.cpp peer's row (printed) and its numbers, or None (a line says why)."""
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        print("# llama.cpp peer: skipped (pip install llama-cpp-python)")
        return None
    lpeer, why = llamacpp_peer_in_child(gpath, prompts, new, cores)
    if lpeer is None:
        print(f"# llama.cpp peer: skipped: {why}")
        return None
    B = prompts.shape[0]
    same = lpeer["tokens"] == want
    print(f"{'llama':>5} {'file':>8} {lpeer['threads']:>3} {'':>13} {lpeer['ttft_s'] * 1e3:>8.1f} "
          f"{B * (new - 1) / lpeer['decode_s']:>12.2f} {_pct(lpeer['steps_s'], 50):>7.1f} "
          f"{_pct(lpeer['steps_s'], 99):>7.1f} {'':>6} {'':>7} {'':>9} {'':>7} {'yes' if same else 'NO':>4}")
    lpeer["same_tokens"] = same
    lpeer["decode_tok_s"] = B * (new - 1) / lpeer["decode_s"]
    lpeer["tokens_equal_per_step"] = float(np.mean(np.array(lpeer["tokens"]) == np.array(want)))
    del lpeer["tokens"]
    return lpeer


def _rank(comm, args, prompts, dtype="float32"):
    """Run on every rank by tpcore.spawn."""
    model = _model(comm, args, dtype)
    B, T, new = prompts.shape[0], prompts.shape[1], args.new
    # warm-up (allocations, first-touch) on a short run, then the timed one
    model.generate(prompts[:, :min(T, 4)], max_new_tokens=2)
    comm.barrier()
    model.cache(B, T + new)
    st0 = comm.stats()
    t0 = time.perf_counter()
    h = model.forward(prompts, pos0=np.zeros(B, np.int64), use_cache=True)
    t_prefill = time.perf_counter() - t0
    last = np.ascontiguousarray(h[:, -1])
    logits = model.gather_logits(model.logits_shard(last))
    tok = logits.argmax(-1).astype(np.int64)
    t_first = time.perf_counter() - t0
    st1 = comm.stats()
    out = [tok]
    steps = []
    cur = np.full(B, T, np.int64)
    for _ in range(new - 1):
        s = time.perf_counter()
        h = model.forward(tok.reshape(B, 1), pos0=cur, use_cache=True)
        logits = model.gather_logits(model.logits_shard(np.ascontiguousarray(h[:, 0])))
        tok = logits.argmax(-1).astype(np.int64)
        steps.append(time.perf_counter() - s)
        out.append(tok)
        cur += 1
    st2 = comm.stats()
    decode_s = float(sum(steps))
    return {"rank": comm.rank, "n": comm.size, "prefill_s": t_prefill, "ttft_s": t_first, "steps_s": steps,
            "decode_s": decode_s, "comm_decode_s": st2["seconds"] - st1["seconds"],
            "comm_prefill_s": st1["seconds"] - st0["seconds"], "bytes_decode": st2["bytes"] - st1["bytes"],
            "param_bytes": model.param_bytes(), "rss_peak_mb": _rss_peak_mb(),
            "memory": memory_and_estimate(model, B, T + new, T),  # memory() beside the estimate from the config
            "tokens": np.stack(out, 1).tolist(), "threads": __import__("tpcore").get_num_threads(),
            "config": {k: v for k, v in vars(model.config).items()}}


def _torch_peer(cfg_dict, sd, prompts, new, threads):
    """The same model in PyTorch (one process): GPT-2 or Llama style with a KV cache."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    c = argparse.Namespace(**cfg_dict)
    P = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in sd.items()}
    D, H, Hk = c.head_dim, c.heads, c.kv_heads

    def norm(x, w, b):
        if c.norm == "rmsnorm":
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + c.eps) * w
        return F.layer_norm(x, (x.shape[-1],), w, b, c.eps)

    def act(h):
        if c.activation in ("swiglu", "geglu"):
            g, u = h.chunk(2, -1)
            return (F.silu(g) if c.activation == "swiglu" else F.gelu(g, approximate="tanh")) * u
        return {"gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu,
                "relu": F.relu}[c.activation](h)

    def rope(x, pos):
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        ang = pos[:, None].float() * inv[None]
        cos, sin = ang.cos()[None, None], ang.sin()[None, None]
        a, b = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    B = prompts.shape[0]
    cache = [None] * c.layers

    def lin(x, w, b=None):
        return F.linear(x, w, b)

    def forward(tok, start):
        T = tok.shape[1]
        pos = torch.arange(start, start + T)
        h = P["wte.weight"][tok]
        if c.positions == "learned":
            h = h + P["wpe.weight"][pos]
        for i in range(c.layers):
            p = lambda n: P.get(f"blocks.{i}.{n}")  # noqa: E731 (a one-line local helper)
            u = norm(h, p("norm1.weight"), p("norm1.bias"))
            q = lin(u, p("attn.q.weight"), p("attn.q.bias")).view(B, T, H, D).transpose(1, 2)
            k = lin(u, p("attn.k.weight"), p("attn.k.bias")).view(B, T, Hk, D).transpose(1, 2)
            v = lin(u, p("attn.v.weight"), p("attn.v.bias")).view(B, T, Hk, D).transpose(1, 2)
            if c.positions == "rope":
                q, k = rope(q, pos), rope(k, pos)
            if cache[i] is not None:
                k = torch.cat([cache[i][0], k], 2)
                v = torch.cat([cache[i][1], v], 2)
            cache[i] = (k, v)
            if Hk != H:
                k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
            h = h + lin(o.transpose(1, 2).reshape(B, T, H * D), p("attn.out.weight"), p("attn.out.bias"))
            u = norm(h, p("norm2.weight"), p("norm2.bias"))
            h = h + lin(act(lin(u, p("mlp.fc1.weight"), p("mlp.fc1.bias"))), p("mlp.fc2.weight"), p("mlp.fc2.bias"))
        h = norm(h, P["final_norm.weight"], P.get("final_norm.bias"))
        W = P["wte.weight"] if c.tie_embeddings else P["lm_head.weight"]
        return lin(h[:, -1], W)

    with torch.inference_mode():
        tp = torch.from_numpy(prompts)
        forward(tp[:, :4], 0)  # warm-up
        cache[:] = [None] * c.layers
        t0 = time.perf_counter()
        logits = forward(tp, 0)
        tok = logits.argmax(-1)
        ttft = time.perf_counter() - t0
        out, steps = [tok], []
        start = prompts.shape[1]
        for _ in range(new - 1):
            s = time.perf_counter()
            tok = forward(tok[:, None], start).argmax(-1)
            steps.append(time.perf_counter() - s)
            out.append(tok)
            start += 1
    return {"ttft_s": ttft, "steps_s": steps, "decode_s": float(sum(steps)),
            "tokens": torch.stack(out, 1).tolist(), "threads": threads, "torch": torch.__version__}


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def run(args) -> int:
    import tpcore
    args.worlds = args.worlds or ([1, 2] if args.quick else [1, 2, 4])
    args.prompt = args.prompt or (16 if args.quick else 64)
    args.new = args.new or (8 if args.quick else 32)
    if args.new < 2:
        raise SystemExit("--new must be >= 2")
    cores = os.cpu_count() or 1
    vocab = (TINY if args.quick else GPT2_SMALL)["vocab_size"]
    gpath = gguf_path(args.checkpoint)
    if gpath:
        vocab = _gguf_vocab(gpath)
    elif args.checkpoint:
        vocab = tpcore.Config.from_hf(args.checkpoint).vocab_size if os.path.exists(
            os.path.join(args.checkpoint, "config.json")) else vocab
    prompts = np.random.default_rng(0).integers(0, vocab, (args.batch, args.prompt)).astype(np.int64)
    if gpath:  # real text through the file's tokenizer: random ids give flat, near-tied logits
        prompts = _text_prompts(gpath, args.batch, args.prompt)
    env = {k: os.environ.get(k, "unset") for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    print(f"# tpcore {tpcore.__version__} decode benchmark; {cores} cores; BLAS {tpcore.build_info()['blas']}")
    print(f"# OPENBLAS_CORETYPE={env['OPENBLAS_CORETYPE']} OPENBLAS_L2_SIZE={env['OPENBLAS_L2_SIZE']}")
    model_name = args.checkpoint or ("tiny GPT-2-style (random)" if args.quick else "GPT-2-small-sized, 124M (random)")
    print(f"# model: {model_name}; batch {args.batch}, prompt {args.prompt}, new {args.new} (greedy)")
    if args.dtypes is None:
        args.dtypes = "native" if gpath else "float32"
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    known = WEIGHT_FORMATS + (("native",) if gpath else ())
    bad = [d for d in dtypes if d not in known]
    if bad or not dtypes:
        raise SystemExit(f"--dtypes: expected a comma list of {', '.join(known)}, got {args.dtypes!r}")
    if gpath:
        print(f"# {os.path.basename(gpath)}: {os.path.getsize(gpath) / 1e6:.1f} MB")
    rows = []
    for n in args.worlds:  # the dtypes interleaved per world size: the machine's drift hits both alike
        for dt in dtypes:
            res = tpcore.spawn(_rank, n, args=(args, prompts, dt), deadline=args.timeout)
            rows.append((dt, res))
    rows.sort(key=lambda r: dtypes.index(r[0]))  # stable: world order kept within a dtype
    first = {}
    for dt, res in rows:
        first.setdefault(dt, res[0]["tokens"])
    ref_tokens = rows[0][1][0]["tokens"]
    hdr = (f"{'ranks':>5} {'dtype':>8} {'thr':>3} {'prefill tok/s':>13} {'TTFT ms':>8} {'decode tok/s':>12} "
           f"{'p50 ms':>7} {'p99 ms':>7} {'comm%':>6} {'KB/tok':>7} {'params MB':>9} {'RSS MB':>7} {'same':>4}")
    print(hdr)
    summary = []
    B, T, new = args.batch, args.prompt, args.new
    for dt, res in rows:
        n = res[0]["n"]
        pre = max(r["prefill_s"] for r in res)
        ttft = max(r["ttft_s"] for r in res)
        dec = max(r["decode_s"] for r in res)
        steps = np.max(np.array([r["steps_s"] for r in res]), axis=0).tolist()
        comm_share = max(r["comm_decode_s"] / r["decode_s"] if r["decode_s"] else 0 for r in res)
        kb_tok = max(r["bytes_decode"] for r in res) / (B * (new - 1)) / 1024
        same = all(r["tokens"] == first[dt] for r in res)
        row = {"n": n, "dtype": dt, "threads": res[0]["threads"], "prefill_tok_s": B * T / pre, "ttft_ms": ttft * 1e3,
               "decode_tok_s": B * (new - 1) / dec, "p50_ms": _pct(steps, 50), "p99_ms": _pct(steps, 99),
               "comm_share": comm_share, "kb_per_token": kb_tok,
               "param_mb": max(r["param_bytes"] for r in res) / 1e6, "rss_mb": max(r["rss_peak_mb"] for r in res),
               "same_tokens": same,
               "ranks": [{k: v for k, v in r.items() if k not in ("tokens", "config")} for r in res]}
        summary.append(row)
        print(f"{n:>5} {dt:>8} {row['threads']:>3} {row['prefill_tok_s']:>13.1f} {row['ttft_ms']:>8.1f} "
              f"{row['decode_tok_s']:>12.2f} {row['p50_ms']:>7.1f} {row['p99_ms']:>7.1f} {100 * comm_share:>5.1f}% "
              f"{kb_tok:>7.1f} {row['param_mb']:>9.1f} {row['rss_mb']:>7.0f} {'yes' if same else 'NO':>4}")
    # where each rank's bytes are (memory(), the largest rank), the estimate before loading, the peak RSS
    print(f"\n{'ranks':>5} {'dtype':>8} {'params MB':>9} {'KV MB':>6} {'KV used':>7} {'work MB':>7} {'comm MB':>7} "
          f"{'total MB':>8} {'estimate':>8} {'peak RSS MB':>11}")
    for row in summary:
        mem = max((r["memory"] for r in row["ranks"]), key=lambda m: m["total"])
        row["memory"] = mem
        print(f"{row['n']:>5} {row['dtype']:>8} {mem['params'] / 1e6:>9.1f} {mem['kv_cache'] / 1e6:>6.2f} "
              f"{mem['kv_cache_used'] / 1e6:>7.2f} {mem['workspace'] / 1e6:>7.2f} {mem['comm'] / 1e6:>7.2f} "
              f"{mem['total'] / 1e6:>8.1f} {mem['estimate'] / 1e6:>8.1f} {row['rss_mb']:>11.0f}")
    peer = lpeer = None
    if args.peers == "auto" and gpath:
        lpeer = _llamacpp_row(gpath, prompts, new, cores, first[dtypes[0]])
    if args.peers == "auto" and not gpath:
        import importlib.util
        have_torch = importlib.util.find_spec("torch") is not None
        if not have_torch:
            print("# torch peer: skipped (torch is not installed)")
        if have_torch:
            def full(comm):
                m = _model(comm, args, dtypes[0])
                return m.state_dict_full(), {k: v for k, v in vars(m.config).items()}
            sd, cfgd = tpcore.spawn(full, 1, deadline=args.timeout)[0]
            if cfgd["causal"] and cfgd["pre_norm"]:
                peer = _torch_peer(cfgd, sd, prompts, new, cores)
                same = peer["tokens"] == ref_tokens
                print(f"{'torch':>5} {'float32':>8} {peer['threads']:>3} {'':>13} {peer['ttft_s'] * 1e3:>8.1f} "
                      f"{B * (new - 1) / peer['decode_s']:>12.2f} {_pct(peer['steps_s'], 50):>7.1f} "
                      f"{_pct(peer['steps_s'], 99):>7.1f} {'':>6} {'':>7} {'':>9} {'':>7} {'yes' if same else 'NO':>4}")
                peer["same_tokens"] = same
                peer["decode_tok_s"] = B * (new - 1) / peer["decode_s"]
                del peer["tokens"]
    print("#")
    for row in summary:
        if row["dtype"] != dtypes[0]:
            same_n = [r for r in summary if r["dtype"] == dtypes[0] and r["n"] == row["n"]][0]
            print(f"# {row['dtype']} vs {dtypes[0]} weights at {row['n']} ranks: decode "
                  f"{row['decode_tok_s'] / same_n['decode_tok_s']:.2f}x, "
                  f"TTFT {same_n['ttft_ms'] / row['ttft_ms']:.2f}x, "
                  f"params {row['param_mb'] / same_n['param_mb']:.2f}x")
    base = summary[0]
    for row in summary[1:]:
        if row["dtype"] != base["dtype"]:
            continue
        print(f"# {row['n']} ranks vs {base['n']}: decode {row['decode_tok_s'] / base['decode_tok_s']:.2f}x, "
              f"prefill {row['prefill_tok_s'] / base['prefill_tok_s']:.2f}x, params per rank "
              f"{row['param_mb'] / base['param_mb']:.2f}x")
    if peer:
        for row in summary:
            if row["dtype"] != dtypes[0]:
                continue
            print(f"# {row['n']} ranks vs torch (1 process, {peer['threads']} threads): decode "
                  f"{row['decode_tok_s'] / peer['decode_tok_s']:.2f}x, "
                  f"TTFT {peer['ttft_s'] * 1e3 / row['ttft_ms']:.2f}x")
    if lpeer:
        fsize = os.path.getsize(gpath) / 1e6
        for row in summary:
            print(f"# {row['n']} ranks ({row['dtype']}) vs llama.cpp ({lpeer['threads']} threads, llama-cpp-python "
                  f"{lpeer['llama_cpp']}): decode {row['decode_tok_s'] / lpeer['decode_tok_s']:.2f}x, TTFT "
                  f"{lpeer['ttft_s'] * 1e3 / row['ttft_ms']:.2f}x; weights per rank {row['param_mb']:.1f} MB = "
                  f"{row['param_mb'] / (fsize / row['n']):.3f} x file/{row['n']}")
        print(f"# greedy tokens equal to llama.cpp's: {'yes' if lpeer['same_tokens'] else 'NO'} "
              f"({100 * lpeer['tokens_equal_per_step']:.0f}% of steps; llama.cpp rounds activations to 8 bits)")
    ok = all(r["same_tokens"] for r in summary) and (peer is None or peer["same_tokens"])
    print(f"# greedy tokens identical at every world size{' and in torch' if peer else ''}: {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "model": model_name, "dtypes": dtypes, "batch": B, "prompt": T, "new": new,
                       "rows": summary, "torch": peer, "llama_cpp": lpeer}, f, indent=1)
        print(f"# wrote {args.json}")
    if args.plot:
        _plot(args.plot, summary, peer or lpeer, model_name, "llama.cpp" if lpeer else "torch")
    return 0 if ok else 1


def _plot(path, summary, peer, title, peer_name="torch"):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# --plot needs matplotlib (pip install 'tpcore[bench]')")
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    one = len({r.get("dtype") for r in summary}) == 1
    ns = [str(r["n"]) if one else f"{r['n']} {r['dtype']}" for r in summary]  # bar labels
    ax[0].bar(ns, [r["decode_tok_s"] for r in summary], label="tpcore")
    if peer:
        ax[0].axhline(peer["decode_tok_s"], color="k", ls="--", label=f"{peer_name} (1 process)")
    ax[0].set_xlabel("ranks")
    ax[0].set_ylabel("decode tokens/s")
    ax[0].legend()
    ax[1].bar(ns, [r["p50_ms"] for r in summary], label="p50")
    ax[1].plot(ns, [r["p99_ms"] for r in summary], "ro", label="p99")
    ax[1].set_xlabel("ranks")
    ax[1].set_ylabel("ms per decode step")
    ax[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"# wrote {path}")
