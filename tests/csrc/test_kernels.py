"""The kernel parity harness (csrc/tests/test_kernels*.c), built with make and run
without Python in the loop: every entry of every available kernel table against
double-precision references on odd sizes, and the public tensor API's checks.  Also
asserts that every entry of the table (TP_KERNEL_ENTRIES in csrc/kernels/kernels_impl.h)
has a parity case, so a new entry without one fails here.  Then the 16-bit weight path
from Python: tpcore.convert against NumPy / ml_dtypes casts bit for bit, and linear with
bfloat16 / float16 weights against float64."""
import os
import re

import numpy as np
import pytest

import tpcore

from c_binaries import ROOT, build, run


def build_and_run(c_builds, sanitize):
    return run(build(c_builds, sanitize, "test_kernels") / "test_kernels")


def check_output(r):
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    entries = re.search(r"^entries: (.*)$", out, re.M).group(1).split()
    covered = re.search(r"^covered: (.*)$", out, re.M).group(1).split()
    assert len(entries) == len(set(entries)) >= 30
    # every entry of the table has a parity case, and every case is an entry of the table
    assert set(entries) - set(covered) == set(), "entries without a parity case"
    assert set(covered) - set(entries) == set(), "cases of entries the table does not have"
    # the CPU table ran every entry, and each passed
    for e in entries:
        assert re.search(rf"^cpu {e}: ok ", out, re.M), f"cpu {e} did not pass:\n{out}"
    # a process with a CUDA kernel table (a GPU machine) ran every entry on it too, on device memory
    if not re.search(r"^device cuda: no kernel table", out, re.M):
        for e in entries:
            assert re.search(rf"^cuda {e}: ok ", out, re.M), f"cuda {e} did not pass:\n{out}"
    assert not re.search(r"FAIL", out), out
    for part in ("linear", "activations", "vocab, norms, rope", "attention, optimizers"):
        assert f"api {part}: ok" in out
    for fmt in ("int8", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"):  # test_kernels_quant.c
        for part in ("dequant + dot1/dot4", "quant round trip", "Inf/NaN fields"):
            assert f"quant {fmt} {part}: ok" in out
    assert re.search(r"^\d+ passed, 0 failed$", out, re.M)


@pytest.mark.slow  # builds the C core; the Python kernel tests below cover the bindings
def test_kernel_parity(c_builds):
    check_output(build_and_run(c_builds, sanitize=False))


@pytest.mark.sanitized
@pytest.mark.slow  # test_kernel_parity runs the same binary plain
def test_kernel_parity_under_asan_ubsan(c_builds):
    check_output(build_and_run(c_builds, sanitize=True))


def test_entries_list_matches_the_table_struct():
    """TP_KERNEL_ENTRIES names the fields of tp_kernel_ops in order (the static assert
    checks the count; this checks the names)."""
    text = (ROOT / "csrc/kernels/kernels_impl.h").read_text()
    struct = text[text.index("typedef struct tp_kernel_ops"):text.index("} tp_kernel_ops;")]
    fields = re.findall(r"\(\*(\w+)\)\(", struct)
    assert fields == table_entries()


def table_entries():
    """TP_KERNEL_ENTRIES of csrc/kernels/kernels_impl.h, in order."""
    text = (ROOT / "csrc/kernels/kernels_impl.h").read_text()
    return re.findall(r"X\((\w+)\)", text[text.index("#define TP_KERNEL_ENTRIES"):text.index("TP_KERNEL_COUNT_ONE_")])


# Entries of the CUDA table the host emulator cannot run, each with the reason (none: every entry
# runs; cublas_emu.cc emulates the cuBLAS calls).  An entry added to the table runs there too, or
# fails the test below, unless it is listed here.
NOT_EMULATED = {}
# The entries with extra cases for the quantized weight formats (int8, q8_0, q4_0, q4_1, q4_k,
# q5_k, q6_k: the decode GEMV, the panel GEMM, dx, the embedding), test_kernels_qlp.c.
QUANT_ENTRIES = ("linear_lp_workspace", "linear_forward_lp", "linear_backward_lp", "embedding_forward_lp")
EMU = ROOT / "csrc/tests/cuda_emu"
KERNELS = ROOT / "csrc/cuda/kernels"


def test_emulator_takes_every_cuda_file(tmp_path):
    """The cheap half of the emulator test below: transform.py rewrites every .cu / .cuh file of
    the CUDA table for the host (no launch or __shared__ left over; a launch or declaration it does
    not know is an error), every cuBLAS function the kernels call has a host stand-in in
    cublas_emu.cc, and every entry of the table is emulated or listed in NOT_EMULATED."""
    import subprocess
    import sys
    files = sorted(KERNELS.glob("*.cu")) + sorted(KERNELS.glob("*.cuh"))
    assert len(files) >= 15
    launches = 0
    for f in files:
        out = tmp_path / (f.name + ".cc")
        r = subprocess.run([sys.executable, str(EMU / "transform.py"), str(f), str(out)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        text = out.read_text()
        assert "<<<" not in text and "__shared__" not in text, f
        launches += text.count("emu_launch(")
        if "__shared__" in f.read_text().replace("extern __shared__", ""):
            assert "emu_poison(" in text, f  # the static shared arrays are poisoned per block
    assert launches >= 30
    called = set()
    for f in files:
        called |= set(re.findall(r"api->(\w+)\(", f.read_text()))
    assert {"Sgemm", "Sgemv", "GemmEx"} <= called
    provided = set(re.findall(r"a\.(\w+) = ", (EMU / "cublas_emu.cc").read_text()))
    assert called - provided == set(), "cuBLAS calls the emulator lacks"
    entries = table_entries()
    assert len(entries) == len(set(entries)) >= 40
    assert set(NOT_EMULATED) <= set(entries)


@pytest.mark.sanitized
@pytest.mark.slow  # builds the CUDA table for the host under ASan; test_emulator_takes_every_cuda_file: quick part
def test_every_cuda_entry_under_the_host_emulator_asan(c_builds):
    """Every entry of the CUDA kernel table (csrc/cuda/kernels/table.c: all of TP_KERNEL_ENTRIES)
    and the quantized-weight cases (quant_<entry>) through the parity harness on the host, under
    ASan + UBSan: csrc/tests/cuda_emu/run.sh runs each CUDA thread as a fiber with cooperative
    barriers and shuffles, shared memory poisoned per block, device memory exact-sized and
    never zeroed, cuBLAS as a host GEMM that checks its arguments; each entry in the forward and
    the reverse order of threads and blocks.  Checks the kernels' index math, masks, tiles,
    reductions, the online softmax, split-K, the GEMM arguments and workspace layouts, and the
    quantized formats' dequantization bit for bit, where no GPU is; scripts/gpu_check.sh runs
    the same harness on a GPU (test_kernel_parity there)."""
    import shutil
    import subprocess
    if not shutil.which("g++") or not shutil.which("make"):
        pytest.skip("needs g++ (C++20) and make")
    lib = build(c_builds, True, "libtpcore.a")  # test_kernel_parity_under_asan_ubsan's core, not a build of its own
    emulated = [e for e in table_entries() if e not in NOT_EMULATED]
    r = subprocess.run([str(EMU / "run.sh"), *emulated], cwd=ROOT, capture_output=True, text=True, timeout=1500,
                       env=dict({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},  # (see c_binaries.run)
                                SANITIZE="1", BUILD=str(lib), EMU_JOBS=str(min(2, os.cpu_count() or 1))))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    n = len(table_entries())
    assert len(emulated) + len(NOT_EMULATED) == n
    # the functions that ran are the CUDA table's, none a CPU stand-in
    assert f"emu table: {n} entries, {n} of the CUDA table, 0 of the CPU table" in out, out
    for order in ("forward", "reverse"):  # each entry in both orders (the order a run took is its own report)
        for e in emulated:
            assert len(re.findall(rf"^\[{order}\] cudaemu {e}: ok ", out, re.M)) == 1, f"{e} ({order}):\n{out}"
        for e in QUANT_ENTRIES:
            assert len(re.findall(rf"^\[{order}\] cudaemu quant_{e}: ok ", out, re.M)) == 1, f"quant_{e}:\n{out}"
    assert f"emu: {len(emulated)} entries x 2 orders ok (ASan + UBSan)" in out
    assert "FAIL" not in out and "Sanitizer" not in out and "runtime error" not in out, out


# ---------------------------------------------------------------- 16-bit weights

def _probe_float32(rng, n):
    """float32 values that probe rounding to 16 bits: specials, ties of both formats (and a
    float32 step either side), float16 subnormals, values near 65504 and near float32's
    largest, and random bit patterns (their NaNs made quiet: NumPy's float16 cast keeps a
    signalling NaN signalling, where tpcore quiets every NaN)."""
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65519.996, 65520, -65520, 65536,
                        2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.5, 2.0 ** -14, 6.1e-5, 3.4028235e38, 1e-45, -1e-40],
                       np.float32)
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    nan = (bits & 0x7F800000) == 0x7F800000
    bits[nan & ((bits & 0x7FFFFF) != 0)] |= 0x400000  # quiet
    rand = bits.view(np.float32)
    h16 = rng.integers(0, 0x7C00, n, dtype=np.uint16)
    lo16, hi16 = h16.view(np.float16).astype(np.float64), (h16 + 1).view(np.float16).astype(np.float64)
    tie16 = ((lo16 + hi16) / 2).astype(np.float32)
    b16 = rng.integers(0, 0x7F80, n, dtype=np.uint16)
    tieb = ((b16.astype(np.uint32) << 16) | 0x8000).view(np.float32)
    ties = np.concatenate([tie16, tieb])
    sign = np.where(rng.random(ties.size) < 0.5, -1, 1).astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.float32(0)), ties, np.nextafter(ties, np.float32(np.inf))]) * \
        np.tile(sign, 3)
    sub = rng.uniform(2.0 ** -26, 2.0 ** -13, n).astype(np.float32)
    top = rng.uniform(65000, 66000, n).astype(np.float32)
    big = (np.float32(3.39e38) * rng.uniform(0.99, 1.0037, n)).astype(np.float32)
    return np.concatenate([special, rand, near, sub, -top, top, big, special])


