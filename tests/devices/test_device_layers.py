"""device= on VocabParallelEmbedding, VocabParallelCrossEntropy, ParallelAttention and
TransformerBlock.  Here (any machine): device="cpu" is the default behaviour, and
device="cuda" without CUDA is a clear error naming the class.  On a GPU: the layers
against the float64 NumPy references of test_vocab.py / test_transformer.py
(reference_transformer.py), the CPU layer with the same parameters, device arrays in
and out, parameters as DeviceArray views, and a tensor on the wrong device refused
with a TypeError naming the layer, the argument and both devices."""
import numpy as np
import pytest

import tpcore
import reference_transformer as ref
from conftest import rng_for, run

_params = ref.random_block_params  # the CPU tests' random block parameters

CUDA = getattr(tpcore, "cuda_available", lambda: False)()
NEEDS_GPU = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (tpcore.cuda_available() is False)")


def gpu_run(fn, *args):
    """fn(comm, *args) at world 1 in a fresh interpreter ("spawn"): this process has CUDA
    initialised (cuda_available above), which a forked child could not use."""
    return run(fn, 1, *args, start_method="spawn")[0]

VOCAB, DIM = 37, 6
BLOCKS = {
    "gpt2": dict(hidden=24, heads=6, ffn_hidden=40, norm="layernorm", activation="gelu_tanh", positions="none",
                 causal=True, pre_norm=True, bias=True),
    "llama_gqa": dict(hidden=24, heads=6, kv_heads=2, head_dim=6, ffn_hidden=36, norm="rmsnorm", activation="swiglu",
                      positions="rope", rope_theta=500.0, causal=True, pre_norm=True, bias=False, eps=1e-6),
}
CLASSES = ("VocabParallelEmbedding", "VocabParallelCrossEntropy", "ParallelAttention", "TransformerBlock")


def _make(name, comm, device, **kw):
    cfg = tpcore.Config(vocab_size=16, **BLOCKS["gpt2"])
    if name == "VocabParallelEmbedding":
        return tpcore.VocabParallelEmbedding(VOCAB, DIM, comm, seed=3, device=device, **kw)
    if name == "VocabParallelCrossEntropy":
        return tpcore.VocabParallelCrossEntropy(comm, device=device, **kw)
    return getattr(tpcore, name)(cfg, comm, seed=4, device=device, **kw)


def _xent_reference(logits, targets):
    """float64 losses and softmax of the full vocabulary (test_vocab.py's reference)."""
    l64 = logits.astype(np.float64)
    mx = l64.max(-1, keepdims=True)
    lse = np.log(np.exp(l64 - mx).sum(-1)) + mx[..., 0]
    per = lse - np.take_along_axis(l64, targets[..., None], -1)[..., 0]
    onehot = np.zeros_like(l64)
    np.put_along_axis(onehot, targets[..., None], 1.0, -1)
    return per, np.exp(l64 - lse[..., None]) - onehot


# --------------------------------------------------------------- every machine

def _cpu_explicit(comm):
    """device=None and device="cpu" give the same layer and the same numbers."""
    g = rng_for(2, 0)
    tokens = g.integers(0, VOCAB, (2, 5))
    out = {}
    for dev in (None, "cpu", "cpu:0"):
        emb = tpcore.VocabParallelEmbedding(VOCAB, DIM, comm, seed=3, device=dev)
        y = emb(tokens)
        emb.backward(np.ones_like(y))
        xent = tpcore.VocabParallelCrossEntropy(comm, device=dev)
        logits = np.ascontiguousarray(np.repeat(y[..., :1], 4, -1) + np.arange(4, dtype=np.float32))
        loss = xent(logits, tokens % (4 * comm.size), reduction="sum")  # the same targets on every rank
        cfg = tpcore.Config(vocab_size=16, **BLOCKS["llama_gqa"])
        blk = tpcore.TransformerBlock(cfg, comm, seed=5, device=dev)
        att = tpcore.ParallelAttention(cfg, comm, seed=5, device=dev)
        x = g.standard_normal((1, 3, cfg.hidden)).astype(np.float32) if dev is None else out[None][5]
        yb, ya = blk(x), att(x)
        out[dev] = (y, np.array(emb.grad_weight), loss, type(emb.weight), type(blk.parameters()[0][0]), x, yb, ya,
                    blk.backward(np.ones_like(yb)))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_device_is_the_default_behaviour(world):
    for res in run(_cpu_explicit, world):
        base = res[None]
        assert base[3] is np.ndarray and base[4] is np.ndarray
        for dev in ("cpu", "cpu:0"):
            got = res[dev]
            for i, (a, b) in enumerate(zip(base, got)):
                if isinstance(a, np.ndarray):
                    np.testing.assert_array_equal(a, b, err_msg=f"{dev} item {i}")
                else:
                    assert a == b, (dev, i, a, b)


