"""Tensor-parallel training of an MLP, checked against the same model trained by NumPy.

    python examples/tp_mlp_training.py                       # 2 ranks, 150 steps
    python examples/tp_mlp_training.py -n 4 --hidden 256 --ffn 1030 --steps 500

The model is one transformer MLP, y = fc2(gelu_tanh(fc1(x))), split Megatron-style by
tpcore.ParallelMLP: fc1 column-parallel (each rank holds its share of the ffn columns),
fc2 row-parallel, one all-reduce forward and one backward.  The ffn columns are split
unevenly on purpose (rank r's share grows with r).  It learns a regression task, a fixed
random teacher y = tanh(x A) on fresh Gaussian inputs, with mean squared error and
tpcore.optim.AdamW; every rank sees the same mini-batches (tensor, not data, parallelism).

The loss is printed as it goes down.  At the end the whole model is gathered
(gather_full) and compared with a float64 NumPy implementation of the same MLP, forward,
backward and AdamW, trained in this process from the same initial weights on the same
batches.  Exit status 1 when the losses or the weights differ, or the loss did not fall.
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

import tpcore

C = math.sqrt(2 / math.pi)


def gelu_tanh(h):
    return 0.5 * h * (1 + np.tanh(C * (h + 0.044715 * h ** 3)))


def gelu_tanh_grad(h):
    t = np.tanh(C * (h + 0.044715 * h ** 3))
    return 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * C * (1 + 3 * 0.044715 * h * h)


def initial_weights(hidden, ffn, seed):
    g = np.random.default_rng(seed)
    return {"W1": (g.standard_normal((ffn, hidden)) / math.sqrt(hidden)).astype(np.float32),
            "b1": (g.standard_normal(ffn) * 0.1).astype(np.float32),
            "W2": (g.standard_normal((hidden, ffn)) / math.sqrt(ffn)).astype(np.float32),
            "b2": (g.standard_normal(hidden) * 0.1).astype(np.float32)}


def batches(hidden, steps, batch, seed):
    """The training data: inputs and the teacher's targets, the same on every rank."""
    g = np.random.default_rng([seed, 1])
    A = g.standard_normal((hidden, hidden)) / math.sqrt(hidden)
    for _ in range(steps):
        x = g.standard_normal((batch, hidden))
        yield x.astype(np.float32), np.tanh(x @ A).astype(np.float32)


def train_tp(comm, hidden, ffn, steps, batch, lr, seed):
    """Every rank: the tensor-parallel MLP trained; returns (losses, full weights after training)."""
    weights = [r + 1 for r in range(comm.size)]  # uneven shares of the ffn columns
    mlp = tpcore.ParallelMLP(hidden, ffn, comm, activation="gelu_tanh",
                             partition=tpcore.partition(ffn, comm.size, weights=weights))
    w = initial_weights(hidden, ffn, seed)
    mlp.fc1.load_full(w["W1"], w["b1"])  # each rank keeps its slice
    mlp.fc2.load_full(w["W2"], w["b2"])
    opt = tpcore.optim.AdamW(mlp, lr=lr, weight_decay=0.01)
    losses = []
    for x, t in batches(hidden, steps, batch, seed):
        y = mlp.forward(x)                     # (batch, hidden), the same on every rank
        losses.append(float(np.mean((y.astype(np.float64) - t) ** 2)))
        mlp.zero_grad()
        mlp.backward((2.0 / y.size) * (y - t))  # d mean((y - t)^2) / dy
        opt.step()
    W1, b1 = mlp.fc1.gather_full()
    W2, b2 = mlp.fc2.gather_full()
    return losses, {"W1": W1, "b1": b1, "W2": W2, "b2": b2}, [s for _, s in tpcore.partition(
        ffn, comm.size, weights=weights)]


def train_numpy(hidden, ffn, steps, batch, lr, seed, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8):
    """The reference: the same MLP, its gradients and AdamW in float64 NumPy, one process."""
    p = {k: v.astype(np.float64) for k, v in initial_weights(hidden, ffn, seed).items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(v) for k, v in p.items()}
    losses = []
    for step, (x, t) in enumerate(batches(hidden, steps, batch, seed), 1):
        x, t = x.astype(np.float64), t.astype(np.float64)
        h = x @ p["W1"].T + p["b1"]
        a = gelu_tanh(h)
        y = a @ p["W2"].T + p["b2"]
        losses.append(float(np.mean((y - t) ** 2)))
        dy = 2.0 * (y - t) / y.size
        dh = (dy @ p["W2"]) * gelu_tanh_grad(h)
        grads = {"W2": dy.T @ a, "b2": dy.sum(0), "W1": dh.T @ x, "b1": dh.sum(0)}
        for k, g in grads.items():  # AdamW (decoupled weight decay, bias-corrected moments)
            m[k] = betas[0] * m[k] + (1 - betas[0]) * g
            v[k] = betas[1] * v[k] + (1 - betas[1]) * g * g
            mhat, vhat = m[k] / (1 - betas[0] ** step), v[k] / (1 - betas[1] ** step)
            p[k] = p[k] * (1 - lr * weight_decay) - lr * mhat / (np.sqrt(vhat) + eps)
    return losses, p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=2, help="tensor-parallel ranks (default 2)")
    ap.add_argument("--hidden", type=int, default=24, help="model width (default 24)")
    ap.add_argument("--ffn", type=int, default=70, help="MLP width, split over the ranks (default 70)")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps (default 150)")
    ap.add_argument("--batch", type=int, default=32, help="examples per step (default 32)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.ffn < a.n:
        ap.error("--ffn must be at least -n (every rank holds a column)")
    args = (a.hidden, a.ffn, a.steps, a.batch, a.lr, a.seed)
    res = tpcore.spawn(train_tp, a.n, args=args, deadline=1200)
    losses, w, shares = res[0]
    print(f"ParallelMLP {a.hidden} -> {a.ffn} -> {a.hidden} on {a.n} ranks, ffn columns per rank {shares}; "
          f"AdamW lr {a.lr}, batch {a.batch}")
    every = max(1, a.steps // 10)
    for i in list(range(0, a.steps, every)) + [a.steps - 1]:
        print(f"  step {i:>5}  loss {losses[i]:.5f}")
    ref_losses, ref = train_numpy(*args)
    loss_diff = float(np.max(np.abs(np.array(losses) - ref_losses) / np.array(ref_losses)))
    w_diff = max(float(np.abs(w[k] - ref[k]).max() / np.abs(ref[k]).max()) for k in ref)
    same_ranks = all(all(np.array_equal(r[1][k], w[k]) for k in w) and r[0] == losses for r in res)
    fell = losses[-1] < 0.5 * losses[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({'fell' if fell else 'DID NOT FALL'} by more than half)")
    print(f"against float64 NumPy trained in one process: losses max rel diff {loss_diff:.2e}, "
          f"weights max diff {w_diff:.2e} (relative to each tensor's largest value)")
    ok = fell and same_ranks and loss_diff < 1e-3 and w_diff < 1e-3
    print("check passed" if ok else "CHECK FAILED" + ("" if same_ranks else ": the ranks disagree"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
