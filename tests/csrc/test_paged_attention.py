"""The attention kernel over a paged KV cache (tp_attention_args.kv_block_table through
_C.attention_forward(..., block_table=)): k and v a pool of blocks, each query sequence's keys
placed by its row of the table, against a float64 NumPy reference written here over the
same keys gathered into a linear cache.  Block sizes 1, 16 and 5 (not dividing the lengths),
shuffled block ids, -1 entries (past a sequence's keys, and holes inside them: keys not
visible), grouped-query heads, windows, soft-capping, decode (Tq = 1) and chunked prefill (Tq >
1 at q_pos > 0); the kept probabilities and lse; bad tables refused by name."""
import numpy as np
import pytest

from tpcore import _C


def _reference(q, pool_k, pool_v, table, q_pos, k_len, bs, window=0, softcap=0.0):
    """o, probs (over Tk = cols x bs key positions) and lse, in float64."""
    B, Tq, Hq, D = q.shape
    Hk = pool_k.shape[2]
    Tk = table.shape[1] * bs
    o = np.zeros((B, Tq, Hq, D))
    probs = np.zeros((B, Hq, Tq, Tk))
    lse = np.full((B, Hq, Tq), -np.inf)
    for b in range(B):
        for i in range(Tq):
            p = q_pos[b] + i
            vis = [j for j in range(min(k_len[b], Tk)) if j <= p and (not window or j > p - window)
                   and table[b, j // bs] >= 0]
            if not vis:
                continue
            rows = [(table[b, j // bs], j % bs) for j in vis]
            K = np.array([pool_k[e, r] for e, r in rows], np.float64)      # (n, Hk, D)
            Vv = np.array([pool_v[e, r] for e, r in rows], np.float64)
            for h in range(Hq):
                g = h // (Hq // Hk)
                s = K[:, g] @ q[b, i, h].astype(np.float64) / np.sqrt(D)
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                m = s.max()
                e = np.exp(s - m)
                o[b, i, h] = e @ Vv[:, g] / e.sum()
                probs[b, h, i, vis] = e / e.sum()
                lse[b, h, i] = m + np.log(e.sum())
    return o, probs, lse


def _case(rng, B, Tq, Hq, Hk, D, bs, q_pos, holes=True):
    """Random q, a pool, and a table of shuffled blocks for keys [0, q_pos + Tq) of each row
    (-1 past them, a hole in some rows, a column of -1 at the end)."""
    k_len = np.asarray(q_pos, np.int64) + Tq
    cols = int(-(-k_len.max() // bs)) + 1
    nb = B * cols + 3
    perm = rng.permutation(nb)
    table = np.full((B, cols), -1, np.int64)
    for b in range(B):
        used = -(-k_len[b] // bs)
        table[b, :used] = perm[b * cols:b * cols + used]
        if holes and b % 2 and used > 2:
            table[b, 1] = -1                                  # a hole: keys not visible
    q = rng.standard_normal((B, Tq, Hq, D)).astype(np.float32)
    pk = rng.standard_normal((nb, bs, Hk, D)).astype(np.float32)
    pv = rng.standard_normal((nb, bs, Hk, D)).astype(np.float32)
    return q, pk, pv, table, np.asarray(q_pos, np.int64), k_len


@pytest.mark.parametrize("bs", [1, 5, 16])
@pytest.mark.parametrize("Tq, q_pos", [(1, [0, 9, 37]), (1, [70, 3, 16]), (6, [0, 11, 29]), (70, [0, 5, 12])])
@pytest.mark.parametrize("fam", [dict(), dict(window=7), dict(softcap=2.5), dict(window=4, softcap=1.5)])
def test_paged_attention_matches_the_float64_reference(bs, Tq, q_pos, fam):
    rng = np.random.default_rng(bs * 1000 + Tq * 10 + len(fam))
    q, pk, pv, table, qp, kl = _case(rng, 3, Tq, 6, 2, 8, bs, q_pos)
    o_ref, p_ref, l_ref = _reference(q, pk, pv, table, qp, kl, bs, **fam)
    o, probs = _C.attention_forward(q, pk, pv, causal=True, q_pos=qp, k_len=kl, block_table=table, keep="probs",
                                    **fam)
    assert np.abs(o - o_ref).max() <= 2e-5 * max(1.0, np.abs(o_ref).max())
    assert np.abs(probs - p_ref).max() <= 1e-5
    o2, lse = _C.attention_forward(q, pk, pv, causal=True, q_pos=qp, k_len=kl, block_table=table, keep="lse", **fam)
    assert np.array_equal(o2, o)
    fin = np.isfinite(l_ref)
    assert np.array_equal(np.isfinite(lse), fin) and np.abs(lse[fin] - l_ref[fin]).max() <= 1e-5
    o3 = _C.attention_forward(q, pk, pv, causal=True, q_pos=qp, k_len=kl, block_table=table, **fam)
    assert np.array_equal(o3, o)


def test_paged_equals_the_linear_cache_and_ignores_unread_blocks():
    """The same keys through a shuffled table and through a linear cache give the same output;
    blocks no query reads (a window's past: -1, or any block) change nothing."""
    rng = np.random.default_rng(7)
    B, Tq, Hq, Hk, D, bs, W = 2, 3, 4, 1, 16, 4, 5
    q_pos = np.array([17, 9], np.int64)
    k_len = q_pos + Tq
    lin_k = rng.standard_normal((B, 24, Hk, D)).astype(np.float32)
    lin_v = rng.standard_normal((B, 24, Hk, D)).astype(np.float32)
    want = _C.attention_forward(q := rng.standard_normal((B, Tq, Hq, D)).astype(np.float32), lin_k, lin_v,
                                causal=True, q_pos=q_pos, k_len=k_len, window=W)
    perm = rng.permutation(12)
    table = perm.reshape(B, 6)
    pk = np.zeros((12, bs, Hk, D), np.float32)
    pv = np.zeros((12, bs, Hk, D), np.float32)
    for b in range(B):
        for c in range(6):
            pk[table[b, c]] = lin_k[b, c * bs:(c + 1) * bs]
            pv[table[b, c]] = lin_v[b, c * bs:(c + 1) * bs]
    got = _C.attention_forward(q, pk, pv, causal=True, q_pos=q_pos, k_len=k_len, window=W, block_table=table)
    assert np.abs(got - want).max() <= 1e-6
    past = table.copy()
    past[0, :3] = -1                      # row 0's queries at 17..19 with window 5 read keys 13.. only
    past[1, 0] = -1                       # row 1's at 9..11: keys 5..
    assert np.array_equal(_C.attention_forward(q, pk, pv, causal=True, q_pos=q_pos, k_len=k_len, window=W,
                                               block_table=past), got)


@pytest.mark.parametrize("kw, err, words", [
    (dict(block_table=np.array([[0, 12]])), ValueError, "kv_block_table[0][1] = 12 is outside the pool's blocks"),
    (dict(block_table=np.array([[0, 1]], np.int32)), ValueError, "block_table must be a C-contiguous int64"),
    (dict(block_table=np.array([[0], [1]])), ValueError, "shape (B = 1, cols >= 1)"),
    (dict(block_table=np.array([0, 1])), ValueError, "shape (B = 1, cols >= 1)"),
    (dict(block_table=np.array([[0, 1]]), kv_ring=4, window=2), ValueError, "excludes kv_ring"),
    (dict(block_table=np.array([[0, 1]]), k_len=None), ValueError, "needs args->k_len"),
])
def test_paged_attention_bad_arguments(kw, err, words):
    q = np.zeros((1, 1, 2, 4), np.float32)
    pool = np.zeros((12, 4, 1, 4), np.float32)
    args = dict(causal=True, q_pos=np.array([3]), k_len=np.array([4]))
    args.update(kw)
    with pytest.raises(err) as e:
        _C.attention_forward(q, pool, pool, **args)
    assert words in str(e.value)
