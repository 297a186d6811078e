"""Low-precision weights (dtype="bfloat16" / "float16") in every layer, block and model:
the weight is stored in 16 bits, everything else stays float32 and every product is
accumulated in float32.  Checked against float64 NumPy references computed from the
16-bit weights themselves (widened exactly), at every world size 1 to 4, with odd and
uneven sizes and fresh random inputs; a 16-bit layer's seeded weights are the float32
layer's rounded to nearest even (ml_dtypes' / NumPy's casts, bit for bit); mixed-precision
optimizers keep float32 masters."""
import json
import os

import numpy as np
import pytest

import tpcore
import reference_transformer as ref
from conftest import BF16, WORLDS, rng_for, run
from test_transformer import CONFIGS, _params

pytestmark = pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes (the test extra)")
LOWP = ["bfloat16", "float16"]


def _np(dt):
    return BF16 if dt == "bfloat16" else np.dtype(dt)


def _round(a, dt):
    """a rounded to dt and widened back (float64): what a 16-bit layer holds."""
    return np.asarray(a, np.float32).astype(_np(dt)).astype(np.float64)


# ------------------------------------------------------------------ linear layers

def _linear_case(comm, kind, dt, uneven, bias):
    g = rng_for(41, 0)  # the same full tensors on every rank
    K, N, M = 37, 29, 5
    split = N if kind == "column" else K
    part = [s for _, s in tpcore.partition(split, comm.size, weights=[1 + r for r in range(comm.size)])] \
        if uneven else None
    cls = tpcore.ColumnParallelLinear if kind == "column" else tpcore.RowParallelLinear
    kw = dict(gather_output=True) if kind == "column" else dict(input_is_parallel=False)
    lay = cls(K, N, comm, bias=bias, partition=part, dtype=dt, seed=5, **kw)
    l32 = cls(K, N, comm, bias=bias, partition=part, seed=5, **kw)
    errs = []
    if lay.weight.dtype != _np(dt) or lay.grad_weight.dtype != np.float32 or lay.dtype != dt:
        errs.append(f"dtypes: weight {lay.weight.dtype}, grad {lay.grad_weight.dtype}, dtype {lay.dtype}")
    if lay.weight.nbytes * 2 != l32.weight.nbytes:
        errs.append(f"the {dt} weight takes {lay.weight.nbytes} bytes, the float32 one {l32.weight.nbytes}")
    # the seeded init: the float32 layer's values, rounded to nearest even (bit for bit)
    if not np.array_equal(lay.weight.view(np.uint16), l32.weight.astype(_np(dt)).view(np.uint16)):
        errs.append("seeded weights are not the float32 layer's rounded")
    W = (g.standard_normal((N, K)) * 0.5).astype(np.float32)
    b = g.standard_normal(N).astype(np.float32) if bias else None
    lay.load_full(W, b)
    W16 = _round(W, dt)
    full, bfull = lay.gather_full()
    if full.dtype != _np(dt) or not np.array_equal(full.astype(np.float64), W16):
        errs.append("gather_full does not give back the rounded weight")
    x = g.standard_normal((M, K)).astype(np.float32)
    dy = g.standard_normal((M, N)).astype(np.float32)
    y = lay(x)
    y_ref = x.astype(np.float64) @ W16.T + (b if bias else 0)
    tol = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(W16).T + 1)
    if not (np.abs(y - y_ref) <= tol).all():
        errs.append(f"y off by {np.abs(y - y_ref).max():.2e}")
    dx = lay.backward(dy)
    dx_ref = dy.astype(np.float64) @ W16
    if not np.allclose(dx, dx_ref, rtol=1e-5, atol=1e-5):
        errs.append(f"dx off by {np.abs(dx - dx_ref).max():.2e}")
    dW_ref = dy.astype(np.float64).T @ x.astype(np.float64)
    if kind == "column":
        rows = np.arange(lay.offset, lay.offset + lay.local)
        want = dW_ref[rows]
    else:
        want = dW_ref[:, lay.offset:lay.offset + lay.local]
    if not np.allclose(lay.grad_weight, want, rtol=1e-5, atol=1e-5):
        errs.append(f"grad_weight off by {np.abs(lay.grad_weight - want).max():.2e}")
    if bias:
        db_ref = dy.astype(np.float64).sum(0)
        db_want = db_ref[lay.offset:lay.offset + lay.local] if kind == "column" else db_ref
        if not np.allclose(lay.grad_bias, db_want, rtol=1e-5, atol=1e-5):
            errs.append("grad_bias off")
    return errs


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("dt", LOWP)
def test_linear_with_16_bit_weights_matches_float64_reference(world, kind, dt):
    for uneven, bias in ((False, True), (True, False)):
        for r, errs in enumerate(run(_linear_case, world, kind, dt, uneven, bias)):
            assert not errs, f"rank {r} (uneven={uneven}, bias={bias}): {errs}"


