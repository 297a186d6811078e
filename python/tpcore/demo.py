"""The main job: a tensor-parallel transformer generating on N CPU ranks, and the
collectives under it, checked and timed.

    python -m tpcore.launch -n 2 -m tpcore.demo          (or: python -m tpcore.demo -n 2)
    python -m tpcore.demo -n 4 --checkpoint DIR          (a Hugging Face GPT-2 / Llama / BERT checkpoint)
    python -m tpcore.demo -n 2 --checkpoint FILE.gguf    (a llama.cpp GGUF file, kept in its formats)

Part 1, collectives: every rank fills its buffers with its own random values;
each result is checked against a NumPy reference computed from every rank's
regenerated inputs; rank 0 prints what was done and how fast, for ordinary
(private) arrays and for arrays in registered shared memory.
Part 2, transformer: a GPT-2-style model (random weights from a seed, or
--checkpoint) split over the ranks (heads, MLP columns, vocabulary) generates
greedily for a batch of prompts (random ids; text when the checkpoint carries a
tokenizer, the generated text printed): batched prefill into the KV cache, then
decoding.  Rank 0 first runs the same model alone (a one-rank communicator
split off the job) as the reference: the N-rank tokens must equal it.  Printed:
tokens, time to first token, decode tokens/s at 1 and N ranks, and per rank its
heads, parameter bytes, peak resident memory and time in collectives.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import numpy as np

import tpcore

SIZES = [4 << 10, 1 << 20, 16 << 20]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


def _bus_factor(op, n):
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n if op in ("all_gather", "reduce_scatter") else 1.0


def _inputs(op, nbytes, n, seed):
    count = nbytes // 4
    per = count // n if op in ("all_gather", "reduce_scatter") else count
    if op == "reduce_scatter":
        per *= n
    return [np.random.default_rng([seed, r]).standard_normal(per).astype(np.float32) for r in range(n)]


def _expected(op, ins, rank, n):
    if op == "all_reduce":
        return np.sum([a.astype(np.float64) for a in ins], axis=0)
    if op == "all_gather":
        return np.concatenate(ins).astype(np.float64)
    if op == "reduce_scatter":
        full = np.sum([a.astype(np.float64) for a in ins], axis=0)
        k = full.size // n
        return full[rank * k:(rank + 1) * k]
    return ins[0].astype(np.float64)


def _prepare(op, x, src):
    """In-place ops overwrite x: refill it before each call (not timed)."""
    if op in ("all_reduce", "broadcast"):
        np.copyto(x, src)


def _run_one(comm, op, x, src):
    if op == "all_reduce":
        return comm.all_reduce(x)
    if op == "all_gather":
        return comm.all_gather(src)
    if op == "reduce_scatter":
        return comm.reduce_scatter(src)
    return comm.broadcast(x, root=0)


def demo(comm, iters: int = 20) -> list:
    n, r = comm.size, comm.rank
    rows = []
    for mode in ("private", "registered"):
        for op in OPS:
            for nbytes in SIZES:
                ins = _inputs(op, nbytes, n, seed=zlib.crc32(f"{op}{nbytes}".encode()))
                src = ins[r]
                if mode == "registered":
                    reg = comm.alloc(src.shape, src.dtype)
                    reg[...] = src
                    src = reg
                x = comm.alloc(src.shape, src.dtype) if mode == "registered" else np.empty_like(src)
                _prepare(op, x, src)
                res = _run_one(comm, op, x, src)
                want = _expected(op, ins, r, n)
                wrong = int(np.count_nonzero(~(np.abs(res.astype(np.float64) - want) <= 1e-5 * (1 + np.abs(want)))))
                times = []
                for _ in range(iters):
                    _prepare(op, x, src)
                    comm.barrier()
                    t0 = time.perf_counter()
                    _run_one(comm, op, x, src)
                    times.append(time.perf_counter() - t0)
                t = float(np.median(times))
                tmax = np.array([t])
                comm.all_reduce(tmax, op="max")
                bad = np.array([wrong], dtype=np.int64)
                comm.all_reduce(bad)
                size = nbytes if op != "all_gather" else src.size * 4 * n
                algbw = size / tmax[0] / 1e9
                rows.append((mode, op, size, tmax[0] * 1e6, algbw, algbw * _bus_factor(op, n), int(bad[0])))
    return rows


def _print(rows, n):
    print(f"tpcore {tpcore.__version__} demo: {n} rank(s) on one host, backend shm, float32 sum; "
          f"time is the median of the slowest rank")
    blas = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    if blas:
        print(f"environment: {blas}")
    print(f"{'memory':>10} {'op':>15} {'bytes':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} "
          f"{'#wrong':>7}")
    for mode, op, size, us, alg, bus, bad in rows:
        print(f"{mode:>10} {op:>15} {size:>10} {us:>10.1f} {alg:>11.2f} {bus:>11.2f} {bad:>7}")
    total_bad = sum(r[-1] for r in rows)
    verdict = 'all correct' if total_bad == 0 else f'{total_bad} WRONG elements'
    print(f"{len(rows)} collectives checked against NumPy: {verdict}")
    return total_bad


DEMO_MODEL = dict(vocab_size=8192, hidden=384, layers=6, heads=6, ffn_hidden=1536, max_positions=256,
                  activation="gelu_tanh", positions="learned", model_type="gpt2")


def _generate(model, prompts, new):
    """Greedy generation with timing: (tokens, ttft s, decode s)."""
    B, T = prompts.shape
    model.cache(B, T + new)
    t0 = time.perf_counter()
    h = model.forward(prompts, pos0=np.zeros(B, np.int64), use_cache=True)
    tok = model.gather_logits(model.logits_shard(np.ascontiguousarray(h[:, -1]))).argmax(-1).astype(np.int64)
    ttft = time.perf_counter() - t0
    out, cur = [tok], np.full(B, T, np.int64)
    t1 = time.perf_counter()
    for _ in range(new - 1):
        h = model.forward(tok.reshape(B, 1), pos0=cur, use_cache=True)
        tok = model.gather_logits(model.logits_shard(np.ascontiguousarray(h[:, 0]))).argmax(-1).astype(np.int64)
        out.append(tok)
        cur += 1
    return np.stack(out, 1), ttft, time.perf_counter() - t1


def _config(checkpoint):
    """The checkpoint's Config, read on every rank before any model is loaded: a Hugging Face
    directory (config.json) or one written by save_pretrained (tpcore_config.json)."""
    from tpcore.io import formats as fmt
    from tpcore.nn.config import ACTIVATIONS, NORMS, POSITIONS
    from tpcore.bench.decode import gguf_path
    if gguf_path(checkpoint):  # a llama.cpp GGUF file (its formats kept by from_pretrained)
        from tpcore.models.gguf import read_gguf
        return read_gguf(gguf_path(checkpoint))[0]
    own = os.path.join(checkpoint, fmt.OWN_CONFIG)
    if os.path.exists(own):
        return fmt.read_own_config(own, tpcore.Config, {"norm": NORMS, "activation": ACTIVATIONS,
                                                        "positions": POSITIONS})
    return tpcore.Config.from_hf(checkpoint)


def _encoder_inputs(cfg, batch, prompt, seed):
    """Random token ids (B, T), an attention mask whose last sequence is padded after half its
    length (as a tokenizer pads a ragged batch), and token types (zeros) when the model has them."""
    T = min(prompt, cfg.max_positions)
    g = np.random.default_rng(seed)
    tokens = g.integers(0, cfg.vocab_size, (batch, T)).astype(np.int64)
    mask = np.ones((batch, T), np.int64)
    if batch > 1 and T > 1:
        mask[-1, T // 2:] = 0
        tokens[-1, T // 2:] = 0
    types = np.zeros((batch, T), np.int64) if cfg.type_vocab_size else None
    return tokens, mask, types


def _pool(h, mask):
    """Mean over the unmasked tokens, L2-normalised (sentence-transformers' mean pooling)."""
    m = mask[..., None].astype(np.float64)
    e = (h.astype(np.float64) * m).sum(1) / np.maximum(m.sum(1), 1.0)
    return e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)


