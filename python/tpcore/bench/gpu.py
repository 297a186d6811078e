"""GPU benchmark: column-parallel linear GEMMs vs torch.matmul, decoding vs Hugging Face generate.

    python -m tpcore.bench gpu                          # the full run (scripts/gpu_check.sh runs it)
    python -m tpcore.bench gpu --quick                  # small GEMMs, tiny models (smoke test)
    python -m tpcore.bench gpu --worlds 1,2 --json gpu.json --plot gpu.png

Needs a CUDA build of tpcore and a GPU (tpcore.cuda_available()); PyTorch for the GEMM peer and
the inputs; transformers for the Hugging Face side (skipped with a note when missing).  Nothing is
downloaded: every model is built from a config with random weights.

GEMM: a ColumnParallelLinear (world 1, no bias, device="cuda") forward on x (M, K) is one GEMM
(M, K) x (K, N); torch.matmul(x, W.t()) on the same shapes, inputs and weights is the peer.
float32 and bfloat16.  A bfloat16 layer (dtype="bfloat16") keeps its weight in bfloat16 and takes and
gives float32 activations (x is rounded to bfloat16 inside, one tensor-core GEMM with float32 compute
and a float32 output): the tpcore side gets x.float(), torch.matmul bfloat16 x and w (bfloat16 out).
Time: torch.cuda.synchronize() around a loop of calls (>= 0.2 s), median of 3 loops, so the
figure holds whatever stream each library uses.  TFLOP/s = 2 M N K / time.  The outputs of both
are compared (relative Frobenius error) and a row whose error is over 1e-2 (bf16) / 1e-3 (fp32)
is marked wrong.

Decode: a GPT-2-small-sized (124M) and a Llama-1B-sized (1.24B: Llama 3.2 1B's shapes) model,
random weights, bfloat16 where tpcore's models take it (else float32, said in the row), batch
--batch, a --prompt token prompt, --new greedy tokens, never stopping at an end token.
  TTFT ms       generate(max_new_tokens=1): prefill + the first token
  decode tok/s  batch x (new - 1) / (time of generate(new) - time of generate(1))
Both sides are measured the same way (median of --repeats), each in a process of its own, so
that "GPU memory" is the process's own (nvidia-smi's per-process figure, CUDA context included).
Hugging Face: AutoModelForCausalLM-style classes (GPT2LMHeadModel, LlamaForCausalLM) built from
configs on the GPU in bfloat16, model.generate(do_sample=False, min_new_tokens=new) with its
default (dynamic) KV cache and attention implementation.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

# name -> (tpcore Config fields, transformers class, transformers config fields)
MODELS = {
    "gpt2-small": (dict(vocab_size=50257, hidden=768, layers=12, heads=12, ffn_hidden=3072, max_positions=1024,
                        activation="gelu_tanh", positions="learned", model_type="gpt2"),
                   ("GPT2LMHeadModel", "GPT2Config"),
                   dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                        activation_function="gelu_new")),
    "llama-1b": (dict(vocab_size=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn_hidden=8192,
                      norm="rmsnorm", eps=1e-5, activation="swiglu", positions="rope", rope_theta=500000.0,
                      max_positions=4096, bias=False, tie_embeddings=True, model_type="llama"),
                 ("LlamaForCausalLM", "LlamaConfig"),
                 dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True)),
}
QUICK_MODELS = {
    "gpt2-small": (dict(vocab_size=512, hidden=64, layers=2, heads=4, ffn_hidden=256, max_positions=256,
                        activation="gelu_tanh", positions="learned", model_type="gpt2"),
                   ("GPT2LMHeadModel", "GPT2Config"),
                   dict(vocab_size=512, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                        activation_function="gelu_new")),
    "llama-1b": (dict(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, norm="rmsnorm",
                      activation="swiglu", positions="rope", max_positions=256, bias=False, model_type="llama"),
                 ("LlamaForCausalLM", "LlamaConfig"),
                 dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)),
}
GEMM_SHAPES = [(8192, 8192, 8192), (4096, 2048, 16384), (16384, 8192, 2048)]  # (M, K, N)
QUICK_SHAPES = [(512, 256, 384)]


def _shapes(text):
    out = []
    for part in text.split(","):
        dims = [int(v) for v in part.lower().split("x")]
        if len(dims) != 3 or min(dims) < 1:
            raise argparse.ArgumentTypeError(f"a GEMM shape is MxKxN, got {part!r}")
        out.append(tuple(dims))
    return out


def _ints(text):
    return [int(v) for v in text.split(",") if v.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", type=_shapes, default=None, help="GEMM shapes MxKxN,... (default: three "
                   "large ones; --quick: one small)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="GEMM dtypes (default float32,bfloat16)")
    p.add_argument("--models", default="gpt2-small,llama-1b", help="decode models (gpt2-small, llama-1b; "
                   "'none' to skip decoding)")
    p.add_argument("--worlds", type=_ints, default=[1], help="tpcore world sizes for decoding (default 1; "
                   "2 runs two ranks, on the one GPU if there is one)")
    p.add_argument("--backend", default="auto", help="backend of world sizes > 1 (default auto)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; --quick 16)")
    p.add_argument("--new", type=int, default=None, help="new tokens (default 64; --quick 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    p.add_argument("--budget", type=float, default=170.0, help="seconds for the whole run; phases that "
                   "would start later are skipped and say so (default 170)")
    p.add_argument("--quick", action="store_true", help="small GEMMs and tiny models (smoke test)")
    p.add_argument("--json", metavar="FILE", help="results as JSON (written after every phase)")
    p.add_argument("--plot", metavar="FILE.png")


# ------------------------------------------------------------------------------------ helpers
def cuda_state():
    """(usable, why not) of tpcore's GPU path, without touching CUDA when it is not there."""
    import tpcore
    avail = getattr(tpcore, "cuda_available", None)
    if avail is None:
        return False, "this build of tpcore has no GPU path (no tpcore.cuda_available)"
    try:
        if avail():
            return True, ""
    except Exception as e:  # noqa: BLE001 - the error is the reason reported
        return False, f"tpcore.cuda_available() raised {type(e).__name__}: {e}"
    return False, f"tpcore.cuda_available() is False ({tpcore.build_info().get('cuda', 'no cuda entry in build_info')})"