def _build_all(comm, device):
    res = {}
    for name in CLASSES:
        try:
            _make(name, comm, device)
            res[name] = ("ok", "")
        except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
            res[name] = (type(e).__name__, str(e))
    return res


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_cuda_is_a_clear_error(device):
    for name, (etype, msg) in run(_build_all, 1, device)[0].items():
        assert etype == "RuntimeError", (name, etype, msg)
        assert msg.startswith(f"{name}: device 'cuda:") and "CUDA is not available" in msg, (name, msg)


def test_unknown_device_is_named():
    for name, (etype, msg) in run(_build_all, 1, "tpu")[0].items():
        assert etype == "ValueError" and msg.startswith(f"{name}: device 'tpu' is not known"), (name, msg)


def test_device_must_be_a_string():
    for name, (etype, msg) in run(_build_all, 1, 3)[0].items():
        assert etype == "TypeError" and msg.startswith(f"{name}: device must be a string"), (name, msg)


# ------------------------------------------------------------------ on a GPU

def _wrong_device(call):
    try:
        call()
    except TypeError as e:
        return str(e)
    return "no error"


def _cuda_embedding(comm):
    g = rng_for(5, 0)
    table = g.standard_normal((VOCAB, DIM)).astype(np.float32)
    tokens = g.integers(0, VOCAB, (3, 17))
    tokens[0, :3] = [0, VOCAB - 1, 0]
    dout = g.standard_normal((3, 17, DIM)).astype(np.float32)
    emb = tpcore.VocabParallelEmbedding(VOCAB, DIM, comm, seed=3, device="cuda")
    emb.load_full(table)
    assert isinstance(emb.weight, tpcore.DeviceArray) and emb.weight.device.startswith("cuda")
    y = emb(tpcore.asarray(tokens, device="cuda"))
    assert isinstance(y, tpcore.DeviceArray) and y.shape == (3, 17, DIM) and y.device.startswith("cuda")
    emb.zero_grad()
    emb.backward(tpcore.asarray(dout, device="cuda"))
    ref_d = np.zeros((VOCAB, DIM))
    np.add.at(ref_d, tokens.reshape(-1), dout.reshape(-1, DIM).astype(np.float64))
    errs = [_wrong_device(lambda: emb(tokens)), _wrong_device(lambda: emb.backward(dout)),
            _wrong_device(lambda: emb(tpcore.asarray(tokens.astype(np.int32), device="cuda")))]
    return (y.to_numpy(), table[tokens], emb.grad_weight.to_numpy(), ref_d[emb.offset:emb.offset + emb.local],
            emb.gather_full(), table, errs)


