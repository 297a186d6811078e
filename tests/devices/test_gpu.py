"""Every GPU test of tpcore (scripts/gpu_check.sh runs this file on a machine with a GPU).

Each GPU test skips with a reason when tpcore.cuda_available() is false (or this build has no
GPU path at all), so the file is collected and skipped cleanly on a CPU-only machine.  Groups (the
test names carry them; gpu_check.sh's summary counts by them):

  parity      the C kernel parity harness with the CUDA table (csrc/tests/test_kernels*.c)
  layers_w1   layers and blocks on device="cuda" at world 1 against float64 NumPy references
  staged_w2   world 2 over the shm backend with device buffers (host-staged): collectives, layers
  nccl_w1     NCCL backend at world 1: collectives, layers
  nccl_w2     NCCL backend at world 2 on the one GPU (NCCL 2.30+, NCCL_MULTI_RANK_GPU_ENABLE=1,
              NCCL_MAX_CTAS=4, TPCORE_NCCL_LIBRARY or .nccl230/ from scripts/prepare_gpu_wheels.sh)
  dlpack      round trips with PyTorch and CuPy CUDA tensors without copies (same data pointer)
  errors      a CPU tensor to a CUDA layer, a CUDA tensor to a CPU layer, bad dtypes and strides

Rank processes start with the "spawn" method (fresh interpreters: this process has CUDA
initialised, a forked child could not use it) and hold device buffers from CuPy where it is
installed (importing torch would load PyTorch's own libnccl.so.2 beside the 2.30.7 copy).

scripts/gpu_check.sh itself, without a GPU: test_gpu_check_script.py.
"""
import ctypes
import math
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import tpcore

import reference_transformer as ref
from c_binaries import ROOT

# Both ranks of a world-2 test share the machine's one GPU: layers there are built on this device
# (tpcore's default, "cuda", would take the GPU of LOCAL_RANK).
RANK_DEVICE = "cuda:0"
KDL_CUDA = 2  # DLPack's kDLCUDA


def _cuda_state():
    avail = getattr(tpcore, "cuda_available", None)
    if avail is None:
        return False, "this tpcore has no cuda_available(): the GPU path is not in this build"
    try:
        ok = bool(avail())
    except Exception as e:  # noqa: BLE001 - a broken loader is a reason to skip, said here
        return False, f"tpcore.cuda_available() raised {type(e).__name__}: {e}"
    if ok:
        return True, ""
    info = tpcore.build_info().get("cuda", "build_info() has no 'cuda' entry")
    return False, f"no usable GPU: tpcore.cuda_available() is False (build_info()['cuda']: {info})"


CUDA, WHY_NOT = _cuda_state()
needs_cuda = pytest.mark.skipif(not CUDA, reason=WHY_NOT)


def _torch():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    return torch


def _cupy():
    return pytest.importorskip("cupy", reason="CuPy is not installed")


def _rel(out, want):
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    assert out.shape == want.shape, (out.shape, want.shape)
    assert np.isfinite(out).all(), "NaN or inf in the output"
    return float(np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-30))


# ----------------------------------------------------------------- device arrays, either library
def _to_device(a, lib):
    """A CUDA copy of the host array a, as a CuPy array or a torch tensor."""
    if lib == "cupy":
        import cupy
        return cupy.asarray(a)
    import torch
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _to_host(x):
    """Any CUDA tensor with __dlpack__ (tpcore's DeviceArray, torch, CuPy) as a float64/int NumPy array."""
    try:
        import cupy
        y = cupy.from_dlpack(x)
        if y.dtype.kind in "fiub" and y.dtype.itemsize >= 4 or y.dtype.kind in "iub":
            return cupy.asnumpy(y)
    except Exception:  # noqa: BLE001 - no CuPy, or a dtype it lacks (bfloat16): through torch
        pass
    import torch
    t = torch.from_dlpack(x)
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.cpu().numpy()


def _device_lib():
    import importlib.util
    return "cupy" if importlib.util.find_spec("cupy") is not None else "torch"


