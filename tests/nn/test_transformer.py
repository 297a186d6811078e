"""The tensor-parallel Transformer block against the float64 NumPy reference in
reference_transformer.py: forward values, and every gradient (input and each
parameter tensor) through directional derivatives of the reference, at world
sizes 1-4 with even and uneven whole-head partitions, GPT-2-, Llama- (RoPE,
RMSNorm, SwiGLU, grouped-query attention) and BERT-style (post-norm,
bidirectional, padding mask) blocks; the KV cache against full recompute."""
import numpy as np
import pytest

import tpcore
import reference_transformer as ref
from conftest import WORLDS, rng_for, run
from test_layers import refused_grads

CONFIGS = {
    "gpt2": dict(hidden=24, heads=6, ffn_hidden=40, norm="layernorm", activation="gelu_tanh", positions="none",
                 causal=True, pre_norm=True, bias=True),
    "llama_gqa": dict(hidden=24, heads=6, kv_heads=2, head_dim=6, ffn_hidden=36, norm="rmsnorm", activation="swiglu",
                      positions="rope", rope_theta=500.0, causal=True, pre_norm=True, bias=False, eps=1e-6),
    "geglu": dict(hidden=24, heads=6, kv_heads=2, head_dim=6, ffn_hidden=35, norm="rmsnorm", activation="geglu",
                  positions="rope", rope_theta=500.0, causal=True, pre_norm=True, bias=True, eps=1e-6),
    "bert": dict(hidden=20, heads=5, ffn_hidden=33, norm="layernorm", activation="gelu", positions="none",
                 causal=False, pre_norm=False, bias=True, eps=1e-12),
}


_params = ref.random_block_params


def _reference(cfg, attention_only):
    if not attention_only:
        return ref.block

    def attn(cfg, p, x, key_mask=None):
        B, T, _ = x.shape
        return ref.attention(cfg, p, x, np.broadcast_to(np.arange(T), (B, T)), key_mask)
    return attn


def _block_case(comm, name, uneven, masked, attention_only=False):
    cfg = tpcore.Config(vocab_size=10, **CONFIGS[name])
    hp = tpcore.nn.config.head_partition(cfg, comm.size, weights=[1 + 2 * (r % 2) for r in range(comm.size)]) \
        if uneven else None
    cls = tpcore.ParallelAttention if attention_only else tpcore.TransformerBlock
    blk = cls(cfg, comm, seed=4, head_partition=hp)
    reference = _reference(cfg, attention_only)
    g = rng_for(31, 0)  # the same full tensors and inputs on every rank
    P = _params(blk, g)
    blk.load_full(P)
    B, T = 2, 6
    x = g.standard_normal((B, T, cfg.hidden)).astype(np.float32)
    R = g.standard_normal((B, T, cfg.hidden))
    mask = None
    if masked:
        mask = np.ones((B, T), np.uint8)
        mask[1, 4:] = 0  # the second sequence is padded
    y = blk(x, key_mask=mask)
    dx = blk.backward(R.astype(np.float32))
    grads = blk.gather_full(grads=True)
    full = blk.gather_full()
    P64 = {k: v.astype(np.float64) for k, v in P.items()}
    x64 = x.astype(np.float64)

    def loss(xx, pp):
        return float((reference(cfg, pp, xx, key_mask=mask) * R).sum())

    y_ref = reference(cfg, P64, x64, key_mask=mask)
    errs = []
    if not np.allclose(y, y_ref, rtol=1e-4, atol=1e-4):
        errs.append(f"y off by {np.abs(y - y_ref).max():.2e}")
    if any(not np.array_equal(full[k], P[k]) for k in P):
        errs.append("gather_full does not give back the loaded tensors")
    errs += ref.directional_errors(loss, x64, P64, dx, grads, P, g)
    return errs, (blk.q0, blk.nq, blk.k0, blk.nk, blk.kv_replicated)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name,uneven,masked", [("gpt2", False, False), ("gpt2", True, True),
                                                ("llama_gqa", False, False), ("llama_gqa", True, False),
                                                ("geglu", True, False), ("bert", False, True), ("bert", True, True)])