@pytest.mark.gpu
@NEEDS_GPU
def test_cuda_embedding_matches_float64_reference():
    y, y_ref, gw, gw_ref, full, table, errs = gpu_run(_cuda_embedding)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_allclose(gw, gw_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(full, table)
    assert "VocabParallelEmbedding: tokens is on cpu:0 but the layer is on cuda:" in errs[0], errs
    assert "VocabParallelEmbedding: dout is on cpu:0 but the layer is on cuda:" in errs[1], errs
    assert "int64" in errs[2], errs


def _cuda_xent(comm, reduction):
    g = rng_for(11, 0)
    logits = (g.standard_normal((2, 9, VOCAB)) * 4).astype(np.float32)
    logits[1] += 1e4
    targets = g.integers(0, VOCAB, (2, 9))
    dloss = g.standard_normal((2, 9)).astype(np.float32) if reduction == "none" else 0.7
    xent = tpcore.VocabParallelCrossEntropy(comm, device="cuda")
    ld = tpcore.asarray(logits, device="cuda")
    loss = xent(ld, tpcore.asarray(targets, device="cuda"), reduction=reduction)
    d = xent.backward(tpcore.asarray(dloss, device="cuda") if reduction == "none" else dloss)
    assert isinstance(d, tpcore.DeviceArray) and d.shape == logits.shape
    loss = loss.to_numpy() if isinstance(loss, tpcore.DeviceArray) else loss
    errs = [_wrong_device(lambda: xent(logits, tpcore.asarray(targets, device="cuda"))),
            _wrong_device(lambda: xent(ld, targets))]
    return loss, d.to_numpy(), logits, targets, dloss, errs


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cuda_cross_entropy_matches_float64_reference(reduction):
    loss, d, logits, targets, dloss, errs = gpu_run(_cuda_xent, reduction)
    per, dref = _xent_reference(logits, targets)
    ref_loss = per if reduction == "none" else per.mean() if reduction == "mean" else per.sum()
    scale = (np.asarray(dloss)[..., None] if reduction == "none" else
             dloss / per.size if reduction == "mean" else dloss)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d, dref * scale, rtol=1e-4, atol=1e-6)
    assert "logits_shard is on cpu:0 but the layer is on cuda:" in errs[0], errs
    assert "targets is on cpu:0 but the layer is on cuda:" in errs[1], errs


