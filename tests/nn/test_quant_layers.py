"""Quantized weights (tpcore.quant) in the layers, blocks and models, against float64 NumPy
references built from llama.cpp's own dequantizers (the gguf package), at world sizes 1-4."""
import numpy as np
import pytest

import tpcore
from tpcore.models import Config, TransformerLM, quantize
from tpcore.nn.quant import QUANT_FORMATS, QuantTensor, block_size, row_bytes
from tpcore.nn.transformer import TransformerBlock

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402  (after importorskip("gguf"): the module skips without gguf)
from gguf.quants import dequantize as g_dequantize  # noqa: E402  (after importorskip("gguf"): the module skips without gguf)

GG = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
DEADLINE = 120


def ref_dequant(qt: QuantTensor) -> np.ndarray:
    """The float values of a QuantTensor by the gguf package (int8 rows: scale x q, here)."""
    if qt.fmt == "int8":
        raw = np.asarray(qt.raw)
        scale = raw[:, :4].copy().view(np.float32)
        return raw[:, 4:].view(np.int8).astype(np.float64) * scale.astype(np.float64)
    return g_dequantize(np.asarray(qt.raw), GG[qt.fmt]).astype(np.float64)


def rand_quant(rng, fmt, rows, cols) -> QuantTensor:
    w = (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)
    return QuantTensor(fmt, (rows, cols), tpcore.quant.quantize(w, fmt))


