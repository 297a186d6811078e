"""Gradients on demand: a layer or model made for inference holds no gradient
buffers (its C layer reports none, and building a float32 layer costs its weight bytes of
resident memory, not twice); the first backward allocates them and fills them with the
float64 reference's values; parameters() / zero_grad() / grad_weight before any backward
give zeroed buffers that backward then fills; quantized weights never get one."""
import os
import numpy as np
import pytest

import tpcore
import reference_transformer as ref
from conftest import rng_for, run, run_fresh

SMALL = dict(vocab_size=53, hidden=24, layers=2, heads=6, kv_heads=2, ffn_hidden=36, norm="rmsnorm", eps=1e-6,
             activation="swiglu", positions="rope", rope_theta=1000.0, max_positions=32, causal=True, pre_norm=True,
             bias=False, tie_embeddings=False, model_type="llama")
GPT2 = dict(vocab_size=47, hidden=20, layers=1, heads=5, ffn_hidden=33, norm="layernorm", activation="gelu_tanh",
            positions="learned", max_positions=16, causal=True, pre_norm=True, bias=True, tie_embeddings=True,
            model_type="gpt2")


def _c_grads(layer):
    """The gradient views the C layer holds now (None where it holds none), read without
    allocating: the C objects' own getters, not the Python properties."""
    c = layer._c
    if isinstance(layer, tpcore.TransformerBlock):
        return {k: g for k, (_, g) in c.params().items()}
    if isinstance(layer, tpcore.ParallelMLP):
        out = {"fc1.w": c.fc1.grad_weight, "fc2.w": c.fc2.grad_weight}
        out.update({"fc1.b": c.fc1.grad_bias, "fc2.b": c.fc2.grad_bias} if c.fc1.bias is not None else {})
        return out
    if isinstance(layer, tpcore.VocabParallelEmbedding):
        return {"w": c.grad_weight}
    return {"w": c.grad_weight, **({} if c.bias is None else {"b": c.grad_bias})}


def _model_grads(model):
    """Every gradient a TransformerLM holds now (None: none), without allocating."""
    out = {"wpe": model.wpe_grad, "tte": model.tte_grad}
    if model.wte is not None:
        out["wte"] = model.wte._c.grad_weight
    for i, b in enumerate(model.blocks):
        out.update({f"blocks.{i}.{k}": g for k, g in _c_grads(b).items()})
    for name in ("final_norm", "emb_norm"):
        n = getattr(model, name)
        if n is not None:
            out[name] = n.grad_weight
    if model.lm_head is not None:
        out.update({f"lm_head.{k}": g for k, g in _c_grads(model.lm_head).items()})
    return out


def _inference_layers(comm):
    n = comm.size
    g = rng_for(5, 0)
    cfg = tpcore.Config(vocab_size=11, **{k: SMALL[k] for k in ("hidden", "heads", "kv_heads", "ffn_hidden", "norm",
                                                                   "eps", "activation", "positions", "rope_theta")})
    layers = [tpcore.ColumnParallelLinear(13, 7 + n, comm, gather_output=True, seed=1),
              tpcore.RowParallelLinear(13, 6, comm, input_is_parallel=False, seed=2),
              tpcore.ParallelMLP(10, 17, comm, seed=3),
              tpcore.VocabParallelEmbedding(19, 5, comm, seed=4),
              tpcore.TransformerBlock(cfg, comm, seed=5)]
    lin_c, lin_r, mlp, emb, blk = layers
    before = [_c_grads(m) for m in layers]
    lin_c(g.standard_normal((3, 13)).astype(np.float32))
    lin_r(g.standard_normal((3, 13)).astype(np.float32))
    mlp(g.standard_normal((2, 10)).astype(np.float32))
    emb(g.integers(0, 19, (2, 3)))
    blk(g.standard_normal((2, 4, 24)).astype(np.float32), need_backward=False)
    blk(g.standard_normal((2, 4, 24)).astype(np.float32))  # kept for a backward that never comes
    for m in layers[:2]:
        m.gather_full()
        m.weight_float()
    blk.gather_full()
    blk.load_full(blk.gather_full())
    after = [_c_grads(m) for m in layers]
    return [sorted(k for k, v in d.items() if v is not None) for d in before + after]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_layers_made_for_inference_hold_no_gradients(world):
    for r, held in enumerate(run(_inference_layers, world)):
        assert all(h == [] for h in held), f"rank {r}: gradients held by an inference-only layer: {held}"