def gpu_count() -> int:
    """GPUs nvidia-smi lists (CUDA_VISIBLE_DEVICES honoured), without creating a CUDA context here."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([v for v in vis.split(",") if v.strip() and v.strip() != "-1"])
    if not shutil.which("nvidia-smi"):
        return 0
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    return sum(1 for line in r.stdout.splitlines() if line.startswith("GPU "))


def card_name() -> str:
    if not shutil.which("nvidia-smi"):
        return "no nvidia-smi"
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30)
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "unknown"


def process_gpu_mib(pid=None):
    """This process's GPU memory in MiB as nvidia-smi reports it (context included), or None."""
    if not shutil.which("nvidia-smi"):
        return None
    pid = os.getpid() if pid is None else pid
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30)
    total, seen = 0, False
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            try:
                total += int(parts[1])
                seen = True
            except ValueError:
                pass
    return total if seen else None


def _median(xs):
    return float(statistics.median(xs))


def _decode_rate(batch, new, total, ttft):
    """batch x (new - 1) tokens over generate(new) - generate(1); None when that difference is
    not positive (too few tokens to see past the noise)."""
    d = total - ttft
    return batch * (new - 1) / d if d > 0 else None


class Budget:
    def __init__(self, seconds):
        self.t0, self.seconds = time.monotonic(), seconds

    def left(self):
        return self.seconds - (time.monotonic() - self.t0)


