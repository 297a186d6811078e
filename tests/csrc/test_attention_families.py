"""The attention kernel's model-family arguments through _C.attention_forward / backward (the
CPU table): Gemma 2's logit soft-capping, sliding windows (Mistral, Gemma) and a ring KV cache
(a sliding layer's cache of window + chunk rows), against float64 references written here
(softmax with tanh soft-cap and window masks in NumPy; gradients by torch autograd in float64),
on random non-zero inputs and uneven shapes; and every bad new argument refused by name."""
import numpy as np
import pytest

from tpcore import _C

torch = pytest.importorskip("torch")


def visible(B, Tq, Tk, causal, q_pos, k_len, key_mask, window):
    """[B, Tq, Tk] bool: key j visible to query i of sequence b (at position q_pos[b] + i)."""
    p = (np.zeros(B, np.int64) if q_pos is None else q_pos)[:, None, None] + np.arange(Tq)[None, :, None]
    j = np.arange(Tk)[None, None, :]
    n = (np.full(B, Tk, np.int64) if k_len is None else np.minimum(k_len, Tk))[:, None, None]
    vis = j < n
    if key_mask is not None:
        vis = vis & (key_mask[:, None, :] != 0)
    if causal:
        vis = vis & (j <= p)
    if window:
        vis = vis & (j > p - window)
    return vis


