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
    return bool(np.allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)), \
        bool(np.allclose(dshard, ref_d, rtol=1e-4, atol=1e-6)), \
        float(tpcore.vocab_parallel_cross_entropy(shard, targets, comm))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(world, uneven, reduction):
    res = run(_xent_case, world, uneven, reduction)
    for r, (ok_loss, ok_grad, _mean) in enumerate(res):
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


def _xent_ignore_case(comm, ignore_index):
    part = tpcore.partition(VOCAB, comm.size, weights=[1 + r for r in range(comm.size)])
    g = rng_for(21, 0)
    logits = (g.standard_normal((4, 7, VOCAB)) * 3).astype(np.float32)
    targets = g.integers(0, VOCAB, (4, 7))
    targets[0, :3] = ignore_index
    targets[2, 5] = ignore_index
    off, loc = part[comm.rank]
    shard = np.ascontiguousarray(logits[..., off:off + loc])
    xent = tpcore.VocabParallelCrossEntropy(comm, ignore_index=ignore_index)
    loss = xent(shard, targets)
    d = xent.backward(1.3)
    keep = targets != ignore_index
    l64 = logits.astype(np.float64)
    mx = l64.max(-1, keepdims=True)
    lse = np.log(np.exp(l64 - mx).sum(-1)) + mx[..., 0]
    safe_t = np.where(keep, targets, 0)
    per = lse - np.take_along_axis(l64, safe_t[..., None], -1)[..., 0]
    ref = per[keep].mean()
    p = np.exp(l64 - lse[..., None])
    onehot = np.zeros_like(p)
    np.put_along_axis(onehot, safe_t[..., None], 1.0, -1)
    ref_d = ((p - onehot) * keep[..., None] * (1.3 / keep.sum()))[..., off:off + loc]
    per_none = xent(shard, targets, reduction="none")
    return (abs(loss - ref) <= 1e-5 * abs(ref), bool(np.allclose(d, ref_d, rtol=1e-4, atol=1e-7)),
            bool(np.all(per_none[~keep] == 0)), bool(np.allclose(per_none[keep], per[keep], rtol=1e-5)))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("ignore_index", [-100, 7], ids=["default", "a-real-token-id"])
def test_cross_entropy_ignore_index(world, ignore_index):
    """Rows whose target is ignore_index add no loss and no gradient; the mean is
    over the other rows (torch.nn.functional.cross_entropy semantics)."""
    for r, res in enumerate(run(_xent_ignore_case, world, ignore_index)):
        assert all(res), f"rank {r}: loss, grad, none-zero, none-values = {res}"


def _xent_mismatch(comm):
    shard = rng_for(3, comm.rank).standard_normal((4, 6)).astype(np.float32)
    targets = np.array([1, 2, 3, 4 + (comm.rank == comm.size - 1)])  # the last rank disagrees
    try:
        tpcore.vocab_parallel_cross_entropy(shard, targets, comm)
        err = "no error"
    except ValueError as e:
        err = str(e)
    # the communicator is still usable: every rank failed the same way, at the same point
    ok_after = float(comm.all_reduce(np.ones(1, np.float32))[0]) == comm.size
    return err, ok_after


@pytest.mark.parametrize("world", [2, 3])
def test_cross_entropy_targets_differ_across_ranks(world):
    for r, (err, ok_after) in enumerate(run(_xent_mismatch, world)):
        assert "different targets" in err and ok_after, f"rank {r}: {err!r}, usable after: {ok_after}"


def _xent_shape_errors(comm):
    xent = tpcore.VocabParallelCrossEntropy(comm)
    shard = rng_for(4, comm.rank).standard_normal((3, 5)).astype(np.float32)
    out = []
    for args, etype in (((shard.astype(np.float64), [0, 1, 2]), TypeError),
                        ((shard[:, ::2], [0, 1, 2]), ValueError),       # not C-contiguous
                        ((shard, np.zeros((3, 1), np.int64)), ValueError),
                        ((shard, [0, 1, -1]), ValueError)):             # negative, not the ignore_index
        try:
            xent(*args)
            out.append(f"no error for {etype.__name__}")
        except etype as e:
            if not str(e):
                out.append("empty message")
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_cross_entropy_bad_inputs(world):
    for r, errs in enumerate(run(_xent_shape_errors, world)):
        assert not errs, f"rank {r}: {errs}"