def _inference_model(comm, path, name):
    cfg = tpcore.Config(**(SMALL if name == "llama" else GPT2))
    model = tpcore.models.TransformerLM(cfg, comm, seed=7)
    toks = rng_for(2, 0).integers(0, cfg.vocab_size, (2, 5))
    held = {}
    held["built"] = _model_grads(model)
    model.logits(toks)
    model.generate(toks, max_new_tokens=3)
    model.param_bytes()
    model.state_dict_full()
    model.save_pretrained(path)
    model.save_pretrained(path + "_sharded", sharded=True)
    held["used"] = _model_grads(model)
    loaded = tpcore.models.from_pretrained(path, comm, progress=False)
    loaded.generate(toks, max_new_tokens=2)
    held["loaded"] = _model_grads(loaded)
    sharded = tpcore.models.from_pretrained(path + "_sharded", comm, progress=False)
    held["loaded sharded"] = _model_grads(sharded)
    same = np.array_equal(sharded.logits(toks), model.logits(toks))
    return {k: sorted(n for n, g in v.items() if g is not None) for k, v in held.items()}, same


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_model_for_inference_holds_no_gradients(tmp_path, name):
    for r, (held, same) in enumerate(run(_inference_model, 2, str(tmp_path / "m"), name)):
        assert all(v == [] for v in held.values()), f"rank {r}: {held}"
        assert same, f"rank {r}: the sharded checkpoint (written from weights only) did not load back"


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _rss_case(comm):
    K, N = 2048, 3072  # a float32 weight of 24 MiB (a bias of 12 KiB)
    x = rng_for(1, 0).standard_normal((4, K)).astype(np.float32)
    warm = tpcore.ColumnParallelLinear(64, 64, comm)  # BLAS's own buffers come with its first GEMM: not counted
    warm(np.ascontiguousarray(x[:, :64]))
    del warm
    r0 = _rss()
    layer = tpcore.ColumnParallelLinear(K, N, comm, seed=3)
    r1 = _rss()
    layer(x)
    r2 = _rss()
    ps = layer.parameters()  # the gradients, zeroed: resident now
    r3 = _rss()
    zero_ok = all(not np.any(g) for _, g in ps)
    return layer.weight.nbytes, r1 - r0, r2 - r0, r3 - r2, zero_ok


@pytest.mark.skipif(os.environ.get("TPCORE_UNDER_SANITIZER") == "1",
                    reason="resident memory under ASan is the sanitizer's (shadow memory, quarantine)")
def test_resident_memory_of_an_inference_layer_is_its_weights():
    wbytes, built, used, grads, zero_ok = run_fresh("test_lazy_grads", "_rss_case", 1)[0]
    # a gradient allocated (and zeroed) with the weight would make this 2x the weight bytes
    assert 0.9 * wbytes <= built <= 1.25 * wbytes, (wbytes, built)
    assert used <= 1.35 * wbytes, (wbytes, used)  # a forward adds its small workspaces, no gradients
    assert 0.9 * wbytes <= grads <= 1.25 * wbytes, (wbytes, grads)
    assert zero_ok