def _linear(comm, fmt, K, N, M, part, seed):
    rng = np.random.default_rng(seed)  # the same draws on every rank
    qt = rand_quant(rng, fmt, N, K)
    Wd = ref_dequant(qt)
    b = rng.standard_normal(N).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    out = {}
    col = tpcore.ColumnParallelLinear(K, N, comm, bias=True, gather_output=True, dtype=fmt)
    col.load_full(qt, b)
    assert col.grad_weight is None and len(col.parameters()) == 1  # frozen: the bias only
    y = col(x)
    out["col"] = np.abs(y - (x.astype(np.float64) @ Wd.T + b)).max()
    dx = col.backward(dy)
    out["col_dx"] = np.abs(dx - dy.astype(np.float64) @ Wd).max()
    row = tpcore.RowParallelLinear(K, N, comm, bias=True, input_is_parallel=False, dtype=fmt, partition=part)
    row.load_full(qt, b)
    Wr = Wd
    if fmt == "int8":  # one scale per row of each rank's slice: the slice is quantized again
        Wr = row.gather_full()[0].astype(np.float64)
        step = np.abs(Wd).max(1, keepdims=True) / 127
        out["requant"] = float((np.abs(Wr - Wd) / step).max())
    y = row(x)
    out["row"] = np.abs(y - (x.astype(np.float64) @ Wr.T + b)).max()
    dx = row.backward(dy)
    out["row_dx"] = np.abs(dx - dy.astype(np.float64) @ Wr).max()
    out["scale"] = float(np.abs(x).sum(1).max() * np.abs(Wd).max() + 1)
    return out


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_linear_layers_match_dequantized_reference(fmt, world):
    blk = block_size(fmt)
    K = blk * (5 if blk == 1 else 5) * (1 if blk > 1 else 16)  # five blocks (k-quants: 1280)
    N = 37
    for M in (1, 3, 9, 40):  # the GEMV (<= 8 rows) and the panel GEMM
        part = None
        if world > 1 and blk > 1:  # uneven whole blocks: one rank gets the remainder, one maybe none
            units = [K // blk - (world - 1)] + [1] * (world - 1)
            part = [u * blk for u in units]
        r = tpcore.spawn(_linear, world, args=(fmt, K, N, M, part, 100 + M), deadline=DEADLINE)[0]
        tol = 1e-5 * r["scale"]
        for k in ("col", "col_dx", "row", "row_dx"):
            assert r[k] < tol, (fmt, world, M, k, r[k], tol)
        assert r.get("requant", 0) <= (1e-4 if world == 1 else 0.5 + 1e-4)  # raw rows kept; else half a step at most


def _bad_split(comm):
    with pytest.raises(ValueError, match="whole blocks of 32"):
        tpcore.RowParallelLinear(64, 8, comm, dtype="q4_1", partition=[16, 48])
    with pytest.raises(ValueError, match="multiple of q4_1's block of 32"):
        tpcore.ColumnParallelLinear(48, 8, comm, dtype="q4_1")
    with pytest.raises(ValueError, match="q4_k"):
        tpcore.RowParallelLinear(256 * 3, 8, comm, dtype="q4_k", partition=[128, 640])
    return True


def test_block_boundaries_are_enforced():
    assert tpcore.spawn(_bad_split, 2, deadline=DEADLINE) == [True, True]


def test_unknown_format_and_bad_quant_tensors():
    with pytest.raises(ValueError, match="q4_1"):
        QuantTensor("q4_1", (2, 32), np.zeros((2, 21), np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        QuantTensor("q4_1", (2, 32), np.zeros((2, 20), np.float32))
    with pytest.raises(ValueError, match="unknown quantized format"):
        QuantTensor("q3_k", (2, 256), np.zeros((2, 110), np.uint8))
    with pytest.raises(ValueError, match="whole blocks"):
        row_bytes("q8_0", 33)
    with pytest.raises(ValueError, match="non-finite"):
        tpcore.quant.quantize(np.array([[np.nan] * 32], np.float32), "q8_0")


def _embedding(comm, fmt, V, C, part):
    rng = np.random.default_rng(7)
    qt = rand_quant(rng, fmt, V, C)
    ref = ref_dequant(qt)
    emb = tpcore.VocabParallelEmbedding(V, C, comm, dtype=fmt, partition=part)
    emb.load_full(qt)
    assert emb.grad_weight is None and emb.parameters() == []
    tok = rng.integers(0, V, (3, 11))
    y = emb(tok)
    emb.backward(np.ones_like(y))  # frozen: no gradient, no error
    full = emb.gather_full()
    return np.abs(y - ref[tok]).max(), np.abs(full - ref).max()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q6_k", "int8"])
def test_embedding_rows_dequantized(fmt):
    C = 256 if fmt.endswith("_k") else 64
    for world, part in ((1, None), (3, [10, 0, 41])):
        for e in tpcore.spawn(_embedding, world, args=(fmt, 51, C, part), deadline=DEADLINE):
            assert e[0] <= 1e-6 and e[1] <= 1e-6  # float32 rows against float64 ones (int8: scale x q)


def _cfg(C=256, F=512, tied=True, layers=2):
    return Config(hidden=C, heads=4, kv_heads=2, head_dim=C // 4, ffn_hidden=F, norm="rmsnorm",
                  activation="swiglu", positions="rope", bias=False, vocab_size=97, layers=layers,
                  tie_embeddings=tied, max_positions=64)


def _block(comm, dtypes):
    cfg = _cfg()
    rng = np.random.default_rng(11)
    ref = TransformerBlock(cfg, comm, seed=1)
    full = ref.gather_full()
    qd = {}
    for k, v in full.items():
        short = {"attn.q.weight": "qkv", "attn.k.weight": "qkv", "attn.v.weight": "qkv", "attn.out.weight": "out",
                 "mlp.fc1.weight": "fc1", "mlp.fc2.weight": "fc2"}.get(k)
        if short and dtypes.get(short, "float32") in QUANT_FORMATS:
            qt = QuantTensor(dtypes[short], v.shape, tpcore.quant.quantize(v, dtypes[short]))
            qd[k], full[k] = qt, ref_dequant(qt).astype(np.float32)
        else:
            qd[k] = v
    ref.load_full(full)
    blk = TransformerBlock(cfg, comm, seed=2, dtype=dtypes)
    blk.load_full(qd)
    x = rng.standard_normal((2, 5, cfg.hidden)).astype(np.float32)
    ya, yb = ref(x), blk(x)
    g = blk.gather_full()
    return float(np.abs(ya - yb).max()), max(float(np.abs(g[k] - full[k]).max()) for k in g)


@pytest.mark.parametrize("dtypes", [{"qkv": "q4_1", "out": "q4_1", "fc1": "q4_1", "fc2": "q4_1"},
                                    {"qkv": "q4_k", "out": "q8_0", "fc1": "q6_k", "fc2": "q5_k"},
                                    {"qkv": "int8", "fc2": "q4_0"}])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_block_with_quantized_projections(dtypes, world):
    for d_out, d_full in tpcore.spawn(_block, world, args=(dtypes,), deadline=DEADLINE):
        assert d_out < 2e-5 and d_full < 1e-6


def _model(comm, fmt, tied):
    cfg = _cfg(C=512, tied=tied) if fmt.endswith("_k") else _cfg(tied=tied)  # k-quants: a rank's heads x 128
    q = TransformerLM(cfg, comm, seed=5, dtype=fmt)
    f = TransformerLM(cfg, comm, seed=9)
    f.load_state_dict_full(q.state_dict_full())  # the dequantized weights in a float32 model
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7))
    a, b = q.logits(toks), f.logits(toks)
    g1 = q.generate([[1, 2, 3], [4]], max_new_tokens=6, temperature=0.0)
    g2 = f.generate([[1, 2, 3], [4]], max_new_tokens=6, temperature=0.0)
    same = all(np.array_equal(u, v) for u, v in zip(g1, g2))
    return float(np.abs(a - b).max()), same, q.param_bytes(), f.param_bytes()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q4_k", "int8"])
@pytest.mark.parametrize("tied", [True, False])
def test_model_equals_float_model_of_its_dequantized_weights(fmt, tied):
    for world in ((1, 2) if fmt.endswith("_k") else (1, 3)):
        for d, same, qb, fb in tpcore.spawn(_model, world, args=(fmt, tied), deadline=DEADLINE):
            assert d < 5e-5 and same
            assert qb < fb / 2.5  # weights at 1 to 1.06 bytes per element or less, against 4


def _quantize_copy(comm, fmt):
    cfg = _cfg(C=512, tied=False) if fmt.endswith("_k") else _cfg(tied=False)
    m = TransformerLM(cfg, comm, seed=3)
    q = quantize(m, fmt)
    toks = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 9))
    a, b = m.logits(toks), q.logits(toks)
    rel = float(np.abs(a - b).max() / np.abs(a).max())
    sd = q.state_dict_full()
    f = TransformerLM(cfg, comm, seed=4)
    f.load_state_dict_full(sd)
    return rel, float(np.abs(f.logits(toks) - b).max())