# ------------------------------------------------------------------------------- kernel parity
@pytest.mark.gpu
@needs_cuda
def test_parity_cuda_kernel_table(tmp_path):
    """Every entry of the CUDA kernel table against the references of the C harness."""
    binary = os.environ.get("TPCORE_TEST_KERNELS_BIN")  # built already (gpu_check.sh)
    if binary and not os.access(binary, os.X_OK):
        pytest.fail(f"TPCORE_TEST_KERNELS_BIN={binary} is not an executable (did its make fail?)")
    if not binary:
        if shutil.which("make") is None or shutil.which("nvcc") is None and not os.path.exists(
                "/usr/local/cuda/bin/nvcc"):
            pytest.skip("make or nvcc is missing: cannot build the harness with CUDA=1")
        out = tmp_path / "build"
        r = subprocess.run(["make", "-s", "-C", str(ROOT), f"-j{os.cpu_count() or 2}", "CUDA=1",
                            f"CUDA_ARCHS={os.environ.get('CUDA_ARCHS', '90')}", f"BUILD={out}",
                            f"{out}/test_kernels", f"{out}/libtpcore_cuda.so"],  # the harness loads it from beside
                           env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},  # nvcc under ASan crashes
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        binary = str(out / "test_kernels")
    env = dict(os.environ)
    if os.environ.get("TPCORE_TEST_CUDA_PLUGIN"):  # the plugin setup.py built (gpu_check.sh)
        env["TPCORE_CUDA_PLUGIN"] = os.environ["TPCORE_TEST_CUDA_PLUGIN"]
    r = subprocess.run([binary], capture_output=True, text=True, timeout=600, env=env)
    out = r.stdout
    entries = re.search(r"^entries: (.*)$", out, re.M).group(1).split()
    assert len(entries) >= 30
    missing = [e for e in entries if not re.search(rf"^cuda\S* {e}: ok ", out, re.M)]
    assert not missing, f"CUDA entries that did not pass: {missing}\n{out[-4000:]}"
    quant = [e for e in ("linear_lp_workspace", "linear_forward_lp", "linear_backward_lp", "embedding_forward_lp")
             if not re.search(rf"^cuda\S* quant_{e}: ok ", out, re.M)]  # quantized weights (test_kernels_qlp.c)
    assert not quant, f"quantized-weight cases that did not pass on CUDA: {quant}\n{out[-4000:]}"
    assert "FAIL" not in out, out[-4000:]
    assert r.returncode == 0, out[-2000:] + r.stderr[-2000:]


# ------------------------------------------------------------------------------------ world 1
@pytest.fixture
def comm1():
    c = tpcore.init()
    assert c.size == 1
    yield c
    c.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers_w1_linear(comm1, dtype):
    """ColumnParallelLinear then RowParallelLinear on cuda, inputs torch CUDA tensors (a bfloat16 one
    is converted on the GPU, the layers compute in float32 and give bfloat16 back)."""
    torch = _torch()
    rng = np.random.default_rng(1)
    M, K, F = 37, 96, 130
    W1, b1 = rng.standard_normal((F, K)) / math.sqrt(K), rng.standard_normal(F)
    W2, b2 = rng.standard_normal((K, F)) / math.sqrt(F), rng.standard_normal(K)
    x = rng.standard_normal((M, K))
    col = tpcore.ColumnParallelLinear(K, F, comm1, device="cuda")
    row = tpcore.RowParallelLinear(F, K, comm1, device="cuda")
    col.load_full(W1.astype(np.float32), b1.astype(np.float32))
    row.load_full(W2.astype(np.float32), b2.astype(np.float32))
    tdt = getattr(torch, dtype)
    xt = torch.from_numpy(x).to("cuda", tdt)
    h = col(xt)
    assert hasattr(h, "__dlpack__") and h.__dlpack_device__()[0] == KDL_CUDA
    y = row(h)
    assert h.dtype == dtype and y.dtype == dtype  # a 16-bit input gives 16-bit outputs (float32 inside)
    x_used = xt.double().cpu().numpy()  # the bf16-rounded input
    want = (x_used @ W1.T + b1) @ W2.T + b2
    tol = 2e-3 if dtype == "float32" else 3e-2
    assert _rel(_to_host(y), want) < tol


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_layers_w1_linear_16_bit_weights(comm1, dtype):
    """dtype="bfloat16" / "float16" on cuda: the weight in 16 bits; x and dy are rounded to them for
    one tensor-core GEMM with float32 compute, so float64 from the rounded operands is the
    reference (tight), and dW is float32."""
    import ml_dtypes  # noqa: F401 (registers bfloat16 with NumPy)
    np16 = np.dtype(dtype)
    rnd = lambda a: np.asarray(a, np.float32).astype(np16).astype(np.float64)  # noqa: E731 (a one-line local helper)
    torch = _torch()
    rng = np.random.default_rng(11)
    for M in (1, 3, 37):  # decode-sized and prefill-sized rows
        K, N = 96, 131
        lin = tpcore.ColumnParallelLinear(K, N, comm1, device="cuda", dtype=dtype)
        W, b = rng.standard_normal((N, K)) / math.sqrt(K), rng.standard_normal(N)
        lin.load_full(W.astype(np.float32), b.astype(np.float32))
        assert lin.weight.dtype == dtype and lin.grad_weight.dtype == "float32"
        W16 = rnd(W)
        x, dy = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((M, N)).astype(np.float32)
        y = _to_host(lin(torch.from_numpy(x).cuda()))
        want = rnd(x) @ W16.T + b.astype(np.float32)
        assert _rel(y, want) < 1e-5, (M, _rel(y, want))
        dx = _to_host(lin.backward(torch.from_numpy(dy).cuda()))
        assert _rel(dx, rnd(dy) @ W16) < 1e-5
        assert _rel(_to_host(lin.grad_weight), rnd(dy).T @ rnd(x)) < 1e-5
        assert _rel(_to_host(lin.grad_bias), dy.astype(np.float64).sum(0)) < 1e-5