def _grad_case(comm, early):
    """Gradients after backward against float64 references; early: parameters() (or zero_grad /
    grad_weight) before the first backward, whose zeroed buffers backward must then fill."""
    n, r = comm.size, comm.rank
    g = rng_for(40 + n, 0)  # the same full tensors on every rank
    IN, F, OUT, M = 11, 2 * n + 3, 7, 5
    mlp = tpcore.ParallelMLP(IN, F, comm, activation="gelu", seed=9)
    W1 = g.standard_normal((F, IN)).astype(np.float32) * 0.5
    b1 = g.standard_normal(F).astype(np.float32)
    W2 = g.standard_normal((IN, F)).astype(np.float32) * 0.5
    b2 = g.standard_normal(IN).astype(np.float32)
    mlp.fc1.load_full(W1, b1)
    mlp.fc2.load_full(W2, b2)
    lin = tpcore.RowParallelLinear(IN, OUT, comm, input_is_parallel=False, seed=2)
    W3 = g.standard_normal((OUT, IN)).astype(np.float32)
    b3 = g.standard_normal(OUT).astype(np.float32)
    lin.load_full(W3, b3)
    emb = tpcore.VocabParallelEmbedding(13, 4, comm, seed=1)
    x = g.standard_normal((M, IN)).astype(np.float32)
    dy = g.standard_normal((M, IN)).astype(np.float32)
    dz = g.standard_normal((M, OUT)).astype(np.float32)
    toks = g.integers(0, 13, M)
    de = g.standard_normal((M, 4)).astype(np.float32)
    bad, early_views = [], []
    if early:
        pairs = mlp.parameters() + lin.parameters()
        emb.zero_grad()
        pairs += [(emb.weight, emb.grad_weight)]
        for _, gr in pairs:
            if gr.shape and np.any(gr):
                bad.append("a gradient from parameters() / zero_grad() before backward is not zero")
        early_views = [gr for _, gr in pairs]
    mlp(x)
    mlp.backward(dy)
    lin(x)
    lin.backward(dz)
    emb(toks)
    emb.backward(de)
    # float64 references
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    h = x64 @ W1.T.astype(np.float64) + b1
    a = ref.act("gelu", h)
    da = dy64 @ W2.astype(np.float64)
    dh = da * (ref.act("gelu", h + 1e-6) - ref.act("gelu", h - 1e-6)) / 2e-6
    o1, l1 = mlp.fc1.offset, mlp.fc1.local
    o2, l2 = mlp.fc2.offset, mlp.fc2.local
    o3, l3 = lin.offset, lin.local
    want = {"fc1.w": (dh.T @ x64)[o1:o1 + l1], "fc1.b": dh.sum(0)[o1:o1 + l1],
            "fc2.w": (dy64.T @ a)[:, o2:o2 + l2], "fc2.b": dy64.sum(0),
            "lin.w": (dz.T.astype(np.float64) @ x64)[:, o3:o3 + l3], "lin.b": dz.sum(0)}
    dE = np.zeros((13, 4))
    np.add.at(dE, toks, de.astype(np.float64))
    want["emb.w"] = dE[emb.offset:emb.offset + emb.local]
    got = {"fc1.w": mlp.fc1.grad_weight, "fc1.b": mlp.fc1.grad_bias, "fc2.w": mlp.fc2.grad_weight,
           "fc2.b": mlp.fc2.grad_bias, "lin.w": lin.grad_weight, "lin.b": lin.grad_bias, "emb.w": emb.grad_weight}
    for k, w in want.items():
        gk = np.asarray(got[k], np.float64)
        if gk.shape != w.shape or not np.allclose(gk, w, rtol=2e-4, atol=2e-4):
            bad.append(f"{k}: {gk.shape} vs {w.shape}, off by "
                       f"{np.abs(gk - w).max() if gk.shape == w.shape else None}")
    if early:  # the buffers handed out before backward are the ones backward filled
        now = [gr for _, gr in mlp.parameters() + lin.parameters() + emb.parameters()]
        same = [np.shares_memory(e, v) or e.size == 0 for e, v in zip(early_views, now)]
        if len(now) != len(early_views) or not all(same):
            bad.append(f"backward filled other buffers than parameters() handed out: {same}")
    return r, bad


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("early", [False, True], ids=["first-backward", "parameters-first"])
def test_gradients_after_backward_match_float64(world, early):
    for r, bad in run(_grad_case, world, early):
        assert not bad, f"rank {r}: {bad}"


def _block_case(comm, early):
    """A block's gradients: made by the first backward (or zeroed by parameters() first), checked
    by directional derivatives of the float64 reference block."""
    cfg = tpcore.Config(vocab_size=10, **{k: SMALL[k] for k in ("hidden", "heads", "kv_heads", "ffn_hidden", "norm",
                                                                   "eps", "activation", "positions", "rope_theta",
                                                                   "causal", "pre_norm", "bias")})
    blk = tpcore.TransformerBlock(cfg, comm, seed=4)
    g = rng_for(17, 0)
    P = {k: (g.standard_normal(s) * (0.3 if k.endswith("weight") else 0.2)).astype(np.float32)
         for k, s in blk.full_shapes().items()}
    blk.load_full(P)
    errs = []
    if early:
        ps = blk.parameters()
        if not ps or any(np.any(gr) for _, gr in ps) or any(gr is None for _, gr in ps):
            errs.append("parameters() before backward did not give zeroed gradients")
    B, T = 2, 5
    x = g.standard_normal((B, T, cfg.hidden)).astype(np.float32)
    R = g.standard_normal((B, T, cfg.hidden))
    blk(x)
    dx = blk.backward(R.astype(np.float32))
    grads = blk.gather_full(grads=True)
    P64 = {k: v.astype(np.float64) for k, v in P.items()}

    def loss(xx, pp):
        return float((ref.block(cfg, pp, xx) * R).sum())

    errs += ref.directional_errors(loss, x.astype(np.float64), P64, dx, grads, P, g)
    if early and any(not np.any(gr) for _, gr in ps if gr.size):
        errs.append("backward did not fill the buffers parameters() handed out")
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("early", [False, True], ids=["first-backward", "parameters-first"])
def test_block_gradients_on_demand(world, early):
    for r, errs in enumerate(run(_block_case, world, early)):
        assert not errs, f"rank {r}: {errs}"