def _warm_up(model, tokens, mask, types):
    model.encode(tokens[:, :2], attention_mask=mask[:, :2], token_type_ids=None if types is None else types[:, :2])
    model.comm.barrier()


def _encode(model, tokens, mask, types, reps=3):
    """(hidden states, the fastest of reps encodes in s, their total s)."""
    best, total = float("inf"), 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        h = model.encode(tokens, attention_mask=mask, token_type_ids=types)
        dt = time.perf_counter() - t0
        best, total = min(best, dt), total + dt
    return h, best, total


def encoder_demo(comm, checkpoint, cfg, batch=2, prompt=24, seed=0) -> dict:
    """Part 2 for an encoder (BERT): hidden states and mean-pooled embeddings at N ranks against
    rank 0 alone, and the time of one encode of the batch."""
    n, r = comm.size, comm.rank
    tokens, mask, types = _encoder_inputs(cfg, batch, prompt, seed)
    solo = comm.split(0 if r == 0 else 1, r)
    ref = None
    if r == 0:
        m1 = tpcore.models.from_pretrained(checkpoint, solo, progress=False)
        _warm_up(m1, tokens, mask, types)
        ref = _encode(m1, tokens, mask, types)
        del m1
    solo.close()
    comm.barrier()
    model = tpcore.models.from_pretrained(checkpoint, comm, progress=False)
    _warm_up(model, tokens, mask, types)
    s0 = comm.stats()
    h, secs, total = _encode(model, tokens, mask, types)
    per_rank = _per_rank(comm, model, s0, secs, total)
    diffs = np.zeros(3)
    if r == 0:
        pooled, ref_pooled = _pool(h, mask), _pool(ref[0], mask)
        keep = mask.astype(bool)  # padded positions' states are not compared (nobody uses them)
        diffs[:] = [np.abs(h - ref[0])[keep].max(), np.abs(ref[0][keep]).max(), np.abs(pooled - ref_pooled).max()]
    comm.broadcast(diffs, root=0)
    rep = {"kind": "encoder", "per_rank": per_rank, "n": n, "batch": batch, "prompt": tokens.shape[1],
           "lengths": mask.sum(1).tolist(), "model": checkpoint, "hidden_diff": float(diffs[0]),
           "hidden_scale": float(diffs[1]), "pooled_diff": float(diffs[2]),
           "same": bool(diffs[0] <= 1e-4 * (1 + diffs[1]) and diffs[2] <= 1e-5)}
    if ref is not None:
        rep["ref_s"] = ref[1]
        rep["embedding_head"] = _pool(h, mask)[:, :4]
    return rep


