"""memory() of every layer kind and of TransformerLM: each count against a size
computed here from the config and the arrays the layer exposes (weight.nbytes, ...), at
world sizes 1-3: params, grads (before and after they exist), workspace (grown by a
forward with more rows, kept for fewer), the KV cache and the part of it written by a
prefill and decode steps, the collective buffers; the model's by_device and the
optimizer's state; and the process's resident memory against the model's total.

Sizes as the C layers allocate them: every tensor or workspace slice rounded up to 64
bytes (an empty slice takes 64); a collective buffer of n bytes takes max(4096, 1.5 n)
when n > 4096, else 4096.  Kernel threads are set to 1, so that the scratch of the bias +
activation backward is one row of partial sums."""
import os

import numpy as np
import pytest

import tpcore
from conftest import rng_for, run, run_fresh
from tpcore.nn.linear import ColumnParallelLinear, RowParallelLinear
from tpcore.nn.mlp import ParallelMLP
from tpcore.nn.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding

KEYS = {"device", "params", "grads", "optimizer", "kv_cache", "kv_cache_used", "workspace", "comm", "total"}


def a64(n):
    """Bytes of an arena slice of n bytes."""
    return max(1, -(-int(n) // 64)) * 64


def reg(n):
    """Bytes of a collective buffer asked for n bytes."""
    return n + n // 2 if n > 4096 else 4096


def tensors(*arrs):
    return sum(a64(a.nbytes) for a in arrs if a is not None)


def check_dict(m, who):
    errs = []
    if set(m) != KEYS:
        errs.append(f"{who}: keys {sorted(m)}")
    if m.get("device") != "cpu":
        errs.append(f"{who}: device {m.get('device')!r}")
    if any(not isinstance(m[k], int) or m[k] < 0 for k in KEYS - {"device"} if k in m):
        errs.append(f"{who}: not all counts are ints >= 0: {m}")
    want = sum(m[k] for k in ("params", "grads", "optimizer", "kv_cache", "workspace", "comm"))
    if m.get("total") != want or m["optimizer"] != 0 or m["kv_cache_used"] > m["kv_cache"]:
        errs.append(f"{who}: total/optimizer/kv_cache_used inconsistent: {m}")
    return errs


def expect(errs, who, got, want):
    if got != want:
        errs.append(f"{who}: got {got}, expected {want}")


# ------------------------------------------------------------------ linear, MLP

def _linear_case(comm, kind, dtype, bias):
    tpcore.set_num_threads(1)
    n, errs = comm.size, []
    K, N = 64, 10
    g = rng_for(5, comm.rank)
    if kind == "column":
        layer = ColumnParallelLinear(K, N, comm, bias=bias, gather_output=True, dtype=dtype, seed=2)

        def saved(M):  # x, backward's dy columns
            return a64(M * K * 4) + a64(M * layer.local * 4 if n > 1 else 0)
    else:
        layer = RowParallelLinear(K, N, comm, bias=bias, input_is_parallel=False, dtype=dtype, seed=2,
                                  partition=None if n == 1 else [32, 32] if n == 2 else [32, 0, 32])

        def saved(M):  # this rank's columns of x
            return a64(M * layer.local * 4) + a64(0)
    who = f"{kind} {dtype} world {n} rank {comm.rank}"
    m0 = layer.memory()
    errs += check_dict(m0, who)
    params = tensors(layer.weight, layer.bias)
    expect(errs, f"{who} params", m0["params"], params)
    expect(errs, f"{who} workspace before forward", m0["workspace"], 0)
    expect(errs, f"{who} comm before forward", m0["comm"], 0)
    grads = tensors(layer.grad_weight, layer.grad_bias)  # (the accessors may allocate them)
    m1 = layer.memory()
    expect(errs, f"{who} grads once handed out", m1["grads"], grads)
    if m0["grads"] not in (0, grads):
        errs.append(f"{who}: grads before backward {m0['grads']}, neither none nor {grads}")
    quant = tpcore.quant.is_quantized(dtype)
    want_grads = (0 if quant else a64(layer.weight.shape[0] * (K if kind == "column" else layer.local) * 4)) + \
        (tensors(layer.bias))
    expect(errs, f"{who} grads from the config", grads, want_grads)
    ws = regs = 0
    for M in (7, 3, 11):
        x = g.standard_normal((M, K)).astype(np.float32)
        y = layer(x)
        layer.backward(np.ones_like(y))
        ws = max(ws, saved(M))
        if n > 1:
            regs = max(regs, reg(M * N * 4) + reg(M * K * 4))  # forward's gather/sum, backward's dx
        m = layer.memory()
        errs += check_dict(m, who)
        expect(errs, f"{who} params after {M} rows", m["params"], params)
        expect(errs, f"{who} grads after backward", m["grads"], tensors(layer.grad_weight, layer.grad_bias))
        expect(errs, f"{who} grads after backward (config)", m["grads"], want_grads)
        expect(errs, f"{who} workspace after {M} rows", m["workspace"], ws)
        expect(errs, f"{who} comm after {M} rows", m["comm"], regs)
        expect(errs, f"{who} kv cache", m["kv_cache"] + m["kv_cache_used"], 0)
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_linear_memory(world):
    def fn(comm):
        errs = []
        for kind, dtype, bias in (("column", "float32", True), ("row", "float32", True),
                                  ("column", "bfloat16", False), ("row", "q8_0", False), ("column", "q4_0", True)):
            errs += _linear_case(comm, kind, dtype, bias)
        return errs
    errs = sum(run(fn, world), [])
    assert not errs, "\n".join(errs[:20])


def _mlp_case(comm, activation, bias, dtype):
    tpcore.set_num_threads(1)
    n, C, F = comm.size, 12, 23
    who = f"mlp {activation} bias={bias} {dtype} world {n} rank {comm.rank}"
    errs = []
    mlp = ParallelMLP(C, F, comm, activation=activation, bias=bias, dtype=dtype, seed=4)
    fc1, fc2 = mlp.fc1, mlp.fc2
    m0 = mlp.memory()
    errs += check_dict(m0, who)
    expect(errs, f"{who} params", m0["params"], tensors(fc1.weight, fc1.bias, fc2.weight, fc2.bias))
    expect(errs, f"{who} = fc1 + fc2 before forward", m0["total"], fc1.memory()["total"] + fc2.memory()["total"])
    gated = 2 if activation == "swiglu" else 1
    f = fc2.local  # activation columns of this rank
    g = rng_for(9, comm.rank)

    def step(M):
        x = g.standard_normal((M, C)).astype(np.float32)
        mlp.backward(mlp(x))

    step(6)  # the gradients exist from here on: the bias backward's scratch is planned from the next forward
    own_ws = lin_ws = regs = 0
    for M in (6, 2, 9):
        step(M)
        bws = gated * f * 4 if bias else 0  # one row of partial column sums (one thread)
        own_ws = max(own_ws, 2 * a64(M * gated * f * 4) + 2 * a64(M * f * 4) + a64(bws))  # h, dh, a, da, scratch
        lin_ws = max(lin_ws, a64(M * C * 4) + a64(0) + 2 * a64(0))  # fc1 keeps x, fc2 borrows the activation
        if n > 1:
            regs = max(regs, 2 * reg(M * C * 4))  # fc2's sum, fc1's dx sum
        m = mlp.memory()
        errs += check_dict(m, who)
        expect(errs, f"{who} grads", m["grads"],
               tensors(fc1.grad_weight, fc1.grad_bias, fc2.grad_weight, fc2.grad_bias))
        expect(errs, f"{who} workspace after {M} rows", m["workspace"], own_ws + lin_ws)
        expect(errs, f"{who} fc1's + fc2's workspace", fc1.memory()["workspace"] + fc2.memory()["workspace"], lin_ws)
        expect(errs, f"{who} comm after {M} rows", m["comm"], regs)
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_mlp_memory(world):
    def fn(comm):
        return _mlp_case(comm, "gelu", True, "float32") + _mlp_case(comm, "swiglu", False, "bfloat16")
    errs = sum(run(fn, world), [])
    assert not errs, "\n".join(errs[:20])


# ------------------------------------------------------------ embedding, cross-entropy

@pytest.mark.parametrize("world", [1, 2, 3])
def test_vocab_memory(world):
    def fn(comm):
        n, V, D, errs = comm.size, 13, 6, []
        g, gl = rng_for(3, 0), rng_for(7, comm.rank)  # the same tokens on every rank, logits of its own
        for dtype in ("float32", "bfloat16"):
            emb = VocabParallelEmbedding(V, D, comm, dtype=dtype, seed=1)
            xent = VocabParallelCrossEntropy(comm)
            who = f"embedding {dtype} world {n} rank {comm.rank}"
            m = emb.memory()
            errs += check_dict(m, who) + check_dict(xent.memory(), who + " xent")
            expect(errs, f"{who} params", m["params"], a64(emb.local * D * (4 if dtype == "float32" else 2)))
            expect(errs, f"{who} params (array)", m["params"], tensors(emb.weight))
            expect(errs, f"{who} workspace before forward", m["workspace"] + m["comm"], 0)
            expect(errs, f"{who} xent before forward", xent.memory()["total"], 0)
            ews = xws = ereg = xreg = 0
            for M in (8, 5, 12):
                tok = g.integers(0, V, M)
                y = emb(tok)
                emb.backward(np.ones_like(y))
                logits = gl.standard_normal((M, emb.local)).astype(np.float32)
                xent(logits, tok, vocab_offset=emb.offset)
                xent.backward()
                ews = max(ews, a64(M * 8) + a64(16))  # the tokens, the range check's flag
                xws = max(xws, 3 * a64(M * 4) + a64(2 * M * 4) + a64(M * 8) + a64(24))
                if n > 1:
                    ereg, xreg = max(ereg, reg(M * D * 4)), max(xreg, reg((3 * M + 2 * n + 2) * 4))
                m, mx = emb.memory(), xent.memory()
                errs += check_dict(m, who) + check_dict(mx, who + " xent")
                expect(errs, f"{who} grads after backward", m["grads"], tensors(emb.grad_weight))
                expect(errs, f"{who} grads (config)", m["grads"], a64(emb.local * D * 4))
                expect(errs, f"{who} workspace after {M} rows", m["workspace"], ews)
                expect(errs, f"{who} comm after {M} rows", m["comm"], ereg)
                expect(errs, f"{who} xent workspace after {M} rows", mx["workspace"], xws)
                expect(errs, f"{who} xent comm after {M} rows", mx["comm"], xreg)
                expect(errs, f"{who} xent params", mx["params"] + mx["grads"] + mx["kv_cache"], 0)
        return errs
    errs = sum(run(fn, world), [])
    assert not errs, "\n".join(errs[:20])


# ------------------------------------------------------------ blocks and attention

BLOCKS = {
    "gpt2": dict(vocab_size=31, hidden=16, layers=2, heads=4, ffn_hidden=20, max_positions=64),
    "llama_gqa": dict(vocab_size=31, hidden=16, layers=2, heads=6, kv_heads=3, head_dim=4, ffn_hidden=20,
                      norm="rmsnorm", activation="swiglu", positions="rope", bias=False, max_positions=64,
                      tie_embeddings=False),
    "gpt2_wide": dict(vocab_size=31, hidden=32, layers=2, heads=4, ffn_hidden=40, max_positions=64),
}
QUANT_MIX = {"qkv": "q8_0", "fc1": "q4_0"}  # quantized column-parallel projections (rows of hidden = 32)


def _block_case(comm, name, attention_only, dtype):
    tpcore.set_num_threads(1)
    cfg = tpcore.Config(**BLOCKS[name])
    kind = tpcore.ParallelAttention if attention_only else tpcore.TransformerBlock
    blk = kind(cfg, comm, seed=5, dtype=dtype)
    who = f"{kind.__name__} {name} {dtype!s} world {comm.size} rank {comm.rank}"
    errs = []
    m0 = blk.memory()
    errs += check_dict(m0, who)
    named = blk.named_parameters()
    params = tensors(*(p for p, _ in named.values()))
    if attention_only:  # the norms exist but are no parameters of an attention layer (weights, and LayerNorm's biases)
        params += (2 if cfg.norm == "rmsnorm" else 4) * a64(cfg.hidden * 4)
    expect(errs, f"{who} params", m0["params"], params)
    expect(errs, f"{who} workspace, cache, comm before use", m0["workspace"] + m0["kv_cache"] + m0["comm"], 0)
    g = rng_for(13, 0)
    C, D, nk = cfg.hidden, cfg.head_dim, blk.nk

    def fwd(B, T, **kw):
        return blk(g.standard_normal((B, T, C)).astype(np.float32), **kw)

    y = fwd(2, 5)
    blk.backward(np.ones_like(y))
    m1 = blk.memory()
    errs += check_dict(m1, who)
    grads = tensors(*(gr for _, gr in blk.named_parameters().values()))
    if attention_only:
        grads += (2 if cfg.norm == "rmsnorm" else 4) * a64(C * 4)
    expect(errs, f"{who} grads after backward", m1["grads"], grads)
    if m1["workspace"] < 10 * 2 * 5 * C * 4:  # at least the block's activations of 10 rows
        errs.append(f"{who}: workspace {m1['workspace']} below its activations")
    fwd(1, 3)
    expect(errs, f"{who} workspace after fewer rows", blk.memory()["workspace"], m1["workspace"])
    fwd(3, 6)
    if blk.memory()["workspace"] <= m1["workspace"]:
        errs.append(f"{who}: workspace did not grow for more rows ({blk.memory()['workspace']})")
    # the KV cache: K and V of batch x max_len tokens of this rank's KV heads, float32
    blk.cache(2, 8)
    m = blk.memory()
    per_tok = 2 * nk * D * 4
    expect(errs, f"{who} kv_cache", m["kv_cache"], 2 * 8 * per_tok)
    expect(errs, f"{who} kv_cache_used after cache()", m["kv_cache_used"], 0)
    fwd(2, 5, use_cache=True, need_backward=False)  # prefill
    expect(errs, f"{who} kv_cache_used after a prefill", blk.memory()["kv_cache_used"], 2 * 5 * per_tok)
    for s in range(2):
        fwd(2, 1, pos0=[5 + s, 5 + s], use_cache=True, need_backward=False)
    expect(errs, f"{who} kv_cache_used after decode steps", blk.memory()["kv_cache_used"], 2 * 7 * per_tok)
    fwd(1, 1, pos0=[7], use_cache=True, need_backward=False, slots=[1])  # one sequence goes on
    expect(errs, f"{who} kv_cache_used, one more token", blk.memory()["kv_cache_used"], (7 + 8) * per_tok)
    m = blk.memory()
    errs += check_dict(m, who)
    expect(errs, f"{who} params after all", m["params"], params)
    blk.cache(1, 4)
    expect(errs, f"{who} kv_cache after a new cache()", blk.memory()["kv_cache"], 4 * per_tok)
    expect(errs, f"{who} kv_cache_used after a new cache()", blk.memory()["kv_cache_used"], 0)
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_block_memory(world):
    def fn(comm):
        errs = []
        for name in ("gpt2", "llama_gqa"):
            for attention_only in (False, True):
                errs += _block_case(comm, name, attention_only, "float32")
        errs += _block_case(comm, "llama_gqa", False, "bfloat16")
        errs += _block_case(comm, "gpt2_wide", False, QUANT_MIX)
        return errs
    errs = sum(run(fn, world), [])
    assert not errs, "\n".join(errs[:20])


# ------------------------------------------------------------------------ models

def _own_arrays(model):
    """The model's arrays outside its layers (params, grads) from what it exposes."""
    p = g = 0
    for a, ga in ((model.wpe, model.wpe_grad), (model.tte, model.tte_grad)):
        p += 0 if a is None else a.nbytes
        g += 0 if ga is None else ga.nbytes
    for norm in (model.emb_norm, model.final_norm):
        if norm is not None:
            p += norm.weight.nbytes + (0 if norm.bias is None else norm.bias.nbytes)
            for ga in (norm.grad_weight, norm.grad_bias):  # None until a backward (gradients on demand)
                g += 0 if ga is None else ga.nbytes
    return p, g


def _model_case(comm, name, dtype, device_path):
    tpcore.set_num_threads(1)
    cfg = tpcore.Config(**BLOCKS[name])
    model = tpcore.models.TransformerLM(cfg, comm, seed=2, dtype=dtype, _device_path=device_path)
    who = f"model {name} {dtype}{' device path' if device_path else ''} world {comm.size} rank {comm.rank}"
    errs = []

    def consistent(m):
        e = check_dict({k: v for k, v in m.items() if k != "by_device"}, who)
        if set(m["by_device"]) != {"cpu"} or sum(m["by_device"].values()) != m["total"]:
            e.append(f"{who}: by_device {m['by_device']} does not sum to total {m['total']}")
        layers = [model.wte] + model.blocks + ([model.lm_head] if model.lm_head is not None else [])
        own = dict(zip(("params", "grads"), _own_arrays(model)))
        buf = getattr(model, "_logits_buf", None)  # the logits shard a training step reuses
        own["workspace"] = 0 if buf is None else buf.nbytes
        # the blocks' one shared inference workspace (every block uses the same one), counted once
        ids = {b._c.shared_workspace_id for b in model.blocks}
        if len(ids) != 1 or 0 in ids:
            e.append(f"{who}: the blocks do not share one inference workspace: {ids}")
        ws, cb = model.blocks[0]._c.shared_workspace_bytes
        own["workspace"] += ws
        own["comm"] = cb
        for k in ("params", "grads", "kv_cache", "kv_cache_used", "workspace", "comm"):
            expect(e, f"{who} {k} = the layers' + the model's own", m[k], sum(x.memory()[k] for x in layers) +
                   own.get(k, 0))
        return e

    errs += consistent(model.memory())
    g = rng_for(21, 0)
    tok = g.integers(0, cfg.vocab_size, (2, 6))
    model.loss(tok, np.roll(tok, -1, 1))
    model.backward()
    m = model.memory()
    errs += consistent(m)
    # the optimizer's state: AdamW's two float32 moments per gradient, a master copy per 16-bit parameter
    opt = tpcore.optim.AdamW(model, lr=1e-3)
    state = sum(2 * gr.nbytes + (0 if str(p.dtype) == "float32" else p.size * 4) for p, gr in model.parameters())
    expect(errs, f"{who} AdamW.state_bytes", opt.state_bytes(), state)
    mo = model.memory(optimizer=opt)
    expect(errs, f"{who} optimizer", mo["optimizer"], state)
    expect(errs, f"{who} total with the optimizer", mo["total"], m["total"] + state)
    expect(errs, f"{who} by_device with the optimizer", sum(mo["by_device"].values()), mo["total"])
    sgd = tpcore.optim.SGD(model, lr=1e-3, momentum=0.9)
    expect(errs, f"{who} SGD.state_bytes", sgd.state_bytes(),
           sum(gr.nbytes + (0 if str(p.dtype) == "float32" else p.size * 4) for p, gr in model.parameters()))
    # the KV cache over every layer: 2 x layers x batch x max_len x local KV heads x head_dim x 4 bytes
    model.cache(2, 16)
    nk = model.blocks[0].nk
    expect(errs, f"{who} kv_cache", model.memory()["kv_cache"], 2 * cfg.layers * 2 * 16 * nk * cfg.head_dim * 4)
    model.forward(tok[:, :4], use_cache=True)
    model.forward(tok[:, 4:5], pos0=[4, 4], use_cache=True)
    expect(errs, f"{who} kv_cache_used", model.memory()["kv_cache_used"],
           2 * cfg.layers * 2 * 5 * nk * cfg.head_dim * 4)
    errs += consistent(model.memory())
    try:
        model.memory(optimizer=object())
        errs.append(f"{who}: a non-optimizer was taken")
    except TypeError as e:
        if "TransformerLM.memory" not in str(e):
            errs.append(f"{who}: unclear error {e}")
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_model_memory(world):
    def fn(comm):
        return (_model_case(comm, "gpt2", "float32", False) + _model_case(comm, "llama_gqa", "bfloat16", False) +
                _model_case(comm, "gpt2", "float32", True))
    errs = sum(run(fn, world), [])
    assert not errs, "\n".join(errs[:20])


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _rss_case(comm):
    tpcore.set_num_threads(1)
    g = rng_for(4, 0)
    # warm the allocator, BLAS and the kernels on a small model first: their one-time buffers are
    # the process's, not the model's
    small = tpcore.models.TransformerLM(tpcore.Config(vocab_size=64, hidden=32, layers=1, heads=2, ffn_hidden=64,
                                                      max_positions=64), comm)
    tok = g.integers(0, 64, (2, 16))
    small.loss(tok, tok)
    small.backward()
    del small
    cfg = tpcore.Config(vocab_size=6000, hidden=256, layers=4, heads=8, ffn_hidden=1024, max_positions=128)
    before = _rss()
    model = tpcore.models.TransformerLM(cfg, comm, seed=1)
    tok = g.integers(0, cfg.vocab_size, (4, 32))
    model.loss(tok, np.roll(tok, -1, 1))
    model.backward()
    grown = _rss() - before
    return grown, model.memory()["total"]


@pytest.mark.skipif(os.environ.get("TPCORE_UNDER_SANITIZER") == "1",
                    reason="resident memory under ASan is the sanitizer's (shadow memory, quarantine)")
def test_resident_memory_matches_total():
    """A float32 model of ~50 MB: the process's resident growth over building it and a training step
    is memory()'s total within 10% (plus 4 MiB for the Python objects and the allocator's own)."""
    grown, total = run_fresh("test_memory_accounting", "_rss_case", 1)[0]
    assert total > 30 * 2 ** 20, total
    assert abs(grown - total) <= 0.1 * total + 4 * 2 ** 20, (grown, total, grown / total)
