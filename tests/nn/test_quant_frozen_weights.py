"""Quantized (frozen) weights through the paths that assume a float32 weight with a gradient:
the pipeline's tied embeddings, sharded checkpoints (tpcore.save / load, save_pretrained)."""
import os

import numpy as np
import pytest

import tpcore
from tpcore.models.lm import Config, TransformerLM
from tpcore.parallel.pipeline import PipelineLM
from tpcore.nn.quant import QuantTensor, quantize

DEADLINE = 120


def _cfg(tied=True):
    return Config(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=96, norm="rmsnorm", activation="swiglu",
                  positions="rope", bias=False, vocab_size=37, layers=2, tie_embeddings=tied, max_positions=32)


def _pipeline_tied(comm, fmt):
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 37, (2, 6))
    tgts = rng.integers(0, 37, (2, 6))
    # the single-process reference: the same model, unsplit
    solo = comm.split(comm.rank)
    ref = TransformerLM(_cfg(), solo, seed=4, dtype=fmt)
    ref.zero_grad()
    want = ref.loss(toks, tgts)
    ref.backward()
    grid = tpcore.ProcessGrid(comm, pp=comm.size)
    p = PipelineLM(_cfg(), grid, seed=4, dtype=fmt)
    p.zero_grad()
    got = p.train_step(toks, tgts, micro_batches=2)
    g = None
    if p.last:  # the final norm's gradient (a trainable parameter next to the frozen head)
        g = float(np.abs(p.stage.final_norm.grad_weight - ref.final_norm.grad_weight).max())
    p.close()
    solo.close()
    return abs(got - want), g, float(np.abs(ref.final_norm.grad_weight).max())


@pytest.mark.parametrize("fmt", ["q8_0", "int8"])
def test_pipeline_with_a_quantized_tied_embedding_trains_the_rest(fmt):
    out = tpcore.spawn(_pipeline_tied, 2, args=(fmt,), deadline=DEADLINE)
    for dl, g, scale in out:
        assert dl < 1e-4
        assert g is None or (scale > 0 and g < 1e-4 * max(1.0, scale))


def _sharded_layers(comm, path, fmt):
    rng = np.random.default_rng(5)
    W = rng.standard_normal((7, 64)).astype(np.float32)
    layers = {"col": tpcore.ColumnParallelLinear(64, 7, comm, bias=True, dtype=fmt),
              "row": tpcore.RowParallelLinear(64, 7, comm, bias=True, dtype=fmt, input_is_parallel=False),
              "emb": tpcore.VocabParallelEmbedding(11, 64, comm, dtype=fmt)}
    layers["col"].load_full(QuantTensor(fmt, (7, 64), quantize(W, fmt)), rng.standard_normal(7).astype(np.float32))
    tpcore.save(layers, path, comm, sharded=True)
    other = {"col": tpcore.ColumnParallelLinear(64, 7, comm, bias=True, dtype=fmt, seed=9),
             "row": tpcore.RowParallelLinear(64, 7, comm, bias=True, dtype=fmt, seed=9, input_is_parallel=False),
             "emb": tpcore.VocabParallelEmbedding(11, 64, comm, dtype=fmt, seed=9)}
    differ_before = not np.array_equal(np.asarray(other["col"].weight), np.asarray(layers["col"].weight))
    tpcore.load(other, path, comm, sharded=True)
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for k in layers
               for a, b in zip([layers[k].weight] + ([] if k == "emb" else [layers[k].bias]),
                               [other[k].weight] + ([] if k == "emb" else [other[k].bias])))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    ys = float(np.abs(layers["row"](x) - other["row"](x)).max())
    # another format with rows of the same bytes (q4_0 and q4_k: 144 bytes per 256) is refused
    errs = []
    wrong = {"col": tpcore.ColumnParallelLinear(64, 7, comm, bias=True, dtype="float32"),
             "row": tpcore.RowParallelLinear(64, 7, comm, bias=True, dtype=fmt, input_is_parallel=False),
             "emb": tpcore.VocabParallelEmbedding(11, 64, comm, dtype=fmt)}
    try:
        tpcore.load(wrong, path, comm, sharded=True)
    except Exception as e:  # noqa: BLE001 (the type is checked below)
        errs.append((type(e).__name__, str(e)))
    return differ_before, same, ys, errs