def _per_rank(comm, model, s0, t_a: float, t_b: float) -> np.ndarray:
    """(size, 8) on every rank: each rank's first query head and head count, parameter bytes,
    peak RSS, collective microseconds and calls since the stats s0, and two timings (us)."""
    import resource
    s1 = comm.stats()
    blk = model.blocks[0]
    mine = np.array([blk.q0, blk.nq, model.param_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                     (s1["seconds"] - s0["seconds"]) * 1e6, s1["calls"] - s0["calls"], t_a * 1e6, t_b * 1e6],
                    np.float64)
    return comm.all_gather(mine).reshape(comm.size, -1)


def _load(comm, checkpoint, seed):
    if checkpoint:
        return tpcore.models.from_pretrained(checkpoint, comm, progress=False)
    return tpcore.models.TransformerLM(tpcore.Config(**DEMO_MODEL), comm, seed=seed)


def transformer_demo(comm, checkpoint=None, batch=2, prompt=24, new=16, seed=0) -> dict:
    """Part 2 on every rank; returns rank 0's report (others return theirs too)."""
    n, r = comm.size, comm.rank
    cfg = _config(checkpoint) if checkpoint else None
    if cfg is not None and not cfg.causal:  # an encoder (BERT): no generation, encode and pool
        return encoder_demo(comm, checkpoint, cfg, batch, prompt, seed)
    vocab = cfg.vocab_size if checkpoint else DEMO_MODEL["vocab_size"]
    tok = _tokenizer(checkpoint)
    prompts = _text_prompts(tok, batch) if tok is not None else \
        np.random.default_rng(seed).integers(0, vocab, (batch, prompt)).astype(np.int64)
    prompt = prompts.shape[1]
    # the reference: the same model on rank 0 alone (a one-rank communicator split off the job)
    solo = comm.split(0 if r == 0 else 1, r)
    ref = None
    if r == 0:
        m1 = _load(solo, checkpoint, seed)
        _generate(m1, prompts[:, :4], 2)  # warm-up
        ref = _generate(m1, prompts, new)
        del m1
    solo.close()
    comm.barrier()
    model = _load(comm, checkpoint, seed)
    _generate(model, prompts[:, :4], 2)  # warm-up
    comm.barrier()
    s0 = comm.stats()
    toks, ttft, dec = _generate(model, prompts, new)
    per_rank = _per_rank(comm, model, s0, ttft, dec)
    same = np.array([1 if r != 0 or np.array_equal(toks, ref[0]) else 0], np.int64)
    comm.all_reduce(same, op="min")
    rep = {"tokens": toks, "per_rank": per_rank, "same": bool(same[0]), "n": n, "batch": batch, "prompt": prompt,
           "new": new, "model": checkpoint or "GPT-2-style, %d layers, hidden %d, %d heads, vocab %d (random, seed %d)"
           % (DEMO_MODEL["layers"], DEMO_MODEL["hidden"], DEMO_MODEL["heads"], DEMO_MODEL["vocab_size"], seed)}
    if ref is not None:
        rep["ref_ttft"], rep["ref_decode"] = ref[1], ref[2]
    if tok is not None:     # the text, decoded (special tokens shown)
        rep["texts"] = [(tok.decode(p.tolist(), skip_special_tokens=False),
                         tok.decode(t.tolist(), skip_special_tokens=False)) for p, t in zip(prompts, toks)]
    return rep