def _quant_linear_vs_cpu(comm, fmt, device, ms=(1, 3, 8, 9, 37)):
    """Column- and row-parallel linear with fmt weights on `device` against the same layers on the
    CPU and against float64 from gguf's dequantization: y and dx per M (<= 8 rows: CUDA's
    dequantizing GEMV, float32 throughout; more: bfloat16 panels for the tensor-core GEMM, x / dy
    and the weight rounded to bfloat16).  Returns the worst relative errors."""
    from tpcore.nn.quant import QuantTensor, block_size, quantize
    rng = np.random.default_rng(21)
    blk = block_size(fmt)
    K, N = (3 * blk if blk > 1 else 100), 67
    W = (rng.standard_normal((N, K)) * 0.5).astype(np.float32)
    qt = QuantTensor(fmt, (N, K), quantize(W, fmt))
    raw = np.asarray(qt.raw)
    if fmt == "int8":
        Wd = raw[:, 4:].view(np.int8).astype(np.float64) * raw[:, :4].copy().view(np.float32).astype(np.float64)
    else:
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import dequantize as g_dequantize
        Wd = g_dequantize(raw, getattr(Q, fmt.upper())).astype(np.float64)
    b = rng.standard_normal(N).astype(np.float32)
    kw = {} if device == "cpu" else {"device": device}
    worst = {"gemv": 0.0, "gemm": 0.0, "vs_cpu_gemv": 0.0, "vs_cpu_gemm": 0.0}
    for cls in (tpcore.ColumnParallelLinear, tpcore.RowParallelLinear):
        lay, cpu = cls(K, N, comm, dtype=fmt, **kw), cls(K, N, comm, dtype=fmt)
        lay.load_full(qt, b)
        cpu.load_full(qt, b)
        assert lay.grad_weight is None  # frozen
        for M in ms:
            x, dy = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((M, N)).astype(np.float32)
            xs, dys = (x, dy) if device == "cpu" else (_torch().from_numpy(x).cuda(), _torch().from_numpy(dy).cuda())
            y, dx = _to_host(lay(xs)), _to_host(lay.backward(dys))
            yc, dxc = cpu(x), cpu.backward(dy)
            path = "gemv" if M <= 8 else "gemm"
            worst[path] = max(worst[path], _rel(y, x.astype(np.float64) @ Wd.T + b),
                              _rel(dx, dy.astype(np.float64) @ Wd))
            worst["vs_cpu_" + path] = max(worst["vs_cpu_" + path], _rel(y, yc), _rel(dx, dxc))
    return worst


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "int8"])
def test_layers_w1_linear_quantized_weights(comm1, fmt):
    """Quantized (frozen) weights on cuda: the decode GEMV and the prefill panel GEMM of
    cuda/quant.cu through the layers, against the CPU layers on the same rows and float64."""
    pytest.importorskip("gguf")
    w = _quant_linear_vs_cpu(comm1, fmt, "cuda")
    assert w["gemv"] < 1e-5 and w["vs_cpu_gemv"] < 1e-5, w  # float32 both sides
    assert w["gemm"] < 1e-2 and w["vs_cpu_gemm"] < 1e-2, w  # bfloat16 operands on the GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_block_takes_16_bit_activations(comm1, dtype):
    """A GPU block given 16-bit activations converts them on the GPU, computes in float32 and
    gives its output and input gradient back in that dtype."""
    torch = _torch()
    cfg = _block_cfg("llama")
    blk = tpcore.TransformerBlock(cfg, comm1, seed=3, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(2, 9, cfg.hidden, device="cuda", generator=g)
    x16 = x.to(getattr(torch, dtype))
    y32 = _to_host(blk(x16.float()))
    y16 = blk(x16)
    assert y16.dtype == dtype and tuple(y16.shape) == (2, 9, cfg.hidden)
    assert _rel(_to_host(y16), y32) < 1e-2  # the output's own rounding
    dx = blk.backward(torch.randn(2, 9, cfg.hidden, device="cuda", generator=g).to(getattr(torch, dtype)))
    assert dx.dtype == dtype and tuple(dx.shape) == (2, 9, cfg.hidden)


@pytest.mark.gpu
@needs_cuda
def test_model_bf16_on_cuda_matches_the_cpu_model(comm1):
    """A bfloat16 TransformerLM on cuda gives the logits of the same bfloat16 model on the CPU
    (which keeps x in float32: the difference is the activations' rounding at each GEMM)."""
    cfg = _block_cfg("llama")
    gpu = tpcore.models.TransformerLM(cfg, comm1, seed=3, device="cuda", dtype="bfloat16")
    cpu = tpcore.models.TransformerLM(cfg, comm1, seed=3, dtype="bfloat16")
    cpu.load_state_dict_full(gpu.state_dict_full())
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 9))
    lg, lc = gpu.logits(tokens), cpu.logits(tokens)
    assert _rel(lg, lc) < 3e-2
    assert gpu.param_bytes() == cpu.param_bytes()