def _decode_case(comm, dt):
    """M = 1 and 2 (the decode path), several output widths, against float64."""
    errs = []
    for K, N in ((64, 97), (130, 33), (1, 7)):
        lay = tpcore.ColumnParallelLinear(K, N, comm, gather_output=True, dtype=dt, seed=K)
        W16 = lay.gather_full()[0].astype(np.float64)
        bias = lay.gather_full()[1].astype(np.float64)
        for M in (1, 2, 3):
            x = rng_for(7 + M, 0).standard_normal((M, K)).astype(np.float32)
            y = lay(x)
            y_ref = x.astype(np.float64) @ W16.T + bias
            tol = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(W16).T + 1)
            if not (np.abs(y - y_ref) <= tol).all():
                errs.append(f"K={K} N={N} M={M}: off by {np.abs(y - y_ref).max():.2e}")
    return errs


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("dt", LOWP)
def test_decode_sized_rows(world, dt):
    for r, errs in enumerate(run(_decode_case, world, dt)):
        assert not errs, f"rank {r}: {errs}"


# --------------------------------------------------------------------- the MLP

def _mlp_case(comm, act, dt):
    g = rng_for(43, 0)
    C, F, M = 24, 35, 7
    part = [s for _, s in tpcore.partition(F, comm.size, weights=[2 + r for r in range(comm.size)])]
    mlp = tpcore.ParallelMLP(C, F, comm, activation=act, partition=part, dtype=dt, seed=3)
    gated = act == "swiglu"
    W1 = (g.standard_normal(((2 if gated else 1) * F, C)) * 0.3).astype(np.float32)
    b1 = g.standard_normal((2 if gated else 1) * F).astype(np.float32) * 0.1
    W2 = (g.standard_normal((C, F)) * 0.3).astype(np.float32)
    b2 = g.standard_normal(C).astype(np.float32) * 0.1
    mlp.fc1.load_full(W1, b1)
    mlp.fc2.load_full(W2, b2)
    x = g.standard_normal((M, C)).astype(np.float32)
    y = mlp(x)
    W1r, W2r = _round(W1, dt), _round(W2, dt)
    h = x.astype(np.float64) @ W1r.T + b1
    a = ref.act(act, h)
    y_ref = a @ W2r.T + b2
    errs = []
    if mlp.fc1.weight.dtype != _np(dt) or mlp.fc2.weight.dtype != _np(dt):
        errs.append(f"fc weights are {mlp.fc1.weight.dtype} / {mlp.fc2.weight.dtype}")
    if not np.allclose(y, y_ref, rtol=1e-4, atol=1e-4):
        errs.append(f"y off by {np.abs(y - y_ref).max():.2e}")
    return errs


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("act,dt", [("gelu", "bfloat16"), ("swiglu", "float16"), ("swiglu", "bfloat16")])
def test_mlp_with_16_bit_weights(world, act, dt):
    for r, errs in enumerate(run(_mlp_case, world, act, dt)):
        assert not errs, f"rank {r}: {errs}"


