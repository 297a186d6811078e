"""Pipeline + tensor parallel training of a small language model, matched against one rank.

    python examples/pipeline_tp_training.py                     # 2 stages x 2-way TP = 4 ranks
    python examples/pipeline_tp_training.py --pp 3 --tp 1 --layers 6 --steps 100 --schedule gpipe

tpcore.ProcessGrid(comm, tp=2, pp=2) cuts the world into tensor-parallel groups (ranks
that split every layer: heads, MLP columns, vocabulary) and pipeline groups (ranks that
hold consecutive blocks).  tpcore.PipelineLM gives stage s its share of the blocks (the
first stage also the embeddings, the last the final norm and LM head), each stage split
over its TP group.  train_step cuts every batch into micro-batches and runs them through
the stages under the 1F1B schedule (or GPipe), activations forward and their gradients
backward by send/recv; AdamW updates each rank's shard.

The task: each sequence counts up by a step of its own (x_{t+1} = x_t + k mod vocab, k
from a small set), so the next token is learnable from the context and the loss falls.
The same model (same seed) is trained in one process on the same batches with
TransformerLM.loss/backward and the same optimizer; the losses must agree step by step
and every parameter at the end (exit status 1 if not, or if the loss did not fall).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import tpcore


def config(a) -> tpcore.Config:
    """A small Llama-style model (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head)."""
    return tpcore.Config(vocab_size=a.vocab, hidden=a.hidden, layers=a.layers, heads=4, kv_heads=2,
                         ffn_hidden=2 * a.hidden + 8, norm="rmsnorm", activation="swiglu", positions="rope",
                         bias=False, max_positions=64, tie_embeddings=False, model_type="llama")


def batches(a):
    """(tokens, targets) of each step, the same on every rank: counting sequences."""
    g = np.random.default_rng(a.seed)
    for _ in range(a.steps):
        start = g.integers(0, a.vocab, (a.batch, 1))
        step = g.choice([1, 2, 3], (a.batch, 1))
        seq = (start + step * np.arange(a.seq + 1)) % a.vocab
        yield seq[:, :-1], seq[:, 1:]


def one_process(comm, a):
    """The reference: the whole model on one rank, the whole batch per step."""
    model = tpcore.models.TransformerLM(config(a), comm, seed=a.seed)
    opt = tpcore.optim.AdamW(model, lr=a.lr, weight_decay=0.0)
    losses = []
    for tokens, targets in batches(a):
        losses.append(model.loss(tokens, targets))
        model.backward()
        opt.step()
        model.zero_grad()
    return losses, {k: np.array(v) for k, v in model.state_dict_full().items()}


def pipeline(comm, a):
    grid = tpcore.ProcessGrid(comm, tp=a.tp, pp=a.pp)
    model = tpcore.PipelineLM(config(a), grid, seed=a.seed)
    opt = tpcore.optim.AdamW(model, lr=a.lr, weight_decay=0.0)
    losses = []
    t0 = time.perf_counter()
    for i, (tokens, targets) in enumerate(batches(a)):
        loss = model.train_step(tokens, targets, micro_batches=a.micro, schedule=a.schedule)
        opt.step()
        model.zero_grad()
        losses.append(loss)
        if comm.rank == 0 and (i % max(1, a.steps // 8) == 0 or i == a.steps - 1):
            print(f"step {i:>4}  loss {loss:.4f}", flush=True)
    secs = time.perf_counter() - t0
    sd = {k: np.array(v) for k, v in model.state_dict_full().items()}  # this stage's tensors, full
    info = dict(stage=grid.pp_rank, tp_rank=grid.tp_rank, blocks=model.stage_bounds[grid.pp_rank],
                params_mb=model.param_bytes() / 1e6, wait_s=model.last_stats.get("wait_s", 0.0), secs=secs)
    model.close()
    grid.close()
    return losses, sd, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per stage (default 2)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50)
    ap.add_argument("--seq", type=int, default=12, help="tokens per sequence (default 12)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step (default 4)")
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not 1 <= a.micro <= a.batch:
        ap.error("--micro must be in [1, --batch]")
    n = a.tp * a.pp
    print(f"{a.pp} pipeline stages x {a.tp}-way tensor parallel = {n} ranks; {a.layers} blocks, hidden {a.hidden}, "
          f"vocab {a.vocab}; batch {a.batch} x {a.seq} tokens in {a.micro} micro-batches ({a.schedule})")
    res = tpcore.spawn(pipeline, n, args=(a,), deadline=1200)
    ref_losses, ref_sd = tpcore.spawn(one_process, 1, args=(a,), deadline=1200)[0]
    for _, _, info in res:
        lo, hi = info["blocks"]
        print(f"  stage {info['stage']} tp rank {info['tp_rank']}: blocks {lo}..{hi - 1}, "
              f"{info['params_mb']:.3f} MB of parameters, {info['secs']:.2f} s "
              f"({info['wait_s'] * 1e3:.1f} ms waiting in send/recv in the last step)")
    losses = res[0][0]
    loss_diff = float(np.max(np.abs(np.array(losses) - ref_losses)))
    held, w_diff = set(), 0.0
    for _, sd, _ in res:
        for k, v in sd.items():
            w_diff = max(w_diff, float(np.abs(v - ref_sd[k]).max()))
            held.add(k)
    same_everywhere = all(r[0] == losses for r in res)
    fell = losses[-1] < 0.5 * losses[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({'fell' if fell else 'DID NOT FALL'} by more than half)")
    print(f"against one process: losses max abs diff {loss_diff:.2e}, parameters max abs diff {w_diff:.2e}, "
          f"{len(held)} of {len(ref_sd)} tensors held by the stages")
    ok = fell and same_everywhere and held == set(ref_sd) and loss_diff < 1e-4 and w_diff < 1e-3
    print("check passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