@pytest.mark.parametrize("fmt", ["q4_0", "int8"])
def test_sharded_save_load_of_quantized_layers(tmp_path, fmt):
    path = os.path.join(str(tmp_path), "m.safetensors")
    for differ_before, same, ys, errs in tpcore.spawn(_sharded_layers, 2, args=(path, fmt), deadline=DEADLINE):
        assert differ_before and same and ys == 0.0
        assert len(errs) == 1 and errs[0][0] in ("ValueError", "CommError") and "float" in errs[0][1]


def _format_mismatch(comm, path):
    a = tpcore.RowParallelLinear(256, 5, comm, bias=False, dtype="q4_0")
    tpcore.save(a, path, comm, sharded=True)
    b = tpcore.RowParallelLinear(256, 5, comm, bias=False, dtype="q4_k")  # rows of 144 bytes too
    assert b.weight.shape == a.weight.shape
    with pytest.raises(ValueError, match="q4_0 weights, but this layer holds q4_k"):
        tpcore.load(b, path, comm, sharded=True)
    return True


def test_sharded_load_refuses_another_format_of_the_same_bytes(tmp_path):
    assert all(tpcore.spawn(_format_mismatch, 1, args=(os.path.join(str(tmp_path), "a.npz"),), deadline=DEADLINE))


def _save_pretrained_sharded(comm, path):
    m = TransformerLM(_cfg(), comm, seed=1, dtype="q8_0")
    with pytest.raises(ValueError, match="sharded=True cannot save quantized"):
        m.save_pretrained(path, sharded=True)
    refused = not os.path.exists(os.path.join(path, "tpcore_config.json"))
    comm.barrier()  # every rank looked before rank 0 writes the folder below
    m.save_pretrained(path)  # full float32 tensors: loads, and quantizes again to the same blocks
    m2 = tpcore.models.from_pretrained(path, comm, dtype="q8_0", progress=False)
    toks = np.array([[1, 5, 2, 7]])
    return refused, float(np.abs(m.logits(toks) - m2.logits(toks)).max())


def test_save_pretrained_sharded_refuses_quantized_weights(tmp_path):
    for refused, d in tpcore.spawn(_save_pretrained_sharded, 2, args=(str(tmp_path / "m"),), deadline=DEADLINE):
        assert refused and d < 1e-4


def _planned_model(comm, speeds):
    from tpcore.parallel.planner import plan_from_measurements
    cfg = Config(hidden=512, heads=8, kv_heads=8, head_dim=64, ffn_hidden=512, norm="rmsnorm", activation="swiglu",
                 positions="rope", bias=False, vocab_size=37, layers=1, tie_embeddings=True, max_positions=32)
    plan = plan_from_measurements(cfg, speeds, dtype="q4_k")
    q = TransformerLM(cfg, comm, seed=2, dtype="q4_k", plan=plan)
    f = TransformerLM(cfg, comm, seed=7)
    f.load_state_dict_full(q.state_dict_full())
    toks = np.random.default_rng(4).integers(0, 37, (2, 5))
    return plan.heads, float(np.abs(q.logits(toks) - f.logits(toks)).max())