# --------------------------------------------------------------------------------------- GEMM
def _time_loop(fn, sync, min_s=0.2, max_iters=200):
    """Seconds per call: median of 3 loops of n calls, n chosen so a loop lasts >= min_s."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    n = int(min(max_iters, max(3, min_s / one)))
    loops = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        loops.append((time.perf_counter() - t0) / n)
    return _median(loops)


def gemm_rows(comm, shapes, dtypes, budget):
    import torch

    import tpcore
    rows = []
    sync = torch.cuda.synchronize
    for (M, K, N) in shapes:
        for dt in dtypes:
            row = {"M": M, "K": K, "N": N, "dtype": dt, "tpcore_tflops": None, "torch_tflops": None}
            if budget.left() < 20:
                row["note"] = "skipped: time budget"
                rows.append(row)
                continue
            flop = 2.0 * M * N * K
            tdt = getattr(torch, dt)
            g = torch.Generator(device="cuda").manual_seed(M + K + N)
            x = torch.randn(M, K, device="cuda", generator=g).to(tdt)
            w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(tdt)
            y_ref = torch.matmul(x, w.t())
            row["torch_tflops"] = flop / _time_loop(lambda: torch.matmul(x, w.t()), sync) / 1e12
            try:
                lin = tpcore.ColumnParallelLinear(K, N, comm, bias=False, device="cuda", dtype=dt)
            except (TypeError, ValueError) as e:
                row["note"] = f"n/a: the layer does not take dtype={dt} on cuda ({e})"
                rows.append(row)
                continue
            try:
                lin.load_full(w.float().cpu().numpy())
                x = x if dt == "float32" else x.float()  # the layers' activations are float32
                y = lin(x)
                yt = torch.from_dlpack(y)
                err = float(torch.linalg.norm(yt.float() - y_ref.float()) / torch.linalg.norm(y_ref.float()))
                row["rel_err_vs_torch"] = err
                row["ok"] = err < (1e-2 if dt == "bfloat16" else 1e-3)
                row["tpcore_tflops"] = flop / _time_loop(lambda: lin(x), sync) / 1e12
            except Exception as e:  # noqa: BLE001 - one shape's failure is a row, not the end of the run
                row["note"] = f"error: {type(e).__name__}: {e}"
                row["ok"] = False
            lin = y = yt = x = w = y_ref = None  # free both sides' memory before the next shape
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def print_gemm(rows):
    print(f"{'M x K x N':>20} {'dtype':>9} {'tpcore TFLOP/s':>15} {'torch TFLOP/s':>14} {'tpcore/torch':>12} "
          f"{'rel err':>8}")
    for r in rows:
        shp = f"{r['M']}x{r['K']}x{r['N']}"
        tp, tt = r.get("tpcore_tflops"), r.get("torch_tflops")
        ratio = f"{100 * tp / tt:.0f}%" if tp and tt else "n/a"
        err = r.get("rel_err_vs_torch")
        print(f"{shp:>20} {r['dtype']:>9} {('%.1f' % tp) if tp else 'n/a':>15} {('%.1f' % tt) if tt else 'n/a':>14} "
              f"{ratio:>12} {('%.1e' % err) if err is not None else '':>8}"
              + ("  WRONG RESULT" if r.get("ok") is False and err is not None else "")
              + (f"  # {r['note']}" if r.get("note") else ""))


# ------------------------------------------------------------------------------------- decode
def _tpcore_decode(comm, cfg_fields, prompts, new, repeats, device):
    """Run by each rank (tpcore.spawn, start method spawn): build, warm up, time generate."""
    import tpcore
    cfg = tpcore.Config(**cfg_fields)
    model, dtype, errors = None, None, []
    for kw in ({"device": device, "dtype": "bfloat16"}, {"device": device}):
        try:
            t0 = time.perf_counter()
            model = tpcore.models.TransformerLM(cfg, comm, seed=0, **kw)
            build_s = time.perf_counter() - t0
            dtype = kw.get("dtype", "float32")
            break
        except (TypeError, ValueError) as e:
            errors.append(f"{kw}: {e}")
    if model is None:
        return {"skipped": "TransformerLM on cuda: " + "; ".join(errors)}
    mem_built = process_gpu_mib()
    model.generate(prompts[:, :min(8, prompts.shape[1])], max_new_tokens=2, eos_token_id=-1)  # warm-up
    comm.barrier()
    first, full = [], []
    tokens = None
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        model.generate(prompts, max_new_tokens=1, eos_token_id=-1)
        first.append(time.perf_counter() - t0)
        comm.barrier()
        t0 = time.perf_counter()
        tokens = model.generate(prompts, max_new_tokens=new, eos_token_id=-1)
        full.append(time.perf_counter() - t0)
    B = prompts.shape[0]
    ttft, total = _median(first), _median(full)
    try:
        pbytes = int(model.param_bytes())
    except Exception:  # noqa: BLE001 - param_bytes is optional in the report
        pbytes = None
    return {"rank": comm.rank, "world": comm.size, "dtype": dtype, "ttft_ms": ttft * 1e3,
            "decode_tok_s": _decode_rate(B, new, total, ttft), "generate_s": total, "build_s": build_s,
            "gpu_mib_built": mem_built, "gpu_mib": process_gpu_mib(), "param_bytes": pbytes,
            "tokens_shape": [int(v) for v in getattr(tokens, "shape", ())], "device": device}


def _hf_decode(comm, name, quick, prompts, new, repeats):
    """Hugging Face transformers generate on the same shapes (a process of its own)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return {"skipped": f"transformers or torch not installed ({e})"}
    _, (cls_name, cfg_name), fields = (QUICK_MODELS if quick else MODELS)[name]
    config = getattr(transformers, cfg_name)(**fields)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = getattr(transformers, cls_name)(config)
    model = model.to(torch.bfloat16).eval()
    build_s = time.perf_counter() - t0
    ids = torch.from_numpy(prompts).cuda()
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=mask)

    def gen(n, x=ids, m=mask):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **{**kw, "attention_mask": m})
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    k = min(8, ids.shape[1])
    gen(2, ids[:, :k], mask[:, :k])  # warm-up
    first, full = [], []
    out = None
    for _ in range(repeats):
        first.append(gen(1)[0])
        s, out = gen(new)
        full.append(s)
    B = prompts.shape[0]
    ttft, total = _median(first), _median(full)
    return {"dtype": "bfloat16", "ttft_ms": ttft * 1e3, "decode_tok_s": _decode_rate(B, new, total, ttft),
            "generate_s": total, "build_s": build_s, "gpu_mib": process_gpu_mib(),
            "torch_max_allocated_mib": torch.cuda.max_memory_allocated() / 2 ** 20,
            "tokens_shape": list(out.shape), "transformers": transformers.__version__, "torch": torch.__version__}