# ------------------------------------------------------------------ the block

def _block_case(comm, name, dt):
    cfg = tpcore.Config(vocab_size=10, **CONFIGS[name])
    hp = tpcore.nn.config.head_partition(cfg, comm.size, weights=[1 + 2 * (r % 2) for r in range(comm.size)])
    blk = tpcore.TransformerBlock(cfg, comm, seed=4, head_partition=hp, dtype=dt)
    g = rng_for(47, 0)
    P = _params(blk, g)
    blk.load_full(P)
    lowp = {k for k in P if k.endswith("weight") and not k.startswith("norm")}
    P64 = {k: (_round(v, dt) if k in lowp else v.astype(np.float64)) for k, v in P.items()}
    B, T = 2, 5
    x = g.standard_normal((B, T, cfg.hidden)).astype(np.float32)
    R = g.standard_normal((B, T, cfg.hidden))
    y = blk(x)
    dx = blk.backward(R.astype(np.float32))
    grads = blk.gather_full(grads=True)
    full = blk.gather_full()
    errs = []
    for k, (p, gr) in blk.named_parameters().items():
        want = _np(dt) if k in ("attn.qkv.weight", "attn.out.weight", "mlp.fc1.weight", "mlp.fc2.weight") \
            else np.float32
        if p.dtype != want or gr.dtype != np.float32:
            errs.append(f"{k}: {p.dtype} with grad {gr.dtype}")
    for k in P:
        if not np.array_equal(full[k].astype(np.float64), P64[k]):
            errs.append(f"gather_full({k}) is not the loaded tensor{' rounded' if k in lowp else ''}")
    y_ref = ref.block(cfg, P64, x.astype(np.float64))
    if not np.allclose(y, y_ref, rtol=1e-4, atol=1e-4):
        errs.append(f"y off by {np.abs(y - y_ref).max():.2e}")

    def loss(xx, pp):
        return float((ref.block(cfg, pp, xx) * R).sum())
    errs += ref.directional_errors(loss, x.astype(np.float64), P64, dx, grads, sorted(lowp), g)
    return errs


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name,dt", [("gpt2", "bfloat16"), ("llama_gqa", "bfloat16"), ("llama_gqa", "float16")])
def test_block_with_16_bit_weights(world, name, dt):
    for r, errs in enumerate(run(_block_case, world, name, dt)):
        assert not errs, f"rank {r}: {errs}"


# -------------------------------------------------------------- embedding, model

def _embedding_case(comm, dt):
    V, C = 41, 6
    part = [s for _, s in tpcore.partition(V, comm.size, weights=[1 + r for r in range(comm.size)])]
    emb = tpcore.VocabParallelEmbedding(V, C, comm, partition=part, seed=9, dtype=dt)
    e32 = tpcore.VocabParallelEmbedding(V, C, comm, partition=part, seed=9)
    errs = []
    if not np.array_equal(emb.weight.view(np.uint16), e32.weight.astype(_np(dt)).view(np.uint16)):
        errs.append("seeded table is not the float32 one rounded")
    g = rng_for(53, 0)
    table = g.standard_normal((V, C)).astype(np.float32)
    emb.load_full(table)
    tokens = g.integers(0, V, (3, 4))
    y = emb(tokens)
    if not np.array_equal(y, _round(table, dt)[tokens].astype(np.float32)):
        errs.append("lookup is not the rounded table's rows")
    dy = g.standard_normal(y.shape).astype(np.float32)
    emb.backward(dy)
    want = np.zeros((V, C))
    np.add.at(want, tokens.reshape(-1), dy.reshape(-1, C).astype(np.float64))
    if emb.grad_weight.dtype != np.float32 or \
            not np.allclose(emb.grad_weight, want[emb.offset:emb.offset + emb.local], rtol=1e-6, atol=1e-6):
        errs.append("grad_weight off")
    return errs


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dt", LOWP)
def test_embedding_with_16_bit_table(world, dt):
    for r, errs in enumerate(run(_embedding_case, world, dt)):
        assert not errs, f"rank {r}: {errs}"


