"""Activations, ParallelMLP and the optimizers against float64 NumPy
references written here; the MLP at world sizes 1-4 with even and uneven
(ffn) partitions does exactly one all-reduce in forward and one in backward;
training a 2-layer MLP with AdamW gives the same loss curve at every world size."""

import numpy as np
import pytest

import tpcore
from tpcore import _C
import reference_transformer
from conftest import WORLDS, rng_for, run

def ref_act(name, h):
    """The float64 activations of reference_transformer (written for the tests)."""
    return reference_transformer.act(name, np.asarray(h, np.float64))


def ref_act_grad(name, h, d):
    """Central differences of the float64 reference (an independent derivative)."""
    eps = 1e-6
    h = h.astype(np.float64)
    if name != "swiglu":
        return (ref_act(name, h + eps) - ref_act(name, h - eps)) / (2 * eps) * d
    # output j depends only on gate j and up j: perturb all gates (then all ups) at once
    F = h.shape[-1] // 2
    out = np.empty_like(h)
    for half in (slice(0, F), slice(F, 2 * F)):
        hp, hm = h.copy(), h.copy()
        hp[..., half] += eps
        hm[..., half] -= eps
        out[..., half] = (ref_act(name, hp) - ref_act(name, hm)) / (2 * eps) * d
    return out


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "relu", "swiglu"])
def test_activation_kernels(name):
    g = rng_for(1, 0)
    h = (g.standard_normal((7, 10)) * 3).astype(np.float32)
    h[h == 0] = 0.5
    h[np.abs(h) < 1e-3] = 0.5  # keep relu's kink away from the finite differences
    F = 5 if name == "swiglu" else 10
    d = g.standard_normal((7, F)).astype(np.float32)
    y = _C.act_forward(name, h)
    assert np.allclose(y, ref_act(name, h), rtol=1e-5, atol=1e-6)
    dh = _C.act_backward(name, h, d)
    assert np.allclose(dh, ref_act_grad(name, h, d), rtol=1e-4, atol=1e-4)


def _mlp_case(comm, act, uneven, seed):
    H, F, R = 24, 38, 9
    part = tpcore.partition(F, comm.size, weights=[1 + (r % 3) for r in range(comm.size)]) if uneven else None
    mlp = tpcore.ParallelMLP(H, F, comm, activation=act, partition=part, seed=seed)
    g = rng_for(seed, 0)
    gated = act == "swiglu"
    W1 = (g.standard_normal(((2 if gated else 1) * F, H)) / 4).astype(np.float32)
    b1 = g.standard_normal((2 if gated else 1) * F).astype(np.float32)
    W2 = (g.standard_normal((H, F)) / 4).astype(np.float32)
    b2 = g.standard_normal(H).astype(np.float32)
    mlp.fc1.load_full(W1, b1)
    mlp.fc2.load_full(W2, b2)
    x = g.standard_normal((R, H)).astype(np.float32)
    dy = g.standard_normal((R, H)).astype(np.float32)
    mlp(x)  # the first step also allocates the layers' registered buffers (a collective each)
    mlp.backward(dy)
    calls0 = comm.stats()["calls"]
    y = mlp(x)
    calls1 = comm.stats()["calls"]
    mlp.zero_grad()
    dx = mlp.backward(dy)
    calls2 = comm.stats()["calls"]
    # float64 reference
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    h = x64 @ W1.T.astype(np.float64) + b1
    a = ref_act(act, h)
    ry = a @ W2.T.astype(np.float64) + b2
    da = dy64 @ W2.astype(np.float64)
    dh = ref_act_grad(act, h, da)
    rdx = dh @ W1.astype(np.float64)
    rW1, rb1 = dh.T @ x64, dh.sum(0)
    rW2, rb2 = dy64.T @ a, dy64.sum(0)
    gW1, gb1 = _grads_full(mlp.fc1)
    gW2 = comm.all_gather(np.ascontiguousarray(mlp.fc2.grad_weight), axis=1, sizes=[s for _, s in mlp.fc2.partition])
    bad = []
    for name, got, want, tol in (("y", y, ry, 1e-4), ("dx", dx, rdx, 1e-3), ("dW1", gW1, rW1, 1e-3),
                                 ("db1", gb1, rb1, 1e-3), ("dW2", gW2, rW2, 1e-3),
                                 ("db2", mlp.fc2.grad_bias, rb2, 1e-4)):
        if np.shape(got) != np.shape(want) or not np.all(np.abs(got - want) <= tol * (1 + np.abs(want))):
            bad.append((name, float(np.max(np.abs(np.asarray(got, np.float64) - want)))))
    n_comm = (calls1 - calls0, calls2 - calls1)
    return bad, n_comm


def _grads_full(col):
    """The full gradient of a column layer, from the shards (gated: [gate; up] order)."""
    saved = (col.weight.copy(), None if col.bias is None else col.bias.copy())
    col.weight[...] = col.grad_weight
    if col.bias is not None:
        col.bias[...] = col.grad_bias
    W, b = col.gather_full()
    col.weight[...] = saved[0]
    if col.bias is not None:
        col.bias[...] = saved[1]
    return W, b


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "relu", "swiglu"])
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_parallel_mlp(world, act, uneven):
    for r, (bad, n_comm) in enumerate(run(_mlp_case, world, act, uneven, 200 + world)):
        assert not bad, f"rank {r}: {bad}"
        assert n_comm == ((1, 1) if world > 1 else (0, 0)), f"collectives per forward/backward: {n_comm}"