def test_block_forward_backward(world, name, uneven, masked):
    res = run(_block_case, world, name, uneven, masked)
    for r, (errs, heads) in enumerate(res):
        assert not errs, f"rank {r} (heads {heads}): {errs}"
    assert sum(h[1] for _, h in res) == CONFIGS[name]["heads"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name,uneven,masked", [("gpt2", True, False), ("llama_gqa", True, False),
                                                ("bert", False, True)])
def test_parallel_attention_alone(world, name, uneven, masked):
    res = run(_block_case, world, name, uneven, masked, True)
    for r, (errs, heads) in enumerate(res):
        assert not errs, f"rank {r} (heads {heads}): {errs}"


def test_twelve_heads_on_five_ranks():
    cfg = tpcore.Config(vocab_size=10, hidden=24, heads=12, ffn_hidden=30, positions="none")
    assert tpcore.nn.config.head_partition(cfg, 5) == [3, 3, 2, 2, 2]

    def case(comm):
        blk = tpcore.TransformerBlock(cfg, comm, seed=1)
        x = rng_for(2, 0).standard_normal((1, 3, 24)).astype(np.float32)
        return blk.nq, blk(x)

    res = run(case, 5)
    assert [n for n, _ in res] == [3, 3, 2, 2, 2]
    assert all(np.array_equal(y, res[0][1]) for _, y in res)


def _init_case(comm, name):
    cfg = tpcore.Config(vocab_size=10, **CONFIGS[name])
    return tpcore.TransformerBlock(cfg, comm, seed=9).gather_full()


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_seeded_block_is_the_same_at_every_world_size(name):
    want = run(_init_case, 1, name)[0]
    for world in (2, 3, 4):
        for got in run(_init_case, world, name):
            assert all(np.array_equal(got[k], want[k]) for k in want), f"world {world}"


def _cache_case(comm, name):
    cfg = tpcore.Config(vocab_size=10, **CONFIGS[name])
    blk = tpcore.TransformerBlock(cfg, comm, seed=5)
    g = rng_for(8, 0)
    B, T = 2, 7
    x = g.standard_normal((B, T, cfg.hidden)).astype(np.float32)
    full = blk(x, need_backward=False)
    blk.cache(B, 10)
    out = np.zeros_like(full)
    out[:, :4] = blk(np.ascontiguousarray(x[:, :4]), use_cache=True, need_backward=False)             # prefill 4 tokens
    for t in range(4, T):                                                      # then one token at a time
        out[:, t:t + 1] = blk(np.ascontiguousarray(x[:, t:t + 1]), pos0=[t, t], use_cache=True, need_backward=False)
    # sequences of their own lengths: sequence 1 continues after 3 tokens (its 4th slot is overwritten)
    x1 = x.copy()
    x1[1, 3] = g.standard_normal(cfg.hidden)
    step = blk(np.stack([x[0:1, 4], x1[1:2, 3]]).reshape(2, 1, -1), pos0=[4, 3], use_cache=True, need_backward=False)
    ref1 = blk(np.ascontiguousarray(x1[1:2, :4]), need_backward=False)[0, 3]
    errs = []
    try:
        blk(np.ascontiguousarray(x[:, :2]), pos0=[9, 0], use_cache=True, need_backward=False)
        errs.append("no error past the cache")
    except ValueError as e:
        if "past the KV cache" not in str(e):
            errs.append(str(e))
    return (float(np.abs(out - full).max()), float(np.abs(step[1, 0] - ref1).max()),
            float(np.abs(step[0, 0] - full[0, 4]).max()), errs)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_kv_cache_decode_equals_full_recompute(world, name):
    for r, (e_full, e_len, e_again, errs) in enumerate(run(_cache_case, world, name)):
        assert e_full < 1e-5 and e_len < 1e-5 and e_again < 1e-5 and not errs, (r, e_full, e_len, e_again, errs)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_kernels(kind):
    """LayerNorm / RMSNorm forward against float64, backward by directional derivatives."""
    from tpcore import _C

    class C:
        norm, eps = kind, 1e-5

    g = rng_for(40, 0)
    x = (g.standard_normal((9, 37)) * 2 + 0.5).astype(np.float32)
    w = (1 + 0.3 * g.standard_normal(37)).astype(np.float32)
    b = (0.2 * g.standard_normal(37)).astype(np.float32) if kind == "layernorm" else None
    y, mu, rs = _C.norm_forward(kind, x, w, b, 1e-5)
    want = ref.norm(C, x.astype(np.float64), w.astype(np.float64), None if b is None else b.astype(np.float64))
    assert np.allclose(y, want, rtol=1e-5, atol=1e-5)
    dy = g.standard_normal(x.shape)
    dw = np.zeros(37, np.float32)
    db = None if b is None else np.zeros(37, np.float32)
    dx = _C.norm_backward(kind, dy.astype(np.float32), x, w, mu, rs, dw, db)

    def loss(xx, ww, bb):
        return float((ref.norm(C, xx, ww, bb) * dy).sum())

    x64, w64, b64 = x.astype(np.float64), w.astype(np.float64), None if b is None else b.astype(np.float64)
    eps = 1e-6
    for got, which in ((dx, 0), (dw, 1), (db, 2)):
        if got is None:
            continue
        args = [x64, w64, b64]
        V = g.standard_normal(args[which].shape)
        plus, minus = list(args), list(args)
        plus[which] = args[which] + eps * V
        minus[which] = args[which] - eps * V
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert abs(float((got * V).sum()) - fd) < 1e-4 * (1 + abs(fd)), (which, float((got * V).sum()), fd)