MODEL = dict(vocab_size=53, hidden=24, layers=2, heads=6, kv_heads=2, head_dim=4, ffn_hidden=36, norm="rmsnorm",
             activation="swiglu", positions="rope", max_positions=64, bias=False, model_type="llama")


def _model_case(comm, dt, tie):
    cfg = tpcore.Config(tie_embeddings=tie, **MODEL)
    m16 = tpcore.models.TransformerLM(cfg, comm, seed=11, dtype=dt)
    sd = m16.state_dict_full()
    m32 = tpcore.models.TransformerLM(cfg, comm, seed=11)
    m32.load_state_dict_full({k: np.asarray(v).astype(np.float32) for k, v in sd.items()})
    tokens = rng_for(59, 0).integers(0, cfg.vocab_size, (2, 7))
    l16, l32 = m16.logits(tokens), m32.logits(tokens)
    errs = []
    if not np.allclose(l16, l32, rtol=1e-4, atol=1e-4):
        errs.append(f"logits differ from the float32 model with the same (widened) weights by "
                    f"{np.abs(l16 - l32).max():.2e}")
    big = [k for k, v in sd.items() if np.asarray(v).ndim == 2 and "wpe" not in k]
    if not all(np.asarray(sd[k]).dtype == _np(dt) for k in big):
        errs.append(f"state_dict dtypes: {sorted({str(np.asarray(sd[k]).dtype) for k in big})}")
    ratio = m16.param_bytes() / m32.param_bytes()
    if not 0.5 <= ratio < 0.6:
        errs.append(f"parameter bytes {m16.param_bytes()} vs {m32.param_bytes()} (ratio {ratio:.3f})")
    out = m16.generate(tokens[:, :3], max_new_tokens=4)
    # greedy decoding of the 16-bit model = the argmax of its own full-recompute logits
    seq = np.asarray(out)
    for t in range(3, seq.shape[1]):
        want = m16.logits(seq[:, :t])[:, -1].argmax(-1)
        if not np.array_equal(seq[:, t], want):
            errs.append(f"generate step {t}: {seq[:, t]} but the logits' argmax is {want}")
            break
    # mixed-precision training: the loss goes down, the masters are float32, the weights their rounding
    opt = tpcore.optim.AdamW(m16, lr=3e-3)
    targets = np.roll(tokens, -1, 1)
    losses = []
    for _ in range(4):
        losses.append(m16.loss(tokens, targets))
        m16.backward()
        opt.step()
        m16.zero_grad()
    if not losses[-1] < losses[0]:
        errs.append(f"losses {losses}")
    for (p, _), w in zip(opt.params, opt.master):
        if p.dtype != np.float32:
            if w is None or w.dtype != np.float32 or \
                    not np.array_equal(p.view(np.uint16), w.astype(p.dtype).view(np.uint16)):
                errs.append("a 16-bit parameter is not its float32 master rounded")
                break
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dt,tie", [("bfloat16", True), ("float16", False)])
def test_model_with_16_bit_weights(world, dt, tie):
    for r, errs in enumerate(run(_model_case, world, dt, tie)):
        assert not errs, f"rank {r}: {errs}"