DEMO_TEXTS = ("The Roman Empire was one of the largest empires in history, and its capital",
              "Machine learning is a field of computer science that gives computers the ability to")


def _tokenizer(checkpoint):
    """The checkpoint's tokenizer (a GGUF file's, a folder's tokenizer.json), else None."""
    if not checkpoint:
        return None
    from tpcore.bench.decode import gguf_path
    from tpcore.models.text import has_tokenizer, load_tokenizer
    path = gguf_path(checkpoint) or checkpoint
    return load_tokenizer(path) if has_tokenizer(path) else None


def _text_prompts(tok, batch):
    """batch prompts of one length from DEMO_TEXTS (each cut to the shortest one's tokens)."""
    seqs = [tok.encode(DEMO_TEXTS[b % len(DEMO_TEXTS)]) for b in range(batch)]
    T = min(len(q) for q in seqs)
    return np.array([q[:T] for q in seqs], np.int64)


def _print_encoder(rep):
    n, pr = rep["n"], rep["per_rank"]
    secs = pr[:, 6].max() / 1e6
    print()
    print(f"tensor-parallel encoder: {rep['model']}")
    print(f"batch {rep['batch']} x {rep['prompt']} tokens (real lengths {rep['lengths']}, the rest padding, "
          f"masked), random token ids; last hidden states, then mean pooling over the mask and L2 norm")
    for b, e in enumerate(rep["embedding_head"]):
        print(f"  sequence {b}: embedding[:4] = {' '.join(f'{v:+.4f}' for v in e)}")
    print(f"{'ranks':>6} {'encode ms':>10} {'tokens/s':>10}")
    tokens = sum(rep["lengths"])
    for k, t in ((1, rep["ref_s"]), (n, secs)):
        print(f"{k:>6} {t * 1e3:>10.2f} {tokens / t:>10.0f}")
    print(f"{'rank':>6} {'heads':>9} {'params MB':>10} {'peak RSS MB':>12} {'comm ms':>8} {'calls':>6} {'comm%':>6}"
          f"   (per encode)")
    for r in range(n):
        q0, nq, pb, rss, cus, calls, _, total = pr[r]  # comm: over the 3 timed encodes
        print(f"{r:>6} {int(q0):>4}-{int(q0 + nq) - 1:<4} {pb / 1e6:>10.2f} {rss / 1e6:>12.0f} {cus / 3e3:>8.2f} "
              f"{int(calls) // 3:>6} {100 * cus / total:>5.1f}%")
    print(f"hidden states at {n} rank(s) vs the 1-rank run: max abs diff {rep['hidden_diff']:.2e} "
          f"(max |h| {rep['hidden_scale']:.2f}); pooled embeddings: {rep['pooled_diff']:.2e}")
    print(f"encoder outputs at {n} rank(s) equal the 1-rank run: {'yes' if rep['same'] else 'NO'}")
    return 0 if rep["same"] else 1