def _spawned(fn, world, backend, args, deadline):
    import tpcore
    try:
        return tpcore.spawn(fn, world, args=args, backend=backend, start_method="spawn", deadline=deadline)
    except Exception as e:  # noqa: BLE001 - a failed side is a row that says why
        return [{"skipped": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}]


def print_decode(name, res):
    print(f"# {name}")
    print(f"{'':>16} {'dtype':>9} {'TTFT ms':>9} {'decode tok/s':>13} {'GPU MiB/rank':>13}")
    for side, r in res.items():
        if r.get("skipped"):
            print(f"{side:>16}  n/a: {r['skipped']}")
        else:
            rate = "n/a" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
            print(f"{side:>16} {r['dtype']:>9} {r['ttft_ms']:>9.1f} {rate:>13} "
                  f"{'n/a' if r.get('gpu_mib') is None else r['gpu_mib']:>13}")
    t, h = res.get("tpcore") or {}, res.get("hf") or {}
    if t and h and not t.get("skipped") and not h.get("skipped") and t["decode_tok_s"] and h["decode_tok_s"]:
        print(f"# tpcore vs HF generate: decode {t['decode_tok_s'] / h['decode_tok_s']:.2f}x, "
              f"TTFT {h['ttft_ms'] / t['ttft_ms']:.2f}x (> 1: tpcore ahead)")