def _optimizer_case(comm, dt):
    """AdamW / SGD on a 16-bit layer = the float32 optimizer on float32 masters, rounded."""
    g = rng_for(61, 0)
    errs = []
    for name, make in (("AdamW", lambda ps: tpcore.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
                       ("SGD", lambda ps: tpcore.optim.SGD(ps, lr=1e-2, momentum=0.9))):
        lay = tpcore.ColumnParallelLinear(9, 11, comm, dtype=dt, seed=2)
        master = lay.weight.astype(np.float32)
        grad = np.zeros_like(master)
        bias = lay.bias.copy()
        opt, ref_opt = make(lay), make([(master, grad), (bias, np.zeros_like(bias))])
        for _ in range(3):
            G = g.standard_normal(master.shape).astype(np.float32)
            lay.grad_weight[...] = G
            grad[...] = G
            opt.step()
            ref_opt.step()
        if not np.array_equal(lay.weight.view(np.uint16), master.astype(_np(dt)).view(np.uint16)):
            errs.append(f"{name}: the weight is not the float32 run's master rounded")
    return errs


@pytest.mark.parametrize("dt", LOWP)
def test_mixed_precision_optimizers(dt):
    for r, errs in enumerate(run(_optimizer_case, 2, dt)):
        assert not errs, f"rank {r}: {errs}"


# ------------------------------------------------------------------- checkpoints

def _checkpoint_case(comm, src, dt):
    model = tpcore.models.from_pretrained(src, comm, dtype=dt, progress=False)
    sd = model.state_dict_full()
    return {k: np.asarray(v).view(np.uint16).copy() if np.asarray(v).dtype == BF16 else np.asarray(v).copy()
            for k, v in sd.items()}


def test_bf16_checkpoint_keeps_its_bits(tmp_path):
    """A bfloat16 safetensors checkpoint loaded with dtype="bfloat16" holds the file's 16-bit
    patterns exactly (no float32 rounding on the way), at world 1 and 3; saved again and
    reloaded, still the same."""
    pytest.importorskip("safetensors.numpy")
    cfg = tpcore.Config(tie_embeddings=True, **MODEL)
    g = rng_for(67, 0)
    names = run(lambda comm: sorted(tpcore.models.TransformerLM(cfg, comm, seed=1).state_dict_full()), 1)[0]
    shapes = run(lambda comm: {k: np.asarray(v).shape for k, v in
                               tpcore.models.TransformerLM(cfg, comm, seed=1).state_dict_full().items()}, 1)[0]
    src = tmp_path / "own"
    src.mkdir()
    tensors = {k: (g.standard_normal(shapes[k]) * 0.1).astype(np.float32).astype(BF16) for k in names}
    run(_save_bf16, 1, str(src), cfg, tensors)
    for world in (1, 3):
        got = run(_checkpoint_case, world, str(src), "bfloat16")[0]
        for k, v in tensors.items():
            want = v.view(np.uint16) if v.ndim == 2 and "wpe" not in k else v.astype(np.float32)
            assert np.array_equal(got[k], want), f"world {world}: {k}"


def _save_bf16(comm, path, cfg, tensors):
    m = tpcore.models.TransformerLM(cfg, comm, seed=1, dtype="bfloat16")
    m.load_state_dict_full(tensors)
    m.save_pretrained(path)
    return json.load(open(os.path.join(path, "tpcore_config.json")))["model_type"]


# ------------------------------------------------------------------------ errors

def _errors_case(comm):
    out = []
    for make in (lambda d: tpcore.ColumnParallelLinear(4, 4, comm, dtype=d),
                 lambda d: tpcore.ParallelMLP(4, 8, comm, dtype=d),
                 lambda d: tpcore.VocabParallelEmbedding(5, 4, comm, dtype=d),
                 lambda d: tpcore.TransformerBlock(tpcore.Config(vocab_size=5, **CONFIGS["gpt2"]), comm, dtype=d)):
        for bad in ("int16", "q3_k", "float64", "fp8", np.int32):  # int8 and the GGUF formats: tpcore.quant
            try:
                make(bad)
                out.append(f"{bad}: accepted")
            except (ValueError, TypeError) as e:
                out.append(str(e))
    return out


def test_unsupported_weight_dtypes_are_refused():
    msgs = run(_errors_case, 1)[0]
    for m in msgs:
        assert "accepted" not in m and "dtype" in m and "float32, float16, bfloat16" in m, m
