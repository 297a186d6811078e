"""tpcore.nn.MoE (Mixtral's sparse MoE MLP) against transformers' MixtralSparseMoeBlock and torch
autograd: outputs, router logits and gradients (router, experts, input) at expert parallelism
1-4 (uneven expert counts, ranks that receive no token, replicated tokens), tensor parallelism
inside the experts, and the load-balancing loss against transformers' load_balancing_loss_func
with its gradient (attention mask included).  One 4-rank tpcore.Cluster for the module; each
case splits the ranks it needs."""
import multiprocessing

import numpy as np
import pytest

import tpcore
from tpcore.nn.moe import MoE, _all_to_all, load_balancing_loss

torch = pytest.importorskip("torch")
mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
MixtralConfig = pytest.importorskip("transformers").MixtralConfig

C, F, E, K = 32, 24, 8, 2


@pytest.fixture(scope="module")
def cluster():
    with tpcore.Cluster(4, deadline=120) as c:
        yield c
    assert not multiprocessing.active_children()


@pytest.fixture(autouse=True)
def no_leaks():
    """(conftest's per-test check would see the module's cluster: the cluster fixture checks once at its end)"""
    yield


def _hf_blocks(layers, experts=E, seed=0):
    torch.manual_seed(seed)
    cfg = MixtralConfig(hidden_size=C, intermediate_size=F, num_local_experts=experts, num_experts_per_tok=K,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    blocks = []
    for _ in range(layers):
        b = mixtral.MixtralSparseMoeBlock(cfg).double()
        with torch.no_grad():
            b.gate.weight.normal_(0, 0.5)
            b.experts.gate_up_proj.normal_(0, 0.2)
            b.experts.down_proj.normal_(0, 0.2)
        blocks.append(b)
    return blocks


def _tensors(b):
    out = {"router.weight": b.gate.weight.detach().numpy().astype(np.float32)}
    for e in range(b.experts.num_experts):
        out[f"experts.{e}.fc1.weight"] = b.experts.gate_up_proj[e].detach().numpy().astype(np.float32)
        out[f"experts.{e}.fc2.weight"] = b.experts.down_proj[e].detach().numpy().astype(np.float32)
    return out


def _reference(blocks, x, g, mask=None, coef=0.0):
    """Outputs, router logits, the loss sum(y * g) + coef * aux and its gradients by torch autograd."""
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    h, logits = xt, []
    for b in blocks:
        logits.append(torch.nn.functional.linear(h.reshape(-1, C), b.gate.weight))
        h = b(h)
    loss = (h * torch.tensor(g, dtype=torch.float64)).sum()
    aux = None
    if coef:
        m = None if mask is None else torch.tensor(mask, dtype=torch.float64)
        aux = mixtral.load_balancing_loss_func(tuple(logits), blocks[0].experts.num_experts, K, m)
        loss = loss + coef * aux
    loss.backward()
    grads = [_tensors_grad(b) for b in blocks]
    return (h.detach().numpy(), [lg.detach().numpy() for lg in logits], xt.grad.numpy(), grads,
            None if aux is None else float(aux.detach()))


def _tensors_grad(b):
    out = {"router.weight": b.gate.weight.grad.numpy()}
    for e in range(b.experts.num_experts):
        out[f"experts.{e}.fc1.weight"] = b.experts.gate_up_proj.grad[e].numpy()
        out[f"experts.{e}.fc2.weight"] = b.experts.down_proj.grad[e].numpy()
    return out


def _run_moe(comm, n, tensors, x, g, mode, replicated, partition, mask, coef):
    """n ranks of comm run the MoE layers (one per tensors dict) over x (replicated: every rank
    all of x; else rank r the r-th even share of the rows), forward and backward."""
    sub = comm.split(0 if comm.rank < n else None)
    if sub is None:
        return None
    B = x.shape[0]
    share = [B // n + (r < B % n) for r in range(n)]
    lo = sum(share[:sub.rank])
    rows = slice(None) if replicated or mode == "tp" else slice(lo, lo + share[sub.rank])
    moes = [MoE(C, F, len(t) // 2, K, sub, mode=mode, replicated=replicated, expert_partition=partition, seed=i)
            for i, t in enumerate(tensors)]
    for m, t in zip(moes, tensors):
        m.load_full(t)
    h = x[rows]
    logits = []
    for m in moes:
        h = m(h)
        logits.append(m.router_logits.copy())
    aux = load_balancing_loss(moes, None if mask is None else mask[rows], coef=coef) if coef else None
    d = g[rows]
    for m in reversed(moes):
        d = m.backward(d)
    grads = [m.gather_full(grads=True) for m in moes]
    local_router = [m.grad_router.copy() for m in moes]
    read = [m.bytes_read for m in moes]
    sub.close()
    return h, logits, d, grads, local_router, aux, read


def _close(a, b, tol=1e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
    assert err < tol, err


def _check(res, n, ref, x, mode, replicated):
    y, logits, dx, grads, _ = ref[:5]
    res = res[:n]
    if replicated or mode == "tp":
        for r in res:
            _close(r[0], y)
            _close(r[2], dx)
            for lg, want in zip(r[1], logits):
                _close(lg, want)
    else:
        _close(np.concatenate([r[0] for r in res]), y)
        _close(np.concatenate([r[2] for r in res]), dx)
        for i, want in enumerate(logits):
            _close(np.concatenate([r[1][i] for r in res]), want)
    for i, want in enumerate(grads):
        for r in res:  # gather_full gives every expert's gradient on every rank
            for name, w in want.items():
                if name == "router.weight" and not (replicated or mode == "tp"):
                    continue  # each rank's router gradient is its tokens': summed below
                _close(r[3][i][name], w)
        if not (replicated or mode == "tp"):
            _close(sum(r[4][i] for r in res), want["router.weight"])


@pytest.mark.parametrize("n,partition", [(1, None), (2, None), (3, None), (4, None), (3, [5, 0, 3]),
                                         (4, [1, 2, 0, 5])])
def test_expert_parallel_matches_transformers(cluster, n, partition):
    blocks = _hf_blocks(2)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((2, 5, C))
    g = rng.standard_normal((2, 5, C))
    ref = _reference(blocks, x, g)
    res = cluster.run(_run_moe, n, [_tensors(b) for b in blocks], x.astype(np.float32), g.astype(np.float32),
                      "ep", False, partition, None, 0.0)
    _check(res, n, ref, x, "ep", False)


@pytest.mark.parametrize("mode,n", [("ep", 2), ("ep", 3), ("tp", 2), ("tp", 3)])
def test_replicated_tokens_and_tp_inside_experts_with_the_aux_loss(cluster, mode, n):
    blocks = _hf_blocks(2, seed=3)
    rng = np.random.default_rng(10 + n)
    x = rng.standard_normal((2, 4, C))
    g = rng.standard_normal((2, 4, C))
    mask = np.array([[1, 1, 1, 0], [0, 1, 1, 1]])
    ref = _reference(blocks, x, g, mask, coef=0.7)
    res = cluster.run(_run_moe, n, [_tensors(b) for b in blocks], x.astype(np.float32), g.astype(np.float32),
                      mode, True, None, mask, 0.7)
    _check(res, n, ref, x, mode, True)
    for r in res[:n]:
        assert abs(r[5] - ref[4]) <= 1e-6 * abs(ref[4]), (r[5], ref[4])


def test_aux_loss_without_mask_at_world_one(cluster):
    blocks = _hf_blocks(2, experts=4, seed=5)
    rng = np.random.default_rng(7)
    x, g = rng.standard_normal((3, 3, C)), rng.standard_normal((3, 3, C))
    ref = _reference(blocks, x, g, None, coef=2.0)
    res = cluster.run(_run_moe, 1, [_tensors(b) for b in blocks], x.astype(np.float32), g.astype(np.float32),
                      "ep", False, None, None, 2.0)
    _check(res, 1, ref, x, "ep", False)
    assert abs(res[0][5] - ref[4]) <= 1e-6 * ref[4]


def test_a_token_routed_away_from_a_rank_and_decode_reads_only_active_experts(cluster):
    """One token (decode) routes to 2 experts: the ranks holding neither receive nothing
    (zero-size all_to_all blocks), and only the two active experts' weights are read."""
    blocks = _hf_blocks(1, seed=9)
    rng = np.random.default_rng(1)
    x, g = rng.standard_normal((1, 1, C)), rng.standard_normal((1, 1, C))
    ref = _reference(blocks, x, g)
    res = cluster.run(_run_moe, 4, [_tensors(blocks[0])], x.astype(np.float32), g.astype(np.float32),
                      "ep", True, None, None, 0.0)
    _check(res, 4, ref, x, "ep", True)
    read = [r[6][0] for r in res]
    assert sum(r["active_experts"] for r in read) == K
    assert sum(r["experts"] for r in read) == K * 3 * F * C * 4


def _a2a(comm, sizes):
    send = sizes[comm.rank]
    x = np.concatenate([np.full((s, 2), 10 * comm.rank + r, np.float32) for r, s in enumerate(send)] +
                       [np.zeros((0, 2), np.float32)])
    return _all_to_all(comm, x, send), _all_to_all(comm, x, send, [sizes[s][comm.rank] for s in range(comm.size)])


def test_the_dispatch_all_to_all_with_uneven_and_empty_blocks(cluster):
    sizes = [[0, 2, 1, 0], [3, 0, 0, 1], [0, 0, 0, 0], [1, 1, 2, 0]]
    for r, (a, b) in enumerate(cluster.run(_a2a, sizes)):
        want = np.concatenate([np.full((sizes[s][r], 2), 10 * s + r) for s in range(4)])
        assert np.array_equal(a, want) and np.array_equal(b, want)


def _bad(comm, case):
    try:
        if case == "mode":
            MoE(C, F, E, K, comm, mode="dp")
        elif case == "top_k":
            MoE(C, F, E, E + 1, comm)
        elif case == "partition":
            MoE(C, F, E, K, comm, expert_partition=[4, 4, 4, 4])
        elif case == "shape":
            MoE(C, F, E, K, comm)(np.zeros((2, C + 1), np.float32))
        elif case == "backward":
            MoE(C, F, E, K, comm).backward(np.zeros((2, C), np.float32))
        elif case == "dy":
            m = MoE(C, F, E, K, comm)
            m(np.zeros((2, 3, C), np.float32))
            m.backward(np.zeros((3, 2, C), np.float32))
        return "no error"
    except (TypeError, ValueError, RuntimeError) as e:
        return str(e)


@pytest.mark.parametrize("case,words", [("mode", "mode must be one of"), ("top_k", "top_k"),
                                        ("partition", "adds up to 16"), ("shape", "x must have shape"),
                                        ("backward", "no forward"), ("dy", "(3, 2, 32)")])
def test_bad_arguments_are_refused_by_name(cluster, case, words):
    for msg in cluster.run(_bad, case):
        assert words in msg, msg