@pytest.mark.gpu
@needs_cuda
def test_layers_w1_mlp_backward(comm1):
    """ParallelMLP (swiglu) forward and input gradient on cuda against float64."""
    torch = _torch()
    rng = np.random.default_rng(2)
    M, C, F = 19, 64, 88
    mlp = tpcore.ParallelMLP(C, F, comm1, activation="swiglu", device="cuda")
    W1, b1 = rng.standard_normal((2 * F, C)) / 8, rng.standard_normal(2 * F) / 4
    W2, b2 = rng.standard_normal((C, F)) / 9, rng.standard_normal(C) / 4
    mlp.fc1.load_full(W1.astype(np.float32), b1.astype(np.float32))
    mlp.fc2.load_full(W2.astype(np.float32), b2.astype(np.float32))
    x, dy = rng.standard_normal((M, C)), rng.standard_normal((M, C))
    y = mlp.forward(torch.from_numpy(x.astype(np.float32)).cuda())
    h = x @ W1.T + b1
    want = ref.act("swiglu", h) @ W2.T + b2
    assert _rel(_to_host(y), want) < 2e-3
    dx = mlp.backward(torch.from_numpy(dy.astype(np.float32)).cuda())
    g, u = h[:, :F], h[:, F:]
    sg = 1 / (1 + np.exp(-g))
    dact = dy @ W2
    dh = np.concatenate([dact * u * (sg * (1 + g * (1 - sg))), dact * g * sg], 1)
    assert _rel(_to_host(dx), dh @ W1) < 2e-3


def _block_cfg(kind):
    if kind == "llama":
        return tpcore.Config(vocab_size=97, hidden=64, layers=1, heads=4, kv_heads=2, ffn_hidden=96, norm="rmsnorm",
                             activation="swiglu", positions="rope", bias=False, max_positions=64, model_type="llama")
    return tpcore.Config(vocab_size=97, hidden=64, layers=1, heads=4, ffn_hidden=128, max_positions=64)


def _block_params(blk_or_shapes, seed):
    shapes = blk_or_shapes if isinstance(blk_or_shapes, dict) else blk_or_shapes.full_shapes()
    rng = np.random.default_rng(seed)
    P = {}
    for name, shape in shapes.items():
        if "norm" in name and name.endswith("weight"):
            P[name] = 1 + 0.1 * rng.standard_normal(shape)
        else:
            P[name] = rng.standard_normal(shape) / math.sqrt(shape[-1])
    return P


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_layers_w1_block(comm1, kind):
    """A TransformerBlock on cuda (causal attention, the fused kernel) against the float64 reference."""
    torch = _torch()
    cfg = _block_cfg(kind)
    blk = tpcore.TransformerBlock(cfg, comm1, device="cuda")
    P = _block_params(blk, 3)
    blk.load_full({k: v.astype(np.float32) for k, v in P.items()})
    x = np.random.default_rng(4).standard_normal((2, 23, cfg.hidden))
    y = blk.forward(torch.from_numpy(x.astype(np.float32)).cuda())
    assert _rel(_to_host(y), ref.block(cfg, P, x)) < 2e-3


# ------------------------------------------------------------------ world 2 and rank functions
def _nccl_env(monkeypatch, world):
    """The NCCL of ../shared/device for two ranks on one GPU; skip where there is none."""
    lib = os.environ.get("TPCORE_NCCL_LIBRARY")
    if not lib and (ROOT / ".nccl230" / "libnccl.so.2").exists():
        lib = str(ROOT / ".nccl230" / "libnccl.so.2")
        monkeypatch.setenv("TPCORE_NCCL_LIBRARY", lib)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    monkeypatch.setenv("NCCL_MAX_CTAS", os.environ.get("NCCL_MAX_CTAS", "4"))
    if world > 1:
        if not lib:
            pytest.skip("two NCCL ranks on one GPU need NCCL >= 2.30: set TPCORE_NCCL_LIBRARY, or run "
                        "scripts/prepare_gpu_wheels.sh and carry .nccl230/")
        v = _nccl_version(lib)
        if v < 23000:
            pytest.skip(f"{lib} is NCCL {v}; two ranks on one GPU need 2.30 or newer")