def _print_transformer(rep):
    if rep.get("kind") == "encoder":
        return _print_encoder(rep)
    n, B, new = rep["n"], rep["batch"], rep["new"]
    pr = rep["per_rank"]
    ttft, dec = pr[:, 6].max() / 1e6, pr[:, 7].max() / 1e6
    print()
    print(f"tensor-parallel transformer: {rep['model']}")
    print(f"batch {B} x prompt {rep['prompt']} tokens, {new} new tokens each, greedy, KV cache")
    for b in range(B):
        if rep.get("texts"):
            print(f"  sequence {b}: {rep['texts'][b][0]!r} -> {rep['texts'][b][1]!r}")
        else:
            print(f"  sequence {b}: ... {' '.join(str(int(t)) for t in rep['tokens'][b])}")
    print(f"{'ranks':>6} {'TTFT ms':>9} {'decode tok/s':>13} {'ms/token':>9}")
    print(f"{1:>6} {rep['ref_ttft'] * 1e3:>9.1f} {B * (new - 1) / rep['ref_decode']:>13.1f} "
          f"{rep['ref_decode'] / (new - 1) * 1e3:>9.2f}")
    print(f"{n:>6} {ttft * 1e3:>9.1f} {B * (new - 1) / dec:>13.1f} {dec / (new - 1) * 1e3:>9.2f}")
    print(f"{'rank':>6} {'heads':>9} {'params MB':>10} {'peak RSS MB':>12} {'comm ms':>8} {'calls':>6} {'comm%':>6}")
    for r in range(n):
        q0, nq, pb, rss, cus, calls, tt, dd = pr[r]
        print(f"{r:>6} {int(q0):>4}-{int(q0 + nq) - 1:<4} {pb / 1e6:>10.2f} {rss / 1e6:>12.0f} {cus / 1e3:>8.1f} "
              f"{int(calls):>6} {100 * cus / (tt + dd):>5.1f}%")
    print(f"greedy tokens at {n} rank(s) equal the 1-rank run: {'yes' if rep['same'] else 'NO'}")
    return 0 if rep["same"] else 1


def _job(comm, iters, checkpoint, skip_collectives):
    rows = [] if skip_collectives else demo(comm, iters)
    rep = transformer_demo(comm, checkpoint)
    return rows, rep


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tpcore.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=None,
                   help="ranks to spawn when not started by the launcher (default 2)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--checkpoint", default=None,
                   help="a local checkpoint directory: Hugging Face GPT-2 or Llama (generates), BERT (encodes), "
                        "or one written by save_pretrained; or a .gguf file (with its tokenizer: text prompts, "
                        "the generated text printed)")
    p.add_argument("--no-collectives", action="store_true", help="skip part 1")
    a = p.parse_args(argv)
    if "TPCORE_JOB_ID" in os.environ or "RANK" in os.environ:
        with tpcore.init() as comm:
            rows, rep = _job(comm, a.iters, a.checkpoint, a.no_collectives)
            bad = 0
            if comm.rank == 0:
                bad = (_print(rows, comm.size) if rows else 0) + _print_transformer(rep)
            print(f"rank {comm.rank}: pid {os.getpid()}, {comm.stats()['calls']} calls, "
                  f"{comm.stats()['seconds'] * 1e3:.1f} ms in communication", file=sys.stderr)
    else:
        n = a.n or 2
        rows, rep = tpcore.spawn(_job, n, args=(a.iters, a.checkpoint, a.no_collectives), deadline=1200)[0]
        bad = (_print(rows, n) if rows else 0) + _print_transformer(rep)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
