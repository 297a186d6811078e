"""tpcore.ProcessGrid (TP x PP x DP groups, Megatron's tp-dp-pp rank order) and
data-parallel gradient averaging: the layout against the formula at world 1-4, bad grids
refused on every rank, bucketed averages against NumPy means, and a TP x DP training run
equal to the single-process run on the whole batch."""
import numpy as np
import pytest

import tpcore
from conftest import BF16, rng_for, run

GRIDS = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (3, 1, 1), (1, 3, 1), (1, 1, 3), (4, 1, 1), (2, 1, 2), (1, 2, 2),
         (2, 2, 1), (1, 1, 4), (1, 4, 1)]


def _layout(comm, tp, pp, dp):
    g = tpcore.ProcessGrid(comm, tp=tp, pp=pp, dp=dp)
    members = {name: [int(v) for v in getattr(g, name).all_gather(np.array([comm.rank], np.int64))]
               for name in ("tp", "pp", "dp")}
    out = (g.coords(comm.rank), (g.tp_rank, g.pp_rank, g.dp_rank), members,
           {n: (getattr(g, n).size, getattr(g, n).rank) for n in ("tp", "pp", "dp")},
           [g.rank_of(*g.coords(r)[:1], pp=g.coords(r)[1], dp=g.coords(r)[2]) for r in range(comm.size)])
    g.close()
    return out


@pytest.mark.parametrize("tp,pp,dp", GRIDS)
def test_layout_is_tp_innermost_then_dp_then_pp(tp, pp, dp):
    n = tp * pp * dp
    for r, (coords, mine, members, sizes, inverse) in enumerate(run(_layout, n, tp, pp, dp)):
        t, p, d = r % tp, r // (tp * dp), (r // tp) % dp
        assert coords == mine == (t, p, d), (r, coords)
        assert members["tp"] == [x + tp * (d + dp * p) for x in range(tp)]
        assert members["dp"] == [t + tp * (x + dp * p) for x in range(dp)]
        assert members["pp"] == [t + tp * (d + dp * x) for x in range(pp)]
        assert sizes == {"tp": (tp, t), "pp": (pp, p), "dp": (dp, d)}
        assert inverse == list(range(n))


def _bad(comm, case):
    try:
        if case == "product":
            tpcore.ProcessGrid(comm, tp=2, pp=2, dp=2)
        elif case == "divides":
            tpcore.ProcessGrid(comm, tp=3)
        elif case == "disagree":
            tpcore.ProcessGrid(comm, tp=2 if comm.rank == 0 else 1, dp=None)
        elif case == "coords":
            tpcore.ProcessGrid(comm, tp=2).coords(comm.size)
        return "no error"
    except (ValueError, TypeError) as e:
        return str(e)


@pytest.mark.parametrize("case,words", [("product", "2 x 2 x 2 = 8"), ("divides", "does not divide"),
                                        ("disagree", "different grids"), ("coords", "rank")])
def test_bad_grids_are_refused_on_every_rank(case, words):
    for msg in run(_bad, 4 if case != "divides" else 4, case):
        assert words in msg, msg


def _buckets(comm, bucket_bytes):
    g = rng_for(81, comm.rank)
    shapes = [(3, 5), (7,), (1,), (40, 3), (2, 2, 2)]
    grads = [g.standard_normal(s).astype(np.float32) for s in shapes]
    params = [(np.zeros_like(x), x) for x in grads]
    mine = [x.copy() for x in grads]
    calls = tpcore.average_gradients(params, comm, bucket_bytes=bucket_bytes)
    return mine, [x.copy() for x in grads], calls


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_bytes", [4, 64, 1 << 22])
def test_bucketed_average_equals_the_mean(world, bucket_bytes):
    res = run(_buckets, world, bucket_bytes)
    for k in range(5):
        want = np.mean([r[0][k].astype(np.float64) for r in res], axis=0)
        for r in res:
            assert np.allclose(r[1][k], want, rtol=1e-6, atol=1e-6)
    calls = res[0][2]
    if world == 1:
        assert calls == 0
    elif bucket_bytes == 4:
        assert calls == 5  # every tensor alone
    elif bucket_bytes == 1 << 22:
        assert calls == 1  # all in one bucket