def _nccl_version(lib):
    # in a child: this process keeps no second libnccl.so.2
    r = subprocess.run([sys.executable, "-c", "import ctypes, sys; v = ctypes.c_int(0); "
                        "ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v)); print(v.value)", lib],
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
        pytest.fail(f"cannot read ncclGetVersion of {lib}: {r.stderr[-500:]}")
    return int(r.stdout.strip())


def _spawn(fn, world, backend, *args):
    return tpcore.spawn(fn, world, args=args, backend=backend, start_method="spawn", deadline=150, timeout=60)


def _rank_data(rank, n, seed=10):
    return np.random.default_rng(seed + rank).standard_normal(n).astype(np.float32)


def _a2a_sizes(n):
    """Elements rank p sends rank q in the all_to_all case: [p][q]."""
    return [[(p + 2 * q + 1) % 4 * 5 for q in range(n)] for p in range(n)]


def _rank_collectives(comm, lib):
    """Run by every rank: each collective on device buffers; host results back to the test."""
    r, n = comm.rank, comm.size
    out = {}
    x = _to_device(_rank_data(r, 1001), lib)
    comm.all_reduce(x)
    out["all_reduce_sum"] = _to_host(x)
    x = _to_device(_rank_data(r, 1001), lib)
    comm.all_reduce(x, op="avg")
    out["all_reduce_avg"] = _to_host(x)
    x = _to_device(_rank_data(r, 1001), lib)
    comm.all_reduce(x, op="max")
    out["all_reduce_max"] = _to_host(x)
    x = _to_device(_rank_data(r, 300), lib)
    o = _to_device(np.zeros(300 * n, np.float32), lib)
    comm.all_gather(x, out=o)
    out["all_gather_even"] = _to_host(o)
    sizes = [7 + 5 * q for q in range(n)]
    x = _to_device(_rank_data(r, sizes[r]), lib)
    o = _to_device(np.zeros(sum(sizes), np.float32), lib)
    comm.all_gather(x, sizes=sizes, out=o)
    out["all_gather_uneven"] = _to_host(o)
    x = _to_device(_rank_data(r, 64 * n), lib)
    o = _to_device(np.zeros(64, np.float32), lib)
    comm.reduce_scatter(x, out=o)
    out["reduce_scatter_even"] = _to_host(o)
    x = _to_device(_rank_data(r, sum(sizes)), lib)
    o = _to_device(np.zeros(sizes[r], np.float32), lib)
    comm.reduce_scatter(x, sizes=sizes, out=o)
    out["reduce_scatter_uneven"] = _to_host(o)
    a2a = _a2a_sizes(n)  # all_to_all: uneven, zeros among them; a new DeviceArray back
    x = _to_device(np.concatenate([_rank_data(100 * r + q, a2a[r][q]) for q in range(n)]), lib)
    out["all_to_all"] = _to_host(comm.all_to_all(x, a2a[r]))
    x = _to_device(_rank_data(r, 513), lib)
    comm.broadcast(x, root=n - 1)
    out["broadcast"] = _to_host(x)
    x = _to_device(_rank_data(r, 129), lib)
    comm.reduce(x, root=0)
    out["reduce"] = _to_host(x)
    if n > 1:
        x = _to_device(_rank_data(r, 77), lib)
        o = _to_device(np.zeros(77, np.float32), lib)
        comm.sendrecv(x, (r + 1) % n, o, (r - 1) % n)
        out["sendrecv"] = _to_host(o)
        if r == 0:
            comm.send(_to_device(_rank_data(r, 55), lib), 1)
        elif r == 1:
            o = _to_device(np.zeros(55, np.float32), lib)
            comm.recv(o, 0)
            out["send_recv"] = _to_host(o)
    sub = comm.split(0, r)
    if sub is not None:
        x = _to_device(_rank_data(r, 31), lib)
        sub.all_reduce(x)
        out["split_all_reduce"] = _to_host(x)
        sub.close()
    comm.barrier()
    return out


def _check_collectives(results, n):
    data = lambda m, seed=10: [_rank_data(q, m, seed).astype(np.float64) for q in range(n)]  # noqa: E731 (a one-line local helper)
    sizes = [7 + 5 * q for q in range(n)]
    offs = np.cumsum([0] + sizes)
    bad = []
    for r, out in enumerate(results):
        want = {"all_reduce_sum": sum(data(1001)), "all_reduce_avg": sum(data(1001)) / n,
                "all_reduce_max": np.max(data(1001), axis=0), "all_gather_even": np.concatenate(data(300)),
                "all_gather_uneven": np.concatenate([_rank_data(q, sizes[q]) for q in range(n)]),
                "reduce_scatter_even": sum(data(64 * n))[64 * r:64 * (r + 1)],
                "reduce_scatter_uneven": sum(data(sum(sizes)))[offs[r]:offs[r + 1]],
                "broadcast": data(513)[n - 1], "split_all_reduce": sum(data(31)),
                "all_to_all": np.concatenate([_rank_data(100 * q + r, _a2a_sizes(n)[q][r]) for q in range(n)])}
        if r == 0:
            want["reduce"] = sum(data(129))
        if n > 1:
            want["sendrecv"] = data(77)[(r - 1) % n]
            if r == 1:
                want["send_recv"] = data(55)[0]
        for k, w in want.items():
            if k not in out:
                bad.append(f"rank {r} {k}: no result")
            elif _rel(out[k], w) > 1e-5:
                bad.append(f"rank {r} {k}: relative error {_rel(out[k], w):.2e}")
    assert not bad, "; ".join(bad)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group,backend,world", [("nccl_w1", "nccl", 1), ("nccl_w2", "nccl", 2),
                                                  ("staged_w2", "shm", 2)])