def test_convert_matches_numpy_and_ml_dtypes_bit_for_bit():
    import ml_dtypes
    rng = np.random.default_rng(5)
    x = _probe_float32(rng, 200_003)  # large enough to split over threads
    with np.errstate(all="ignore"):
        for dt in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
            got = tpcore.convert(x, dt)
            assert got.dtype == dt and got.shape == x.shape
            np.testing.assert_array_equal(got.view(np.uint16), x.astype(dt).view(np.uint16))
            # the same dtype given by name, into out=, and an N-d shape
            out = np.empty((x.size // 7, 7), dt)
            r = tpcore.convert(x[:out.size].reshape(out.shape), dt.name, out=out)
            assert r is out
            np.testing.assert_array_equal(out.view(np.uint16).ravel(), x[:out.size].astype(dt).view(np.uint16))
        # every 16-bit pattern widened (exact) and to the other 16-bit type; NaNs: ml_dtypes
        # canonicalises them, so they are compared as NaNs of their sign
        allbits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
        for a, b in ((np.float16, ml_dtypes.bfloat16), (ml_dtypes.bfloat16, np.float16)):
            h = allbits.view(a)
            wide = tpcore.convert(h, np.float32)
            np.testing.assert_array_equal(wide.view(np.uint32), h.astype(np.float32).view(np.uint32))
            got, want = tpcore.convert(h, b).view(np.uint16), h.astype(b).view(np.uint16)
            nan = np.isnan(h.astype(np.float32))
            np.testing.assert_array_equal(got[~nan], want[~nan])
            assert np.isnan(got[nan].view(b).astype(np.float32)).all()
            np.testing.assert_array_equal(got[nan] >> 15, allbits[nan] >> 15)


def test_convert_errors():
    x = np.ones((3, 4), np.float32)
    with pytest.raises(TypeError, match="convert: dtype must be"):
        tpcore.convert(x, np.int32)
    with pytest.raises(TypeError, match="convert: x must be"):
        tpcore.convert(np.ones(3, np.float64), np.float16)
    with pytest.raises(ValueError, match="convert: out must be"):
        tpcore.convert(x, np.float16, out=np.empty((4, 3), np.float16))
    with pytest.raises(ValueError, match="overlap"):
        tpcore.convert(x, np.float32, out=x)
    assert tpcore.convert(np.empty((0, 5), np.float32), np.float16).shape == (0, 5)


@pytest.mark.parametrize("wname", ["bfloat16", "float16"])
def test_linear_with_16_bit_weights_against_float64(wname):
    """_C.linear_forward / linear_backward with w stored in 16 bits (the *_lp entries through
    tp_linear_forward / tp_linear_backward) against float64 NumPy on the widened weights."""
    import ml_dtypes
    from tpcore import _C
    wdt = np.dtype(ml_dtypes.bfloat16) if wname == "bfloat16" else np.dtype(np.float16)
    rng = np.random.default_rng(11)
    for M, K, N in [(1, 1, 1), (1, 769, 131), (2, 37, 65), (3, 0, 5), (4, 250, 33), (9, 8191, 300), (33, 65, 17)]:
        x = rng.uniform(-1, 1, (M, K)).astype(np.float32)
        w = rng.uniform(-1, 1, (N, K)).astype(wdt)
        b = rng.uniform(-1, 1, N).astype(np.float32)
        wf = w.astype(np.float64)
        mag = np.abs(x) @ np.abs(wf).T + np.abs(b)
        y = _C.linear_forward(x, w, b)
        ref = x.astype(np.float64) @ wf.T + b
        assert np.all(np.abs(y - ref) <= 2 * (K + 3) * 2.0 ** -24 * mag)
        dy = rng.uniform(-1, 1, (M, N)).astype(np.float32)
        dw = rng.uniform(-1, 1, (N, K)).astype(np.float32)
        dw0 = dw.astype(np.float64)
        dx = _C.linear_backward(dy, x, w, dw)
        rdx = dy.astype(np.float64) @ wf
        assert np.all(np.abs(dx - rdx) <= 2 * (N + 3) * 2.0 ** -24 * (np.abs(dy) @ np.abs(wf)))
        rdw = dw0 + dy.astype(np.float64).T @ x
        assert np.all(np.abs(dw - rdw) <= 2 * (M + 3) * 2.0 ** -24 * (np.abs(dw0) + np.abs(dy).T @ np.abs(x)))
    with pytest.raises(TypeError, match="w must be a 2-D float32, bfloat16 or float16"):
        _C.linear_forward(x, w.astype(np.float64), b)