def _headless_case(comm, partition):
    import warnings
    cfg = tpcore.Config(vocab_size=10, hidden=18, heads=3, layers=4, ffn_hidden=12, positions="none")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tpcore.TransformerBlock(cfg, comm, seed=1, head_partition=partition)
        tpcore.models.TransformerLM(cfg, comm, seed=2, partition=partition)
    return [(type(w.message).__name__, str(w.message)) for w in seen]


@pytest.mark.parametrize("world,partition,idle,counts", [
    (4, None, "rank 3", [1, 1, 1, 0]),       # more ranks than heads
    (4, [2, 0, 1, 0], "ranks 1, 3", [2, 0, 1, 0]),  # a partition with zeros
])
def test_ranks_without_heads_are_warned_once_per_model(world, partition, idle, counts):
    res = run(_headless_case, world, partition)
    assert all(r == [] for r in res[1:]), res  # rank 0 alone speaks for the job
    kinds = [k for k, _ in res[0]]
    assert kinds == ["HeadSplitWarning", "HeadSplitWarning"], res[0]  # the block's, the model's: not one per layer
    block, model = (m for _, m in res[0])
    want = f"3 attention heads split over {world} ranks leave {idle} with no heads"
    assert block.startswith(f"TransformerBlock: {want} (heads per rank: {counts})"), block
    assert model.startswith(f"TransformerLM: {want} in each of its 4 blocks (heads per rank: {counts})"), model
    assert "At most 3 ranks give every rank heads" in model


def test_every_rank_with_heads_is_not_warned():
    assert run(_headless_case, 3, None) == [[], [], []]


def _grad_shape_case(comm, seed):
    g = rng_for(seed, 0)  # the same inputs and gradients on every rank
    B, T = (int(v) for v in g.choice(np.arange(2, 7), 2, replace=False))  # B != T
    errs = []
    for name, cls in (("gpt2", tpcore.TransformerBlock), ("llama_gqa", tpcore.TransformerBlock),
                      ("bert", tpcore.ParallelAttention)):
        cfg = tpcore.Config(vocab_size=10, **CONFIGS[name])
        blk = cls(cfg, comm, seed=seed)
        x = g.standard_normal((B, T, cfg.hidden)).astype(np.float32)
        errs += [f"{name}: {e}" for e in refused_grads(blk, blk(x), x.shape, g)]
        blk(x, need_backward=False)  # nothing kept: refused whatever dy's shape
        try:
            blk.backward(np.zeros(x.shape, np.float32))
            errs.append(f"{name}: a backward after an inference forward: no error")
        except RuntimeError as e:
            if "need_backward" not in str(e):
                errs.append(f"{name}: {e}")
    return errs


@pytest.mark.parametrize("world", [1, 2])
def test_block_backward_refuses_a_gradient_of_another_shape(world):
    """dy of (T, B, hidden) after a forward of (B, T, hidden) (the same rows), or flattened: a
    ValueError naming both shapes on every rank, no gradient accumulated."""
    seed = int(np.random.default_rng().integers(2 ** 31))
    for r, errs in enumerate(run(_grad_shape_case, world, seed)):
        assert not errs, f"rank {r}, seed {seed}: {errs}"