def test_collectives(monkeypatch, group, backend, world):
    """Every collective on device buffers: NCCL at world 1 and 2 on the one GPU, and the
    host-staged path of the shm backend at world 2."""
    if backend == "nccl":
        _nccl_env(monkeypatch, world)
    results = _spawn(_rank_collectives, world, backend, _device_lib())
    assert [len(r) > 0 for r in results] == [True] * world
    _check_collectives(results, world)


def _rank_dies(comm, report):
    """Rank 1 exits in the middle of the job; rank 0, waiting for it in an all_reduce, writes what
    it saw and how long it took to `report`."""
    import json
    x = tpcore.asarray(np.ones(1024, np.float32), device=RANK_DEVICE)
    comm.all_reduce(x)
    comm.barrier()
    if comm.rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        text = "no error"
    except Exception as e:  # noqa: BLE001 - the text is what the test checks
        text = f"{type(e).__name__}: {e}"
    with open(report, "w") as f:
        json.dump({"seconds": time.monotonic() - t0, "error": text}, f)


@pytest.mark.gpu
@needs_cuda
def test_nccl_dead_peer_is_named_before_the_timeout(monkeypatch, tmp_path):
    """NCCL alone waits for a dead peer until the timeout; tpcore's wait looks at the peers'
    processes and names the dead rank within a fraction of a second."""
    _nccl_env(monkeypatch, 2)
    report = tmp_path / "rank0.json"
    with pytest.raises(tpcore.RankExitedError):  # rank 1's exit is an error of the run itself
        _spawn(_rank_dies, 2, "nccl", str(report))
    got = __import__("json").loads(report.read_text())
    assert "rank 1" in got["error"] and "died" in got["error"], got
    assert got["seconds"] < 20, got  # the timeout is 60 s


def _rank_layers(comm, lib, lin, cfg_kind, P, xb):
    """Run by every rank: a column + row linear pair and a block on the rank's device, with the
    full weights the test drew (each rank keeps its slices)."""
    W1, b1, W2, b2, x = (a.astype(np.float32) for a in lin)
    F, K = W1.shape
    col = tpcore.ColumnParallelLinear(K, F, comm, device=RANK_DEVICE)
    row = tpcore.RowParallelLinear(F, K, comm, device=RANK_DEVICE)
    col.load_full(W1, b1)
    row.load_full(W2, b2)
    y = _to_host(row(col(_to_device(x, lib))))
    blk = tpcore.TransformerBlock(_block_cfg(cfg_kind), comm, device=RANK_DEVICE)
    blk.load_full({k: v.astype(np.float32) for k, v in P.items()})
    yb = _to_host(blk.forward(_to_device(xb.astype(np.float32), lib)))
    return {"linear": y, "block": yb}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group,backend,world", [("nccl_w1", "nccl", 1), ("nccl_w2", "nccl", 2),
                                                  ("staged_w2", "shm", 2)])
def test_layers(monkeypatch, group, backend, world):
    """Layers and a Llama-style block split over the ranks, every rank's output against float64."""
    if backend == "nccl":
        _nccl_env(monkeypatch, world)
    rng = np.random.default_rng(5)
    M, K, F = 21, 48, 70
    W1, b1 = rng.standard_normal((F, K)) / 7, rng.standard_normal(F)
    W2, b2 = rng.standard_normal((K, F)) / 8, rng.standard_normal(K)
    x = rng.standard_normal((M, K))
    cfg = _block_cfg("llama")
    P = _block_params(_shapes_of(cfg), 6)
    xb = np.random.default_rng(7).standard_normal((2, 17, cfg.hidden))
    results = _spawn(_rank_layers, world, backend, _device_lib(), (W1, b1, W2, b2, x), "llama", P, xb)
    want = (x @ W1.T + b1) @ W2.T + b2
    want_b = ref.block(cfg, P, xb)
    for r, res in enumerate(results):
        assert _rel(res["linear"], want) < 2e-3, f"rank {r} linear"
        assert _rel(res["block"], want_b) < 2e-3, f"rank {r} block"