MODEL = dict(vocab_size=41, hidden=24, layers=2, heads=4, kv_heads=2, head_dim=6, ffn_hidden=40, norm="rmsnorm",
             activation="swiglu", positions="rope", bias=False, max_positions=32, model_type="llama")


def _train(comm, tp, dp, steps):
    """Each DP replica trains a TP-split model on its share of the global batch, gradients averaged
    over DP; the full weights and the losses come back."""
    grid = tpcore.ProcessGrid(comm, tp=tp, dp=dp)
    model = tpcore.models.TransformerLM(tpcore.Config(**MODEL), grid.tp, seed=5)
    opt = tpcore.optim.SGD(model, lr=0.1, momentum=0.9)
    g = rng_for(83, 0)  # the same global batch on every rank
    tokens = g.integers(0, MODEL["vocab_size"], (4, 7))
    targets = np.roll(tokens, -1, 1)
    share = 4 // dp
    mine = slice(grid.dp_rank * share, (grid.dp_rank + 1) * share)
    losses = []
    for _ in range(steps):
        local = model.loss(tokens[mine], targets[mine])
        losses.append(float(grid.dp.all_reduce(np.array([local]), op="avg")[0]))
        model.backward()
        grid.average_gradients(model)
        opt.step()
        model.zero_grad()
    sd = {k: np.asarray(v).copy() for k, v in model.state_dict_full().items()}
    grid.close()
    return losses, sd


@pytest.mark.parametrize("tp,dp", [(2, 2), (1, 4), (1, 2), (3, 1)])
def test_tp_x_dp_training_equals_one_process(tp, dp):
    ref_losses, ref_sd = run(_train, 1, 1, 1, 3)[0]
    for r, (losses, sd) in enumerate(run(_train, tp * dp, tp, dp, 3)):
        assert np.allclose(losses, ref_losses, rtol=1e-5, atol=1e-6), (r, losses, ref_losses)
        for k, v in ref_sd.items():
            assert np.allclose(sd[k], v, rtol=1e-4, atol=1e-5), (r, k, float(np.abs(sd[k] - v).max()))


def _train_zero(comm, tp, dp, steps, sharded, dtype="float32"):
    """AdamW after average_gradients (sharded=False), or ShardedAdamW over the DP group."""
    grid = tpcore.ProcessGrid(comm, tp=tp, dp=dp)
    model = tpcore.models.TransformerLM(tpcore.Config(**MODEL), grid.tp, seed=5, dtype=dtype)
    if sharded:
        opt = tpcore.optim.ShardedAdamW(model, grid.dp, lr=0.01, weight_decay=0.1)
    else:
        opt = tpcore.optim.AdamW(model, lr=0.01, weight_decay=0.1)
    g = rng_for(84, 0)
    tokens = g.integers(0, MODEL["vocab_size"], (12, 7))  # 12: a whole share for every dp in 1..4
    targets = g.integers(0, MODEL["vocab_size"], (12, 7))
    share = 12 // dp
    mine = slice(grid.dp_rank * share, (grid.dp_rank + 1) * share)
    losses = []
    for _ in range(steps):
        losses.append(float(grid.dp.all_reduce(np.array([model.loss(tokens[mine], targets[mine])]), op="avg")[0]))
        model.backward()
        if not sharded:
            grid.average_gradients(model)
        opt.step()
        model.zero_grad()
    sd = {k: np.asarray(v, np.float32).copy() for k, v in model.state_dict_full().items()}
    state = opt.state_bytes() if sharded else sum(m.nbytes + v.nbytes for m, v in opt.state)
    grid.close()
    return losses, sd, state, sum(p.size for p, _ in model.parameters())


@pytest.mark.parametrize("tp,dp,dtype", [(1, 2, "float32"), (2, 2, "float32"), (1, 3, "float32"),
                                         (1, 4, "float32"), (1, 2, "bfloat16")])