def _big_vocab(comm):
    """A 50k vocabulary at the LM-head scale; loss and gradient against float64."""
    V, M = 50_257, 24
    part = tpcore.partition(V, comm.size)
    g = rng_for(8, 0)
    logits = (g.standard_normal((M, V)) * 2).astype(np.float32)
    targets = g.integers(0, V, M)
    off, loc = part[comm.rank]
    xent = tpcore.VocabParallelCrossEntropy(comm)
    loss = xent(np.ascontiguousarray(logits[:, off:off + loc]), targets)
    d = xent.backward()
    l64 = logits.astype(np.float64)
    lse = np.log(np.exp(l64 - l64.max(1, keepdims=True)).sum(1)) + l64.max(1)
    ref = (lse - l64[np.arange(M), targets]).mean()
    onehot = np.zeros((M, loc))
    inside = (targets >= off) & (targets < off + loc)
    onehot[np.arange(M)[inside], (targets - off)[inside]] = 1.0
    ref_d = (np.exp(l64[:, off:off + loc] - lse[:, None]) - onehot) / M
    return abs(loss - ref) <= 2e-6 * abs(ref), float(np.abs(d - ref_d).max())


@pytest.mark.parametrize("world", [1, 3])
def test_cross_entropy_large_vocabulary(world):
    for r, (ok, err) in enumerate(run(_big_vocab, world)):
        assert ok and err < 1e-8, f"rank {r}: loss ok {ok}, max |dlogits error| {err}"


def _odd_init(comm, uneven):
    part = tpcore.partition(101, comm.size, weights=[1 + r for r in range(comm.size)]) if uneven else None
    return tpcore.VocabParallelEmbedding(101, 7, comm, partition=part, seed=4).gather_full()


def test_embedding_init_with_odd_width_and_shards_starting_mid_pair():
    """Elements are drawn in Box-Muller pairs; with 7 columns, shards start at odd elements."""
    ref = run(_odd_init, 1, False)[0]
    assert abs(ref.mean()) < 0.1 and abs(ref.std() - 1) < 0.1  # N(0, 1), like torch.nn.Embedding
    for world in (2, 3):
        for uneven in (False, True):
            assert all(np.array_equal(t, ref) for t in run(_odd_init, world, uneven))


def _bad_layouts(comm):
    g = rng_for(9, comm.rank)
    shard = g.standard_normal((3, 4)).astype(np.float32)
    targets = np.array([0, 5, 4 * comm.size - 1])
    xent = tpcore.VocabParallelCrossEntropy(comm)
    out = []
    cases = (
        ("offset past the vocabulary on one rank", dict(vocab_offset=100 if comm.rank == 0 else 4 * comm.rank)),
        ("offset on some ranks only", dict(vocab_offset=0 if comm.rank == 0 else None)),
        ("overlapping offsets", dict(vocab_offset=0)),
    )
    for what, kw in cases:
        try:
            xent(shard, targets, **kw)
            out.append(f"{what}: no error")
        except ValueError as e:
            if "vocab_offset" not in str(e):
                out.append(f"{what}: {e}")
    other = tpcore.VocabParallelCrossEntropy(comm, ignore_index=-100 if comm.rank else 5)
    try:
        other(shard, targets)
        out.append("different ignore_index: no error")
    except ValueError as e:
        if "ignore_index" not in str(e):
            out.append(str(e))
    good = xent(shard, targets, vocab_offset=4 * comm.rank)  # an explicit, correct layout
    try:
        xent.backward(out=np.zeros((3, 8), np.float32)[:, :4])
        out.append("non-contiguous out accepted")
    except ValueError:
        pass
    usable = float(comm.all_reduce(np.ones(1, np.float32))[0]) == comm.size
    return out, good, usable


@pytest.mark.parametrize("world", [2, 3])
def test_cross_entropy_layout_errors_fail_every_rank_alike(world):
    res = run(_bad_layouts, world)
    for r, (errs, _good, usable) in enumerate(res):
        assert not errs and usable, (r, errs, usable)
    assert len({good for _, good, _ in res}) == 1