def test_optimizer_steps_match_formulas():
    g = rng_for(3, 0)
    p0 = g.standard_normal(50).astype(np.float32)
    grads = [g.standard_normal(50).astype(np.float32) for _ in range(5)]
    # AdamW (torch.optim.AdamW's update, written out in float64)
    p, gr = p0.copy(), np.zeros_like(p0)
    opt = tpcore.optim.AdamW([(p, gr)], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    rp, m, v = p0.astype(np.float64), np.zeros(50), np.zeros(50)
    for t, gt in enumerate(grads, 1):
        gr[...] = gt
        opt.step()
        rp = rp * (1 - 0.01 * 0.1)
        m = 0.9 * m + 0.1 * gt
        v = 0.99 * v + 0.01 * gt.astype(np.float64) ** 2
        rp = rp - 0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.99 ** t)) + 1e-8)
    assert np.allclose(p, rp, rtol=1e-5, atol=1e-6)
    # SGD with momentum and weight decay
    p, gr = p0.copy(), np.zeros_like(p0)
    opt = tpcore.optim.SGD([(p, gr)], lr=0.1, momentum=0.9, weight_decay=0.01)
    rp, buf = p0.astype(np.float64), None
    for gt in grads:
        gr[...] = gt
        opt.step()
        d = gt + 0.01 * rp
        buf = d if buf is None else 0.9 * buf + d
        rp = rp - 0.1 * buf
    assert np.allclose(p, rp, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        tpcore.optim.AdamW([(p, gr)], lr=-1)
    with pytest.raises(ValueError):
        tpcore.optim.SGD([(p, np.zeros(3, np.float32))])


def _train(comm, steps):
    """A 2-layer MLP regressing a fixed nonlinear target with AdamW."""
    g = rng_for(42, 0)
    X = g.standard_normal((64, 16)).astype(np.float32)
    T = np.sin(X @ g.standard_normal((16, 16)).astype(np.float32) / 2).astype(np.float32)
    mlp = tpcore.ParallelMLP(16, 48, comm, activation="gelu", seed=5)
    opt = tpcore.optim.AdamW([mlp], lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        y = mlp(X)
        diff = y - T
        losses.append(float(np.mean(diff.astype(np.float64) ** 2)))
        mlp.zero_grad()
        mlp.backward((2 * diff / diff.size).astype(np.float32))
        opt.step()
    return losses


def test_training_curve_is_the_same_at_every_world_size():
    ref = run(_train, 1, 50)[0]
    assert ref[-1] < 0.5 * ref[0], ref  # it learns
    for world in (2, 3, 4):
        for r, curve in enumerate(run(_train, world, 50)):
            assert np.allclose(curve, ref, rtol=2e-4, atol=1e-6), (world, r, np.max(np.abs(np.subtract(curve, ref))))


@pytest.mark.parametrize("name", ["gelu", "silu", "swiglu"])
def test_activation_kernels_split_over_threads(name):
    """Large inputs run on several threads (rows split in chunks): the same values
    as the float64 reference, with 1 and 3 threads."""
    g = rng_for(12, 0)
    F = 1111
    h = (g.standard_normal((1000, 2 * F if name == "swiglu" else F)) * 3).astype(np.float32)
    d = g.standard_normal((1000, F)).astype(np.float32)
    before = tpcore.get_num_threads()
    try:
        outs = []
        for t in (1, 3):
            tpcore.set_num_threads(t)
            outs.append((_C.act_forward(name, h), _C.act_backward(name, h, d)))
    finally:
        tpcore.set_num_threads(before)
    for y, dh in outs:
        assert np.allclose(y, ref_act(name, h), rtol=1e-5, atol=1e-6)
        assert np.allclose(dh, ref_act_grad(name, h, d), rtol=1e-4, atol=1e-4)
    assert np.array_equal(outs[0][0], outs[1][0])  # element-wise: the split cannot change a value


def _big_mlp(comm, act, threads):
    """An MLP big enough that the fused bias + activation kernels split over threads
    (per-chunk bias-gradient sums): forward, input gradient and db1 against float64."""
    tpcore.set_num_threads(threads)
    H, F, R = 48, 4099, 150
    mlp = tpcore.ParallelMLP(H, F, comm, activation=act, seed=17)
    g = rng_for(17, 0)
    x = g.standard_normal((R, H)).astype(np.float32)
    dy = g.standard_normal((R, H)).astype(np.float32)
    W1, b1 = mlp.fc1.gather_full()
    W2, b2 = mlp.fc2.gather_full()
    y = mlp(x)
    dx = mlp.backward(dy)
    h = x.astype(np.float64) @ W1.T.astype(np.float64) + b1
    ry = ref_act(act, h) @ W2.T.astype(np.float64) + b2
    dh = ref_act_grad(act, h, dy.astype(np.float64) @ W2.astype(np.float64))
    rdx = dh @ W1.astype(np.float64)
    gW1, gb1 = _grads_full(mlp.fc1)
    return (float(np.max(np.abs(y - ry) / (1 + np.abs(ry)))), float(np.max(np.abs(dx - rdx) / (1 + np.abs(rdx)))),
            float(np.max(np.abs(gb1 - dh.sum(0)) / (1 + np.abs(dh.sum(0))))))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_parallel_mlp_threaded_fused_kernels(world, act):
    for r, errs in enumerate(run(_big_mlp, world, act, 3)):
        assert max(errs) < 1e-4, f"rank {r}: relative errors y, dx, db1 = {errs}"