def _model_train_case(comm, name):
    """TransformerLM: parameters() before any backward gives zeroed gradients (the model's
    own position embeddings and norms included); loss + backward fill those buffers, and an
    optimizer made before the first backward trains."""
    cfg = tpcore.Config(**(SMALL if name == "llama" else GPT2))
    model = tpcore.models.TransformerLM(cfg, comm, seed=3)
    toks = rng_for(4, 0).integers(0, cfg.vocab_size, (2, 6))
    ps = model.parameters()
    errs = []
    if any(np.any(gr) for _, gr in ps):
        errs.append("parameters() gave a non-zero gradient before any backward")
    missing = [k for k, v in _model_grads(model).items() if v is None and (k not in ("wpe", "tte") or
                                                                          getattr(model, k) is not None)]
    if missing:
        errs.append(f"gradients missing after parameters(): {missing}")
    opt = tpcore.optim.AdamW(ps, lr=1e-2)
    first = model.loss(toks[:, :-1], toks[:, 1:])
    model.backward()
    if not all(np.any(gr) for _, gr in ps if gr.size):
        errs.append("backward left a gradient handed out by parameters() at zero")
    for _ in range(5):
        opt.step()
        model.zero_grad()
        model.loss(toks[:, :-1], toks[:, 1:])
        model.backward()
    last = model.loss(toks[:, :-1], toks[:, 1:])
    if not last < first:
        errs.append(f"the loss did not fall: {first} -> {last}")
    return errs


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_model_parameters_before_backward(name):
    for r, errs in enumerate(run(_model_train_case, 2, name)):
        assert not errs, f"rank {r}: {errs}"


def _quant_case(comm):
    """Quantized weights are frozen: no gradient from backward, parameters(), zero_grad(),
    grad_weight or named_parameters(); their biases and norms still train."""
    errs = []
    lin = tpcore.ColumnParallelLinear(64, 6, comm, dtype="q8_0", seed=1)
    x = rng_for(3, 0).standard_normal((3, 64)).astype(np.float32)
    y = lin(x)
    lin.backward(np.ones_like(y))
    ps = lin.parameters()
    lin.zero_grad()
    if lin.grad_weight is not None or lin._c.grad_weight is not None:
        errs.append("a quantized linear weight has a gradient")
    if len(ps) != 1 or not np.shares_memory(ps[0][0], lin.bias):
        errs.append(f"parameters() of a quantized linear: {len(ps)} pairs, expected only the bias")
    emb = tpcore.VocabParallelEmbedding(20, 32, comm, dtype="q4_1", seed=2)
    emb(np.arange(5))
    emb.backward(np.ones((5, 32), np.float32))
    if emb.parameters() or emb.grad_weight is not None or emb._c.grad_weight is not None:
        errs.append("a quantized table has a gradient")
    cfg = tpcore.Config(**dict(SMALL, hidden=64, heads=2, kv_heads=2, ffn_hidden=64, vocab_size=64))
    model = tpcore.models.TransformerLM(cfg, comm, seed=2, dtype="q8_0")
    frozen = len(model._frozen())
    nbytes = model.param_bytes()
    toks = rng_for(5, 0).integers(0, 64, (1, 4))
    model.loss(toks[:, :-1], toks[:, 1:])
    model.backward()
    if _model_grads(model)["blocks.0.attn.qkv.weight"] is not None:
        errs.append("a quantized QKV weight got a gradient in backward")
    named = model.blocks[0].named_parameters()
    quant = [k for k, (_, gr) in named.items() if gr is None]
    if sorted(quant) != sorted(["attn.qkv.weight", "attn.out.weight", "mlp.fc1.weight", "mlp.fc2.weight"]):
        errs.append(f"the frozen weights of a q8_0 block: {quant}")
    trained = [p for p, _ in model.parameters()]
    if any(np.shares_memory(w, p) for w in model._frozen() for p in trained) or frozen != len(model._frozen()) or \
            model.param_bytes() != nbytes:
        errs.append("a frozen weight in parameters(), or param_bytes / _frozen changed with the gradients")
    return errs