def test_planner_splits_heads_in_whole_blocks_of_the_output_projection():
    from tpcore.parallel.planner import plan_from_measurements
    cfg = Config(hidden=512, heads=8, kv_heads=8, head_dim=64, ffn_hidden=1536, norm="rmsnorm", activation="swiglu",
                 positions="rope", bias=False, vocab_size=97, layers=2, max_positions=64)
    for speeds in ([1.0, 0.5, 0.25], [1.0, 0.7], [1.0, 1.0, 1.0]):
        p = plan_from_measurements(cfg, speeds, dtype="q4_k")
        assert sum(p.heads) == 8 and all(h * 64 % 256 == 0 for h in p.heads), p.heads
        assert plan_from_measurements(cfg, speeds, dtype="q8_0").heads == plan_from_measurements(cfg, speeds).heads
    # GQA in whole groups: 2 query heads per KV head, head_dim 32: q4_k needs 8 heads (4 groups) a unit
    g = Config(hidden=512, heads=16, kv_heads=8, head_dim=32, ffn_hidden=512, norm="rmsnorm", activation="swiglu",
               positions="rope", bias=False, vocab_size=97, layers=1, max_positions=64)
    p = plan_from_measurements(g, [1.0, 0.6], dtype="q4_k", head_unit="group")
    assert sum(p.heads) == 16 and all(h * 32 % 256 == 0 for h in p.heads), p.heads
    for heads, d in tpcore.spawn(_planned_model, 2, args=([1.0, 0.7],), deadline=DEADLINE):
        assert heads == [4, 4] and d < 5e-5


def _quantize_uneven_heads(comm):
    cfg = Config(hidden=128, heads=8, kv_heads=2, head_dim=16, ffn_hidden=256, norm="rmsnorm", activation="swiglu",
                 positions="rope", bias=False, vocab_size=37, layers=1, tie_embeddings=False, max_positions=32)
    m = TransformerLM(cfg, comm, seed=5)  # world 3: heads [3, 3, 2] x 16 columns, not whole q8_0 blocks
    q = tpcore.models.quantize(m, "q8_0")
    f = TransformerLM(cfg, comm, seed=6)
    f.load_state_dict_full(q.state_dict_full())  # the quantized model's own values, in float32
    toks = np.random.default_rng(2).integers(0, 37, (2, 6))
    a, b, c = m.logits(toks), q.logits(toks), f.logits(toks)
    return (m.blocks[0].head_partition, q.blocks[0].head_partition, float(np.abs(b - c).max()),
            float(np.abs(a - b).max() / np.abs(a).max()))


def test_quantize_a_model_whose_head_split_is_not_whole_blocks():
    for hm, hq, d, rel in tpcore.spawn(_quantize_uneven_heads, 3, deadline=DEADLINE):
        assert [s for _, s in hm] == [3, 3, 2] and all(s * 16 % 32 == 0 for _, s in hq)
        assert d < 5e-5 and 0 < rel < 0.02


def test_sizes_must_be_integers():
    raw = quantize(np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32), "int8")
    with pytest.raises(TypeError, match="dequantize: cols must be"):
        tpcore.quant.dequantize(raw, "int8", 64.5)  # was truncated to 64 and accepted
    with pytest.raises(TypeError, match="row_bytes: cols must be"):
        tpcore.quant.row_bytes("q8_0", 64.0)
    with pytest.raises(TypeError, match="QuantTensor: shape"):
        QuantTensor("int8", ("3", 64), raw)
    with pytest.raises(TypeError, match="QuantTensor: shape"):
        QuantTensor("int8", (3.0, 64), raw)
    assert np.array_equal(tpcore.quant.dequantize(raw, "int8", np.int64(64)), QuantTensor("int8", (3, 64), raw)[:])


def _sharded_into_quantized(comm, path):
    m = TransformerLM(_cfg(), comm, seed=1)
    m.save_pretrained(path, sharded=True)
    side = comm.split(0)  # the same ranks: a refusal aborts the communicator it ran on
    with pytest.raises(ValueError, match="sharded checkpoint .* cannot load into quantized weights"):
        tpcore.models.from_pretrained(path, side, dtype="q8_0", progress=False)
    side.close()
    f = tpcore.models.from_pretrained(path, comm, progress=False)  # float32: as it was saved
    toks = np.array([[3, 1, 4, 1, 5]])
    return float(np.abs(f.logits(toks) - m.logits(toks)).max())