def _rank_training(comm, dtype, steps):
    """Run by every rank: the same small Llama-style model on the rank's GPU and on the CPU,
    trained side by side with AdamW (device parameters stepped on the GPU); the losses and the
    final weights come back."""
    cfg = _block_cfg("llama")
    gpu = tpcore.models.TransformerLM(cfg, comm, seed=3, device=RANK_DEVICE, dtype=dtype)
    cpu = tpcore.models.TransformerLM(cfg, comm, seed=3, dtype=dtype)
    kinds = sorted({type(p).__name__ for p, _ in gpu.parameters()})
    tokens = np.random.default_rng(9).integers(0, cfg.vocab_size, (2, 11))
    targets = np.roll(tokens, -1, 1)
    og, oc = tpcore.optim.AdamW(gpu, lr=3e-3), tpcore.optim.AdamW(cpu, lr=3e-3)
    losses = []
    for _ in range(steps):
        losses.append((gpu.loss(tokens, targets), cpu.loss(tokens, targets)))
        gpu.backward()
        cpu.backward()
        og.step()
        oc.step()
        gpu.zero_grad()
        cpu.zero_grad()
    sg, sc = gpu.state_dict_full(), cpu.state_dict_full()
    worst = max(_rel(np.asarray(sg[k]).astype(np.float32), np.asarray(sc[k]).astype(np.float32)) for k in sc)
    out = gpu.generate(tokens[:, :4], max_new_tokens=3)
    return {"losses": losses, "worst_weight_rel": worst, "kinds": kinds, "generated": [len(o) for o in out]}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group,backend,world,dtype", [("nccl_w1", "nccl", 1, "float32"),
                                                        ("nccl_w1", "nccl", 1, "bfloat16"),
                                                        ("nccl_w2", "nccl", 2, "float32"),
                                                        ("staged_w2", "shm", 2, "bfloat16")])
def test_model_training_on_the_gpu_follows_the_cpu(monkeypatch, group, backend, world, dtype):
    """TransformerLM.loss / backward and AdamW on device="cuda" (every parameter a DeviceArray,
    nothing through the host) track the same model trained on the CPU: float32 to 1e-4, bfloat16
    (whose GPU GEMMs round the activations) to a few percent; the loss goes down."""
    if backend == "nccl":
        _nccl_env(monkeypatch, world)
    results = _spawn(_rank_training, world, backend, dtype, 4)
    tol = 1e-4 if dtype == "float32" else 3e-2
    for r, res in enumerate(results):
        assert res["kinds"] == ["DeviceArray"], res["kinds"]
        for step, (lg, lc) in enumerate(res["losses"]):
            assert abs(lg - lc) <= tol * (1 + abs(lc)), f"rank {r} step {step}: {lg} vs {lc}"
        assert res["losses"][-1][0] < res["losses"][0][0], res["losses"]
        assert res["worst_weight_rel"] < (1e-4 if dtype == "float32" else 5e-2), res["worst_weight_rel"]
        assert res["generated"] == [7, 7]


def _shapes_of(cfg):
    """The full parameter shapes of a block of cfg (from a CPU block: the same names on every device)."""
    c = tpcore.init()
    try:
        return tpcore.TransformerBlock(cfg, c).full_shapes()
    finally:
        c.close()


# ------------------------------------------------------------------------------------- DLPack
def _import_device(obj):
    """tpcore's import of a CUDA tensor as a DeviceArray (the names the API may have)."""
    f = getattr(tpcore, "from_dlpack", None)
    if f is not None:
        try:
            return f(obj, writable=True)  # the tests write through the round trip
        except TypeError:
            return f(obj)
    f = getattr(tpcore, "asarray", None)
    if f is not None:
        return f(obj, copy=False)
    DA = getattr(tpcore, "DeviceArray", None)
    if DA is not None:
        f = getattr(DA, "from_dlpack", None)
        return f(obj) if f is not None else DA(obj)
    pytest.skip("this tpcore has no from_dlpack / asarray / DeviceArray to import a CUDA tensor with")


@pytest.mark.gpu
@needs_cuda
def test_dlpack_torch_round_trip_no_copy():
    torch = _torch()
    t = torch.arange(1000, dtype=torch.float32, device="cuda").reshape(10, 100)
    d = _import_device(t)
    assert d.__dlpack_device__()[0] == KDL_CUDA
    back = torch.from_dlpack(d)
    assert back.data_ptr() == t.data_ptr(), "the round trip copied the tensor"
    assert back.shape == t.shape and back.dtype == t.dtype
    back[3, 7] = -5.0  # one memory: the write shows through the original
    torch.cuda.synchronize()
    assert float(t[3, 7]) == -5.0


