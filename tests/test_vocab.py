"""Vocab-parallel embedding and cross-entropy against float64 NumPy
references of the full table / full softmax, at world sizes 1-4, with a
vocabulary that does not divide by the world size and uneven partitions;
no rank ever holds the full logits."""
import numpy as np
import pytest

import tpcore
from conftest import WORLDS, rng_for, run

VOCAB, DIM = 1001, 12


def _emb_case(comm, uneven):
    part = tpcore.partition(VOCAB, comm.size, weights=[1 + 2 * (r % 2) for r in range(comm.size)]) if uneven else None
    emb = tpcore.VocabParallelEmbedding(VOCAB, DIM, comm, partition=part, seed=3)
    g = rng_for(5, 0)
    table = g.standard_normal((VOCAB, DIM)).astype(np.float32)
    emb.load_full(table)
    tokens = g.integers(0, VOCAB, (3, 17))
    tokens[0, :3] = [0, VOCAB - 1, 0]  # ends of the vocabulary, and a repeated token
    out = emb(tokens)
    dout = g.standard_normal((3, 17, DIM)).astype(np.float32)
    emb.zero_grad()
    emb.backward(dout)
    ref_dtable = np.zeros((VOCAB, DIM))
    np.add.at(ref_dtable, tokens.reshape(-1), dout.reshape(-1, DIM).astype(np.float64))
    off, loc = emb.offset, emb.local
    ok_out = np.array_equal(out, table[tokens])
    ok_grad = np.allclose(emb.grad_weight, ref_dtable[off:off + loc], rtol=1e-5, atol=1e-5)
    ok_full = np.array_equal(emb.gather_full(), table)
    errs = []
    for call, etype in ((lambda: emb(np.array([VOCAB])), ValueError), (lambda: emb(np.array([0.5])), TypeError)):
        try:
            call()
            errs.append("no error")
        except etype:
            pass
    return ok_out, ok_grad, ok_full, errs


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_vocab_parallel_embedding(world, uneven):
    for r, (a, b, c, errs) in enumerate(run(_emb_case, world, uneven)):
        assert a and b and c and not errs, f"rank {r}: out {a} grad {b} full {c} {errs}"


def _embedding_init(comm):
    return tpcore.VocabParallelEmbedding(VOCAB, DIM, comm, seed=9).gather_full()


def test_embedding_init_same_at_every_world_size():
    ref = run(_embedding_init, 1)[0]
    for world in (2, 3, 4):
        assert all(np.array_equal(t, ref) for t in run(_embedding_init, world))


def _xent_case(comm, uneven, reduction):
    part = tpcore.partition(VOCAB, comm.size, weights=[2 + (r % 3) for r in range(comm.size)]) if uneven \
        else tpcore.partition(VOCAB, comm.size)
    g = rng_for(11, 0)
    logits = (g.standard_normal((2, 9, VOCAB)) * 4).astype(np.float32)
    logits[1] += 1e4  # large logits: only a max-subtracted softmax survives
    targets = g.integers(0, VOCAB, (2, 9))
    off, loc = part[comm.rank]
    shard = np.ascontiguousarray(logits[..., off:off + loc])  # this rank never sees the rest
    xent = tpcore.VocabParallelCrossEntropy(comm)
    loss = xent(shard, targets, reduction=reduction)
    dloss = g.standard_normal((2, 9)).astype(np.float32) if reduction == "none" else 0.7
    dshard = xent.backward(dloss)
    # float64 reference over the full vocabulary
    l64 = logits.astype(np.float64)
    mx = l64.max(-1, keepdims=True)
    lse = np.log(np.exp(l64 - mx).sum(-1)) + mx[..., 0]
    per = lse - np.take_along_axis(l64, targets[..., None], -1)[..., 0]
    ref_loss = per if reduction == "none" else per.mean() if reduction == "mean" else per.sum()
    p = np.exp(l64 - lse[..., None])
    onehot = np.zeros_like(p)
    np.put_along_axis(onehot, targets[..., None], 1.0, -1)
    scale = (np.asarray(dloss)[..., None] if reduction == "none" else
             dloss / per.size if reduction == "mean" else dloss)
    ref_d = ((p - onehot) * scale)[..., off:off + loc]
    return bool(np.allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)), bool(np.allclose(dshard, ref_d, rtol=1e-4, atol=1e-6)), \
        float(tpcore.vocab_parallel_cross_entropy(shard, targets, comm))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(world, uneven, reduction):
    res = run(_xent_case, world, uneven, reduction)
    for r, (ok_loss, ok_grad, mean) in enumerate(res):
        assert ok_loss and ok_grad, f"rank {r}: loss {ok_loss} grad {ok_grad}"
    assert len({m for _, _, m in res}) == 1  # every rank gets the same loss


def _before_forward(comm):
    errs = []
    for call in (lambda: tpcore.VocabParallelCrossEntropy(comm).backward(),
                 lambda: tpcore.ParallelMLP(8, 16, comm).backward(np.ones((2, 8), np.float32)),
                 lambda: tpcore.VocabParallelEmbedding(10, 4, comm).backward(np.ones((2, 4), np.float32))):
        try:
            call()
            errs.append("no error")
        except RuntimeError as e:
            if "before forward" not in str(e):
                errs.append(str(e))
    xent = tpcore.VocabParallelCrossEntropy(comm)
    shard = np.zeros((3, 5), np.float32) + comm.rank
    for bad, etype in ((np.array([0, 1, 5 * comm.size]), ValueError), (np.array([0.5, 1, 2]), TypeError),
                       (np.array([0, 1]), ValueError)):
        try:
            xent(shard, bad)
            errs.append("no error for bad targets")
        except etype:
            pass
    return errs


@pytest.mark.parametrize("world", [1, 2])
def test_backward_before_forward_and_bad_targets(world):
    for r, errs in enumerate(run(_before_forward, world)):
        assert not errs, f"rank {r}: {errs}"