@pytest.mark.parametrize("world", [1, 2])
def test_quantized_weights_never_get_a_gradient(world):
    for r, errs in enumerate(run(_quant_case, world)):
        assert not errs, f"rank {r}: {errs}"


def test_alloc_grads_takes_no_arguments():
    def case(comm):
        lin = tpcore.ColumnParallelLinear(4, 4, comm)
        try:
            lin._c.alloc_grads(1)
        except TypeError as e:
            return str(e)
        return None
    msg = run(case, 1)[0]
    assert msg is not None and "alloc_grads" in msg and "no arguments" in msg


CUDA = getattr(tpcore, "cuda_available", lambda: False)()


def _gpu_case(comm):
    """On a GPU: nothing after create or forward, then the CPU layers' gradients after backward."""
    g = rng_for(8, 0)
    cfg = tpcore.Config(vocab_size=11, **{k: SMALL[k] for k in ("hidden", "heads", "kv_heads", "ffn_hidden", "norm",
                                                                   "eps", "activation", "positions", "rope_theta")})
    pairs = [(tpcore.ParallelMLP(10, 17, comm, seed=3), tpcore.ParallelMLP(10, 17, comm, seed=3, device="cuda")),
             (tpcore.TransformerBlock(cfg, comm, seed=5), tpcore.TransformerBlock(cfg, comm, seed=5, device="cuda"))]
    xs = [g.standard_normal((3, 10)).astype(np.float32), g.standard_normal((1, 3, 24)).astype(np.float32)]
    held, off = [], []
    for (cpu, gpu), x in zip(pairs, xs):
        held.append(sorted(k for k, v in _c_grads(gpu).items() if v is not None))
        y = gpu(tpcore.asarray(x, device="cuda"))
        held.append(sorted(k for k, v in _c_grads(gpu).items() if v is not None))
        cpu(x)
        dy = g.standard_normal(x.shape).astype(np.float32)
        cpu.backward(dy)
        gpu.backward(tpcore.asarray(dy, device="cuda"))
        del y
        for k, gc in _c_grads(cpu).items():
            gg = _c_grads(gpu)[k]
            gg = None if gg is None else gg.to_numpy()
            if gg is None or not np.allclose(gg, gc, rtol=1e-4, atol=1e-4):
                off.append(k)
    return held, off


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (tpcore.cuda_available() is False)")
def test_gpu_layers_allocate_gradients_in_backward():
    held, off = run(_gpu_case, 1, start_method="spawn")[0]
    assert all(h == [] for h in held), held
    assert not off, f"GPU gradients that differ from the CPU layer's: {off}"


def _nomem_case(comm):
    """The gradients of a layer that do not fit: a MemoryError naming the layer and the bytes,
    nothing half-made (still no gradient), and a later call with room succeeds."""
    import resource

    def vmsize():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    lin = tpcore.ColumnParallelLinear(2048, 3072, comm)  # 24 MiB of weights; 24 MiB more will not fit
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vmsize() + (8 << 20), hard))
    out = []
    try:
        lin.parameters()
        out.append(None)
    except MemoryError as e:
        out.append((str(e), lin._c.grad_weight is None))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    ps = lin.parameters()
    out.append(len(ps) == 2 and not np.any(ps[0][1]))
    return out


def test_gradients_that_do_not_fit_raise_memory_error():
    # in a fresh interpreter: a rank forked from pytest inherits its heap, whose free chunks could
    # hold the gradients without the address space growing
    import json
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json, sys, tpcore; sys.path.insert(0, %r); import test_lazy_grads as t; "
            "print(json.dumps(tpcore.spawn(t._nomem_case, 1)[0]))" % here)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert r.returncode == 0, r.stderr[-2000:]
    (msg, still_none), ok_later = json.loads(r.stdout.strip().splitlines()[-1])
    assert "linear" in msg and "gradients" in msg and str(3072 * 2048 * 4 + 3072 * 4) in msg, msg
    assert still_none and ok_later