def reference(q, k, v, vis, scale, softcap):
    """float64 torch tensors (autograd through q, k, v): o [B, Tq, Hq, D], P [B, Hq, Tq, Tk],
    lse [B, Hq, Tq] (-inf for a row that sees no key)."""
    Hq, Hk = q.shape[2], k.shape[2]
    kk = k.repeat_interleave(Hq // Hk, dim=2)
    vv = v.repeat_interleave(Hq // Hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    m = torch.as_tensor(vis)[:, None, :, :].expand_as(s)
    any_vis = m.any(-1, keepdim=True)
    s = s.masked_fill(~m, -1e300)  # a row with no key: softmax of garbage, then zeroed
    P = torch.softmax(s, -1) * m * any_vis
    lse = torch.where(any_vis[..., 0], torch.logsumexp(s, -1), torch.tensor(-np.inf, dtype=s.dtype))
    return torch.einsum("bhij,bjhd->bihd", P, vv), P, lse


def close(got, ref, tol, what):
    ref = np.asarray(ref, np.float64)
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert np.all(err <= tol * (1 + np.abs(ref))), f"{what}: max error {err.max():.3g}"


def run_case(rng, B, Tq, Tk, Hq, Hk, D, causal, softcap, window, mask=False, q_pos=None, k_len=None):
    q = rng.uniform(-1, 1, (B, Tq, Hq, D)).astype(np.float32)
    k = rng.uniform(-1, 1, (B, Tk, Hk, D)).astype(np.float32)
    v = rng.uniform(-1, 1, (B, Tk, Hk, D)).astype(np.float32)
    key_mask = (rng.uniform(size=(B, Tk)) < 0.85).astype(np.uint8) if mask else None
    vis = visible(B, Tq, Tk, causal, q_pos, k_len, key_mask, window)
    scale = 1 / np.sqrt(D)
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    o_ref, P_ref, lse_ref = reference(tq, tk, tv, vis, scale, softcap)
    kw = dict(causal=causal, q_pos=q_pos, k_len=k_len, key_mask=key_mask, softcap=softcap, window=window)
    o, P = _C.attention_forward(q, k, v, keep="probs", **kw)
    o2, lse = _C.attention_forward(q, k, v, keep="lse", **kw)
    o_ref_np = o_ref.detach().numpy()
    close(o, o_ref_np, 2e-5, "o (probs kept)")
    close(o2, o_ref_np, 2e-5, "o (lse kept)")
    close(P, P_ref.detach().numpy(), 1e-5, "probs")
    lr = lse_ref.detach().numpy()
    assert np.array_equal(np.isneginf(lse), np.isneginf(lr))
    fin = np.isfinite(lr)
    close(lse[fin], lr[fin], 1e-5, "lse")
    dout = rng.uniform(-1, 1, o.shape).astype(np.float32)
    o_ref.backward(torch.tensor(dout, dtype=torch.float64))
    for kept, out in ((P, o), (lse, o2)):  # from the kept probabilities, and from lse (recomputed P)
        dq, dk, dv = _C.attention_backward(q, k, v, out, dout, kept, **kw)
        for got, t, name in ((dq, tq, "dq"), (dk, tk, "dk"), (dv, tv, "dv")):
            close(got, t.grad.numpy(), 1e-4, f"{name} (kept {'probs' if kept.ndim == 4 else 'lse'})")
    return vis


@pytest.mark.parametrize("B,T,Hq,Hk,D,causal,softcap,window,mask", [
    (2, 37, 4, 2, 8, True, 5.0, 6, False),     # a window under T, GQA
    (1, 20, 2, 1, 5, True, 2.0, 50, False),    # a window over T
    (2, 9, 3, 3, 4, True, 0.0, 1, True),       # window 1 (each query its own key), masked keys
    (1, 70, 2, 1, 6, True, 3.0, 10, False),    # two query blocks of the CPU kernel (64 rows)
    (2, 11, 2, 1, 4, False, 4.0, 3, True),     # non-causal: the window cuts only the past
    (2, 13, 4, 1, 3, True, 1.0, 0, False),     # soft-cap alone, a small cap (tanh saturates)
])
def test_softcap_and_window_training(B, T, Hq, Hk, D, causal, softcap, window, mask):
    vis = run_case(np.random.default_rng(T * 7 + D), B, T, T, Hq, Hk, D, causal, softcap, window, mask)
    if window and window < T:
        assert not vis[:, -1, 0].any()  # the masks really cut keys: the test can fail


def test_window_over_a_cache_with_q_pos():
    """Tq != Tk: 3 new queries per sequence at positions q_pos over a cache of 20 rows."""
    q_pos = np.array([0, 8, 17], np.int64)
    run_case(np.random.default_rng(3), 3, 3, 20, 4, 2, 8, True, 2.5, 5, q_pos=q_pos, k_len=q_pos + 3)


def ring_of(cache, k_len, ring):
    """The ring of `ring` rows after writing positions 0 .. k_len[b] - 1 in order (row p % ring)."""
    r = np.random.default_rng(0).uniform(-9, 9, (cache.shape[0], ring) + cache.shape[2:]).astype(np.float32)
    for b in range(cache.shape[0]):
        for p in range(k_len[b]):
            r[b, p % ring] = cache[b, p]
    return r


@pytest.mark.parametrize("Tq,window,ring,softcap", [(3, 7, 9, 3.0), (1, 7, 7, 0.0), (4, 5, 11, 1.5)])
def test_ring_reads_after_wrap_around_equal_a_linear_cache(Tq, window, ring, softcap):
    rng = np.random.default_rng(ring)
    B, L, Hq, Hk, D = 3, 50, 4, 2, 8
    q_pos = np.array([L - Tq, 2, 20], np.int64)  # wrapped many times, not yet, wrapped
    k_len = q_pos + Tq
    q = rng.uniform(-1, 1, (B, Tq, Hq, D)).astype(np.float32)
    k = rng.uniform(-1, 1, (B, L, Hk, D)).astype(np.float32)
    v = rng.uniform(-1, 1, (B, L, Hk, D)).astype(np.float32)
    vis = visible(B, Tq, L, True, q_pos, k_len, None, window)
    t = [torch.tensor(x, dtype=torch.float64) for x in (q, k, v)]
    o_ref, _, lse_ref = reference(*t, vis, 1 / np.sqrt(D), softcap)
    o, lse = _C.attention_forward(q, ring_of(k, k_len, ring), ring_of(v, k_len, ring), causal=True, q_pos=q_pos,
                                  k_len=k_len, softcap=softcap, window=window, kv_ring=ring, keep="lse")
    close(o, o_ref.numpy(), 2e-5, "o from the ring")
    close(lse, lse_ref.numpy(), 1e-5, "lse from the ring")


def test_bad_arguments_are_refused_by_name():
    rng = np.random.default_rng(1)
    q = rng.uniform(-1, 1, (2, 3, 2, 4)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, 6, 1, 4)).astype(np.float32)
    qp, kl = np.array([0, 3], np.int64), np.array([3, 6], np.int64)
    f = _C.attention_forward
    for cap in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"args->softcap = .* must be finite and >= 0"):
            f(q, k, k, softcap=cap)
    with pytest.raises(ValueError, match=r"args->window = -1 must be >= 0"):
        f(q, k, k, window=-1)
    with pytest.raises(ValueError, match=r"args->kv_ring = -2 must be >= 0"):
        f(q, k, k, kv_ring=-2)
    with pytest.raises(ValueError, match=r"kv_ring = 4 needs args->k_len"):
        f(q, k, k, kv_ring=4, window=2)
    with pytest.raises(ValueError, match=r"window \+ Tq - 1 <= kv_ring.*window = 0"):
        f(q, k, k, q_pos=qp, k_len=kl, kv_ring=4)
    with pytest.raises(ValueError, match=r"window \+ Tq - 1 <= kv_ring.*window = 3, Tq = 3"):
        f(q, k, k, q_pos=qp, k_len=kl, kv_ring=4, window=3)
    with pytest.raises(ValueError, match=r"kv_ring = 7 is above the Tk = 6 rows"):
        f(q, k, k, q_pos=qp, k_len=kl, kv_ring=7, window=3)
    with pytest.raises(ValueError, match=r"kv_ring takes neither probs nor key_mask"):
        f(q, k, k, q_pos=qp, k_len=kl, kv_ring=4, window=2, keep="probs")
    o, lse = f(q, k, k, q_pos=qp, k_len=kl, kv_ring=4, window=2, keep="lse")  # 2 + 3 - 1 = 4 rows: fits
    with pytest.raises(ValueError, match=r"kv_ring is for forward over a KV cache only"):
        _C.attention_backward(q, k, k, o, o, lse, q_pos=qp, k_len=kl, kv_ring=4, window=2)
    with pytest.raises(TypeError):
        f(q, k, k, window=1.5)
    with pytest.raises(TypeError):
        f(q, k, k, softcap="big")
    with pytest.raises(TypeError):
        f(q, k, k, 1)  # the options are keywords only
    with pytest.raises(ValueError, match=r"keep must be None, \"probs\" or \"lse\""):
        f(q, k, k, keep="p")
    with pytest.raises(TypeError, match=r"attention_forward: q must be a C-contiguous 4-D float32 array"):
        f(q.astype(np.float64), k, k)
    with pytest.raises(ValueError, match=r"attention_forward: v must have shape \(2, 6, 1, 4\)"):
        f(q, k, k[:, :5].copy())
    with pytest.raises(ValueError, match=r"B and D must agree"):
        f(q, k[:1].copy(), k[:1].copy())
    with pytest.raises(ValueError, match=r"q_pos must be a C-contiguous int64 array of shape \(2,\)"):
        f(q, k, k, q_pos=np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"key_mask must be a C-contiguous uint8 array of shape \(2, 6\)"):
        f(q, k, k, key_mask=np.ones((2, 6), np.int64))
    with pytest.raises(ValueError, match=r"kept must be forward's probs"):
        _C.attention_backward(q, k, k, o, o, lse[:, :1].copy())