def test_sharded_adamw_equals_adamw_with_averaged_gradients(tp, dp, dtype):
    if dtype == "bfloat16" and BF16 is None:
        pytest.skip("needs ml_dtypes")
    ref_losses, ref_sd, _, _ = run(_train_zero, 1, 1, 1, 3, False, dtype)[0]
    res = run(_train_zero, tp * dp, tp, dp, 3, True, dtype)
    for r, (losses, sd, _state, _pbytes) in enumerate(res):
        assert np.allclose(losses, ref_losses, rtol=1e-5, atol=1e-6), (r, losses, ref_losses)
        for k, v in ref_sd.items():
            assert np.allclose(sd[k], v, rtol=1e-4, atol=1e-5), (r, k, float(np.abs(sd[k] - v).max()))
    # each DP rank holds 1/dp of the master and moments (12 bytes per parameter in all)
    for _losses, _sd, state, nparams in res:
        assert abs(state - 12 * nparams / dp) <= 12, (state, nparams, dp)


def _zero_bad(comm):
    grid = tpcore.ProcessGrid(comm, dp=comm.size)
    a = np.zeros((3 + comm.rank, 2), np.float32)
    try:
        tpcore.optim.ShardedAdamW([(a, np.zeros_like(a))], grid.dp)
        return "no error"
    except ValueError as e:
        return str(e)


def test_sharded_adamw_refuses_different_shapes_on_every_rank():
    for msg in run(_zero_bad, 2):
        assert "the parameters' shapes differ" in msg, msg


def _layout_ep(comm, tp, ep, pp, dp):
    g = tpcore.ProcessGrid(comm, tp=tp, pp=pp, dp=dp, ep=ep)
    members = {name: [int(v) for v in getattr(g, name).all_gather(np.array([comm.rank], np.int64))]
               for name in ("tp", "ep", "pp", "dp", "ep_dp")}
    c = g.coordinates(comm.rank)
    out = (c, (g.tp_rank, g.ep_rank, g.pp_rank, g.dp_rank), g.coords(comm.rank), members,
           [g.rank_of(**g.coordinates(r)) for r in range(comm.size)])
    g.close()
    return out


@pytest.mark.parametrize("tp,ep,pp,dp", [(1, 2, 1, 1), (1, 4, 1, 1), (2, 2, 1, 1), (1, 2, 1, 2), (1, 3, 1, 1),
                                         (1, 2, 2, 1)])
def test_expert_parallel_layout_is_tp_then_ep_then_dp_then_pp(tp, ep, pp, dp):
    """Megatron-Core's tp-ep-dp-pp order: rank = t + tp (e + ep (d + dp p)); ep_dp (the dense
    layers' replicas) holds the ep x dp ranks of a (tp, pp) pair."""
    n = tp * ep * pp * dp
    for r, (c, mine, coords, members, inverse) in enumerate(run(_layout_ep, n, tp, ep, pp, dp)):
        t, e, d, p = r % tp, (r // tp) % ep, (r // (tp * ep)) % dp, r // (tp * ep * dp)
        assert c == {"tp": t, "ep": e, "dp": d, "pp": p} and mine == (t, e, p, d) and coords == (t, p, d)

        def at(t, e, d, p):
            return t + tp * (e + ep * (d + dp * p))
        assert members["tp"] == [at(x, e, d, p) for x in range(tp)]
        assert members["ep"] == [at(t, x, d, p) for x in range(ep)]
        assert members["dp"] == [at(t, e, x, p) for x in range(dp)]
        assert members["pp"] == [at(t, e, d, x) for x in range(pp)]
        assert members["ep_dp"] == [at(t, x % ep, x // ep, p) for x in range(ep * dp)]
        assert inverse == list(range(n))


def _bad_ep(comm, case):
    try:
        if case == "product":
            tpcore.ProcessGrid(comm, tp=2, ep=2, dp=2)
        elif case == "divides":
            tpcore.ProcessGrid(comm, ep=3)
        elif case == "ep":
            tpcore.ProcessGrid(comm, ep=0)
        return "no error"
    except (ValueError, TypeError) as e:
        return str(e)


@pytest.mark.parametrize("case,words", [("product", "2 x 1 x 2 x 2 = 8"), ("divides", "tp x pp x ep = 1 x 1 x 3"),
                                        ("ep", "ep")])
def test_bad_expert_grids_are_refused(case, words):
    for msg in run(_bad_ep, 4, case):
        assert words in msg, msg