@pytest.mark.gpu
@needs_cuda
def test_dlpack_cupy_round_trip_no_copy():
    cupy = _cupy()
    a = cupy.arange(777, dtype=cupy.float32)
    d = _import_device(a)
    back = cupy.from_dlpack(d)
    assert back.data.ptr == a.data.ptr, "the round trip copied the array"
    back[5] = 42
    assert float(a[5]) == 42.0


@pytest.mark.gpu
@needs_cuda
def test_dlpack_layer_output_is_shared(comm1):
    """A layer's DeviceArray output seen by torch and by CuPy is one memory, with the right values."""
    torch = _torch()
    cupy = _cupy()
    rng = np.random.default_rng(8)
    W = rng.standard_normal((33, 40)).astype(np.float32)
    lin = tpcore.ColumnParallelLinear(40, 33, comm1, bias=False, device="cuda")
    lin.load_full(W)
    x = rng.standard_normal((9, 40)).astype(np.float32)
    y = lin(cupy.asarray(x))
    assert y.__dlpack_device__()[0] == KDL_CUDA
    ty, cy = torch.from_dlpack(y), cupy.from_dlpack(y)
    assert ty.data_ptr() == cy.data.ptr
    assert _rel(ty.cpu().numpy(), x.astype(np.float64) @ W.T.astype(np.float64)) < 2e-3


@pytest.mark.gpu
@needs_cuda
def test_dlpack_versioned_capsule(comm1):
    """__dlpack__(max_version=(1, 0)) gives a versioned capsule; without it the legacy one."""
    torch = _torch()
    lin = tpcore.ColumnParallelLinear(8, 4, comm1, device="cuda")
    y = lin(torch.ones(2, 8, device="cuda"))
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    assert name(y.__dlpack__(max_version=(1, 0))) == b"dltensor_versioned"
    assert name(y.__dlpack__()) == b"dltensor"


# ------------------------------------------------------------------------------------- errors
@pytest.mark.gpu
@needs_cuda
def test_errors_cpu_tensor_to_cuda_layer(comm1):
    torch = _torch()
    lin = tpcore.ColumnParallelLinear(16, 8, comm1, device="cuda")
    with pytest.raises((TypeError, ValueError, BufferError)) as e:
        lin(torch.ones(3, 16))
    assert re.search(r"cpu|host|device", str(e.value), re.I), str(e.value)


@pytest.mark.gpu
@needs_cuda
def test_errors_cuda_tensor_to_cpu_layer(comm1):
    torch = _torch()
    lin = tpcore.ColumnParallelLinear(16, 8, comm1)
    with pytest.raises((TypeError, ValueError, BufferError)) as e:
        lin(torch.ones(3, 16, device="cuda"))
    assert re.search(r"cuda|device", str(e.value), re.I), str(e.value)


@pytest.mark.gpu
@needs_cuda
def test_errors_bad_dtype_and_strides(comm1):
    torch = _torch()
    lin = tpcore.ColumnParallelLinear(16, 8, comm1, bias=False, device="cuda")
    with pytest.raises((TypeError, ValueError)) as e:
        lin(torch.ones(3, 16, dtype=torch.int32, device="cuda"))
    assert "int32" in str(e.value), str(e.value)
    # a transposed (strided) tensor: a clear error, or the right answer
    W = np.random.default_rng(9).standard_normal((8, 16)).astype(np.float32)
    lin.load_full(W)
    xt = torch.randn(16, 3, device="cuda").t()
    try:
        y = lin(xt)
    except (TypeError, ValueError) as e:
        assert re.search(r"contiguous|stride", str(e), re.I), str(e)
    else:
        assert _rel(_to_host(y), xt.double().cpu().numpy() @ W.T.astype(np.float64)) < 2e-3


def test_bench_gpu_json(tmp_path):
    """python -m tpcore.bench gpu: without a GPU, a JSON that says why it did not run; with one, a
    quick run (small GEMMs, the tiny GPT-2-style model, no HF) whose rows are filled and correct."""
    path = tmp_path / "gpu.json"
    args = [sys.executable, "-m", "tpcore.bench", "gpu", "--json", str(path)]
    if CUDA:
        args += ["--quick", "--models", "gpt2-small", "--no-hf", "--new", "32", "--repeats", "1", "--budget", "120"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = __import__("json").loads(path.read_text())
    if not CUDA:
        assert data["skipped"].startswith("no GPU"), data
        assert "not run: no GPU" in r.stdout
        return
    rows = data["gemm"].get("rows") or []
    if rows:  # torch is there: each row (float32 and bfloat16) ran and matched torch
        assert {x["dtype"] for x in rows} == {"float32", "bfloat16"}, rows
        assert all(x["tpcore_tflops"] and x["ok"] for x in rows), rows
    t = data["decode"]["gpt2-small"]["tpcore"]
    assert not t.get("skipped"), t
    assert t["decode_tok_s"] > 0 and t["ttft_ms"] > 0 and t["tokens_shape"] == [1, 16 + 32]