@pytest.mark.parametrize("fmt,bound", [("q8_0", 0.02), ("q6_k", 0.05), ("q4_k", 0.2), ("int8", 0.03),
                                       ("bfloat16", 0.02)])
def test_quantize_a_float_model(fmt, bound):
    for world in (1, 2):
        for rel, d in tpcore.spawn(_quantize_copy, world, args=(fmt,), deadline=DEADLINE):
            assert 0 < rel < bound
            assert d < 5e-5


def test_planner_plans_whole_blocks_with_the_format_bytes():
    from tpcore.parallel.planner import plan_from_measurements
    cfg = _cfg(C=512, F=1536)
    p32 = plan_from_measurements(cfg, [1.0, 0.5, 0.25], dtype="float32")
    pq = plan_from_measurements(cfg, [1.0, 0.5, 0.25], dtype="q4_k")
    assert all(s % 256 == 0 for s in pq.ffn) and sum(pq.ffn) == 1536 and len(set(pq.ffn)) > 1  # uneven, whole blocks
    assert pq.align["ffn"] % 256 == 0
    # the byte estimate is the format's: q4_k's projections take 144 / 256 bytes an element, not 4
    assert sum(pq.bytes_per_rank) < 0.3 * sum(p32.bytes_per_rank)
    with pytest.raises(ValueError, match="block of 256"):
        plan_from_measurements(cfg, [1.0, 1.0], dtype="q4_k", align={"ffn": 128})
    with pytest.raises(ValueError, match="block of 32"):
        plan_from_measurements(_cfg(C=64, F=48), [1.0, 1.0], dtype="q8_0")