# ---------------------------------------------------------------------------------------- run
def run(args) -> int:
    import tpcore
    out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "tpcore": tpcore.__version__, "card": card_name()}

    def save():
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(out, f, indent=1)
            os.replace(args.json + ".tmp", args.json)

    ok, why = cuda_state()
    print(f"# tpcore {tpcore.__version__} GPU benchmark; card: {out['card']}; {out['date']}")
    if not ok:
        out["skipped"] = f"no GPU: {why}"
        print(f"# not run: {out['skipped']}")
        save()
        return 0
    budget = Budget(args.budget)
    prompt = args.prompt or (16 if args.quick else 128)
    new = args.new or (8 if args.quick else 64)
    if new < 2 or prompt < 1 or args.batch < 1 or args.repeats < 1:
        raise SystemExit("gpu: --new must be >= 2, --prompt, --batch and --repeats >= 1")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    models = [] if args.models.strip() == "none" else [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"gpu: unknown model {m!r} (known: {', '.join(MODELS)})")
    memory = out["memory"] = []

    # GEMM (this process: torch and a world-1 communicator)
    import importlib.util
    have_torch = importlib.util.find_spec("torch") is not None
    if not have_torch:
        out["gemm"] = {"skipped": "torch is not installed (the peer and the inputs)"}
        print(f"# GEMM: not run: {out['gemm']['skipped']}")
    else:
        print("# GEMM: ColumnParallelLinear forward (world 1, no bias) vs torch.matmul, same shapes and data")
        comm = tpcore.init()
        try:
            rows = gemm_rows(comm, args.shapes or (QUICK_SHAPES if args.quick else GEMM_SHAPES), dtypes, budget)
        finally:
            comm.close()
        out["gemm"] = {"rows": rows}
        print_gemm(rows)
        save()

    # decode: each side in a process of its own
    table = QUICK_MODELS if args.quick else MODELS
    out["decode"] = {}
    prompts_of = {}
    ngpu = gpu_count()
    for name in models:
        cfg_fields = dict(table[name][0])
        cfg_fields["max_positions"] = max(cfg_fields["max_positions"], prompt + new)
        prompts = np.random.default_rng(0).integers(0, cfg_fields["vocab_size"], (args.batch, prompt)).astype(np.int64)
        prompts_of[name] = prompts
        res = out["decode"][name] = {}
        for world in args.worlds:
            side = "tpcore" if world == 1 else f"tpcore_w{world}"
            if budget.left() < 30:
                res[side] = {"skipped": "time budget"}
                continue
            device = "cuda" if world <= max(ngpu, 1) else "cuda:0"
            ranks = _spawned(_tpcore_decode, world, "shm" if world == 1 else args.backend,
                             (cfg_fields, prompts, new, args.repeats, device), budget.left() - 10)
            if any(r.get("skipped") for r in ranks):
                res[side] = next(r for r in ranks if r.get("skipped"))
            else:  # the slowest rank
                rates = [r["decode_tok_s"] for r in ranks]
                res[side] = {**ranks[0], "ttft_ms": max(r["ttft_ms"] for r in ranks),
                             "decode_tok_s": None if None in rates else min(rates),
                             "gpu_mib_per_rank": [r.get("gpu_mib") for r in ranks]}
                memory.append({"what": f"tpcore {name} world {world} ({res[side]['dtype']})",
                               "text": ", ".join(f"rank {r['rank']} "
                                                 f"{'n/a' if r.get('gpu_mib') is None else r['gpu_mib']} MiB"
                                                 for r in ranks)
                               + (f" (params {ranks[0]['param_bytes'] / 2 ** 20:.0f} MiB/rank)"
                                  if ranks[0].get("param_bytes") else "")})
            save()
        if args.no_hf:
            res["hf"] = {"skipped": "--no-hf"}
        elif budget.left() < 30:
            res["hf"] = {"skipped": "time budget"}
        else:
            res["hf"] = _spawned(_hf_decode, 1, "shm", (name, args.quick, prompts, new, args.repeats),
                                 budget.left() - 5)[0]
            if not res["hf"].get("skipped"):
                hf_mib = res["hf"].get("gpu_mib")
                memory.append({"what": f"HF {name} (bfloat16)", "text": f"{'n/a' if hf_mib is None else hf_mib} MiB "
                               f"(torch max allocated {res['hf']['torch_max_allocated_mib']:.0f} MiB)"})
        save()
        print_decode(f"{name}: batch {args.batch}, prompt {prompt}, {new} new tokens (greedy), median of "
                     f"{args.repeats}", res)
    if memory:
        print("# GPU memory per process (nvidia-smi, CUDA context included)")
        for m in memory:
            print(f"#   {m['what']}: {m['text']}")
    save()
    if args.json:
        print(f"# wrote {args.json}")
    if args.plot:
        _plot(args.plot, out)
    bad = [r for r in (out.get("gemm") or {}).get("rows", []) if r.get("ok") is False]
    return 1 if bad else 0


def _plot(path, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# --plot needs matplotlib (pip install 'tpcore[bench]')")
        return
    rows = (out.get("gemm") or {}).get("rows", [])
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['M']}x{r['K']}x{r['N']}\n{r['dtype']}" for r in rows]
    xs = np.arange(len(rows))
    ax[0].bar(xs - 0.2, [r.get("tpcore_tflops") or 0 for r in rows], 0.4, label="tpcore")
    ax[0].bar(xs + 0.2, [r.get("torch_tflops") or 0 for r in rows], 0.4, label="torch.matmul")
    ax[0].set_xticks(xs, labels, fontsize=7)
    ax[0].set_ylabel("TFLOP/s")
    ax[0].legend()
    dec = out.get("decode") or {}
    names = list(dec)
    xs = np.arange(len(names))
    for i, (side, label) in enumerate((("tpcore", "tpcore"), ("hf", "HF generate"))):
        vals = [0 if dec[n].get(side, {}).get("skipped") else dec[n].get(side, {}).get("decode_tok_s") or 0
                for n in names]
        ax[1].bar(xs + (i - 0.5) * 0.4, vals, 0.4, label=label)
    ax[1].set_xticks(xs, names)
    ax[1].set_ylabel("decode tokens/s")
    ax[1].legend()
    fig.suptitle(f"tpcore GPU benchmark, {out.get('card')}, {out.get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"# wrote {path}")


if __name__ == "__main__":
    from tpcore.bench.__main__ import main
    sys.exit(main(["gpu", *sys.argv[1:]]))