def test_sharded_checkpoint_into_a_quantized_model_is_refused_by_name(tmp_path):
    for d in tpcore.spawn(_sharded_into_quantized, 2, args=(str(tmp_path / "s"),), deadline=DEADLINE):
        assert d == 0.0


def test_device_array_refuses_weight_formats_as_dtypes():
    # the quantized weight formats are names tp_dtype_from_name knows, but not element types:
    # such a DeviceArray had a shape and no bytes
    for name in ("q8_0", "q4_k", "q6_k"):
        with pytest.raises(ValueError, match=f"DeviceArray: dtype '{name}' is not known"):
            tpcore.DeviceArray((4, 64), name)
    a = tpcore.DeviceArray((3, 5), "int8")
    assert a.shape == (3, 5) and np.array_equal(a.to_numpy(), np.zeros((3, 5), np.int8))


def test_linear_kernel_names_columns_that_are_not_whole_blocks():
    from tpcore import _C
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(ValueError, match=r"linear_forward: x has 64 columns, not whole blocks of 256 elements \(q4_k"):
        _C.linear_forward(x, np.zeros((3, 144), np.uint8), None, None, "q4_k")
    with pytest.raises(ValueError, match="linear_backward: x has 64 columns, not whole blocks of 256"):
        _C.linear_backward(np.ones((2, 3), np.float32), x, np.zeros((3, 144), np.uint8), None, None, "q6_k")
    with pytest.raises(ValueError, match="w's rows are 30 bytes, but 64 q8_0 elements take 68"):
        _C.linear_forward(x, np.zeros((3, 30), np.uint8), None, None, "q8_0")


def _quantize_device_model(comm):
    # GPT-2 style: learned positions, LayerNorm with biases, a final norm; the source model on the
    # device code path (its norms and position embeddings are DeviceArrays, as on a GPU)
    cfg = Config(hidden=64, heads=4, head_dim=16, ffn_hidden=128, norm="layernorm", activation="gelu",
                 positions="learned", bias=True, vocab_size=37, layers=1, tie_embeddings=True, max_positions=16)
    m = TransformerLM(cfg, comm, seed=3, _device_path=True)
    q = tpcore.models.quantize(m, "q8_0")
    f = TransformerLM(cfg, comm, seed=8)
    f.load_state_dict_full(q.state_dict_full())
    ref = TransformerLM(cfg, comm, seed=3)  # the source's values on the NumPy path
    toks = np.random.default_rng(6).integers(0, 37, (2, 7))
    a, b = ref.logits(toks), q.logits(toks)
    sd_q, sd_m = q.state_dict_full(), ref.state_dict_full()
    same = all(np.array_equal(sd_q[k], sd_m[k]) for k in sd_q if "norm" in k or k == "wpe.weight")
    return same, float(np.abs(b - f.logits(toks)).max()), float(np.abs(a - b).max() / np.abs(a).max())


def test_quantize_a_model_on_the_device_path():
    for same, d, rel in tpcore.spawn(_quantize_device_model, 2, deadline=DEADLINE):
        assert same and d < 5e-5 and 0 < rel < 0.02


def test_device_linear_kernel_names_columns_that_are_not_whole_blocks():
    from tpcore import _C
    x = tpcore.from_dlpack(np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32))
    w = tpcore.from_dlpack(np.zeros((3, 144), np.uint8))
    with pytest.raises(ValueError, match=r"linear_forward: x has 64 columns, not whole blocks of 256 elements"):
        _C.linear_forward(x, w, None, None, "q4_k")
    good = quantize(np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32), "q8_0")
    y = _C.linear_forward(x, tpcore.from_dlpack(good), None, None, "q8_0").to_numpy()
    ref = x.to_numpy().astype(np.float64) @ tpcore.quant.dequantize(good, "q8_0", 64).T.astype(np.float64)
    assert np.abs(y - ref).max() < 1e-4