def _cuda_block(comm, name, attention_only):
    cfg = tpcore.Config(vocab_size=10, **BLOCKS[name])
    cls = tpcore.ParallelAttention if attention_only else tpcore.TransformerBlock
    cpu, gpu = cls(cfg, comm, seed=4), cls(cfg, comm, seed=4, device="cuda")
    g = rng_for(31, 0)
    P = _params(cpu, g)
    cpu.load_full(P)
    gpu.load_full(P)
    assert all(isinstance(p, tpcore.DeviceArray) for p, _ in gpu.parameters())
    B, T = 2, 6
    x = g.standard_normal((B, T, cfg.hidden)).astype(np.float32)
    R = g.standard_normal((B, T, cfg.hidden)).astype(np.float32)
    yc, yg = cpu(x), gpu(tpcore.asarray(x, device="cuda"))
    assert isinstance(yg, tpcore.DeviceArray) and yg.shape == (B, T, cfg.hidden)
    dxc, dxg = cpu.backward(R), gpu.backward(tpcore.asarray(R, device="cuda"))
    gc, gg = cpu.gather_full(grads=True), gpu.gather_full(grads=True)
    full = gpu.gather_full()
    P64 = {k: v.astype(np.float64) for k, v in P.items()}
    if attention_only:
        y_ref = ref.attention(cfg, P64, x.astype(np.float64), np.broadcast_to(np.arange(T), (B, T)))
    else:
        y_ref = ref.block(cfg, P64, x.astype(np.float64))
    errs = [_wrong_device(lambda: gpu(x)), _wrong_device(lambda: gpu.backward(R))]
    return yg.to_numpy(), y_ref, yc, dxg.to_numpy(), dxc, gg, gc, full, P, errs


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
@pytest.mark.parametrize("attention_only", [False, True], ids=["block", "attention"])
def test_cuda_block_matches_float64_reference_and_the_cpu_block(name, attention_only):
    yg, y_ref, yc, dxg, dxc, gg, gc, full, P, errs = gpu_run(_cuda_block, name, attention_only)
    np.testing.assert_allclose(yg, y_ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(yg, yc, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(dxg, dxc, rtol=1e-3, atol=1e-3)
    for k in gc:
        np.testing.assert_allclose(gg[k], gc[k], rtol=1e-3, atol=1e-3, err_msg=k)
    for k in P:
        np.testing.assert_array_equal(full[k], P[k], err_msg=k)
    who = "ParallelAttention" if attention_only else "TransformerBlock"
    assert f"{who}: x is on cpu:0 but the layer is on cuda:" in errs[0], errs
    assert f"{who}: dy is on cpu:0 but the layer is on cuda:" in errs[1], errs


def _cuda_cache(comm, name):
    cfg = tpcore.Config(vocab_size=10, **BLOCKS[name])
    blk = tpcore.TransformerBlock(cfg, comm, seed=5, device="cuda")
    g = rng_for(8, 0)
    B, T = 2, 7
    x = g.standard_normal((B, T, cfg.hidden)).astype(np.float32)
    full = blk(tpcore.asarray(x, device="cuda"), need_backward=False).to_numpy()
    blk.cache(B, 10)
    out = np.zeros_like(full)
    out[:, :4] = blk(tpcore.asarray(x[:, :4], device="cuda"), use_cache=True, need_backward=False).to_numpy()
    for t in range(4, T):
        out[:, t:t + 1] = blk(tpcore.asarray(x[:, t:t + 1], device="cuda"), pos0=[t, t], use_cache=True,
                              need_backward=False).to_numpy()
    return out, full


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_cuda_kv_cache_decode_equals_full_recompute(name):
    out, full = gpu_run(_cuda_cache, name)
    np.testing.assert_allclose(out, full, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ the model

MODELS = {
    "gpt2_tied": dict(vocab_size=29, hidden=24, layers=2, heads=6, ffn_hidden=40, max_positions=32),
    "llama_untied": dict(vocab_size=29, hidden=24, layers=2, heads=6, kv_heads=2, head_dim=6, ffn_hidden=36,
                         norm="rmsnorm", activation="swiglu", positions="rope", bias=False, tie_embeddings=False,
                         eps=1e-6, max_positions=32),
}


def _model_without_cuda(comm, device):
    try:
        tpcore.models.TransformerLM(tpcore.Config(**MODELS["gpt2_tied"]), comm, device=device)
        return "ok", ""
    except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
        return type(e).__name__, str(e)


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
def test_model_on_cuda_without_cuda_is_a_clear_error():
    etype, msg = run(_model_without_cuda, 1, "cuda")[0]
    assert etype == "RuntimeError" and msg.startswith("TransformerLM: device 'cuda:") and \
        "CUDA is not available" in msg, (etype, msg)


def _cuda_model(comm, name):
    cfg = tpcore.Config(**MODELS[name])
    cpu = tpcore.models.TransformerLM(cfg, comm, seed=3)
    gpu = tpcore.models.TransformerLM(cfg, comm, seed=8, device="cuda")
    gpu.load_state_dict_full(cpu.state_dict_full())  # host tensors copied to the GPU
    sd_c, sd_g = cpu.state_dict_full(), gpu.state_dict_full()
    tokens = rng_for(4, 0).integers(0, cfg.vocab_size, (2, 5))
    lc, lg = cpu.logits(tokens), gpu.logits(tokens)
    prompts = [tokens[0], tokens[1, :3]]
    gc_, gg = cpu.generate(prompts, max_new_tokens=6), gpu.generate(prompts, max_new_tokens=6)
    try:
        gpu.loss(tokens, tokens)
        refused = "no error"
    except NotImplementedError as e:
        refused = str(e)
    return lc, lg, [a.tolist() for a in gc_], [a.tolist() for a in gg], \
        all(np.array_equal(sd_c[k], sd_g[k]) for k in sd_c), refused


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_model_logits_and_generate_match_the_cpu_model(name):
    lc, lg, gen_c, gen_g, same_sd, refused = gpu_run(_cuda_model, name)
    np.testing.assert_allclose(lg, lc, rtol=1e-3, atol=1e-3)
    assert gen_g == gen_c
    assert same_sd
    assert "training on device='cuda:" in refused, refused
