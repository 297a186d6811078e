"""The NCCL backend: what can be checked without a GPU (its error paths: no library,
the search order, a library too old, one lacking a symbol, one fine on a machine
without a CUDA device; backend "auto" falling back to shm), and, where a GPU and
NCCL are present, the collectives themselves (skipped here with the reason).

The binding keeps a library that loaded for the life of the process, so every case
that loads a fake runs in a child interpreter of its own.  The fakes are built with
cc from csrc/tests/fake_nccl.c into tmp_path."""
import os
import shutil
import subprocess
import sys

import pytest

import tpcore
from c_binaries import ROOT, build

FAKE_SRC = ROOT / "csrc" / "tests" / "fake_nccl.c"
# Where the tpcore under test lives (the source tree after build_ext --inplace, or
# site-packages after pip install): child processes import that one.
PYTHONPATH = os.path.dirname(os.path.dirname(os.path.abspath(tpcore.__file__)))


def fake(tmp_path, name, *flags, subdir=""):
    """A fake libnccl.so.2 in tmp_path/name[/subdir]; flags: -DFAKE_VERSION=..., -DFAKE_OMIT_SPLIT."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake NCCL library")
    d = tmp_path / name / subdir if subdir else tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    out = d / "libnccl.so.2"
    r = subprocess.run([cc, "-shared", "-fPIC", *flags, str(FAKE_SRC), "-o", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


CHILD = r"""
import sys, tpcore
backend = sys.argv[1]
try:
    c = tpcore.init(backend=backend, timeout=10)
except tpcore.CommError as e:
    print("ERROR:" + str(e))
else:
    print("BACKEND:" + c.backend)
    c.close()
"""


def child(backend, **env):
    """tpcore.init(backend) in a child of one rank with env; 'ERROR:<msg>' or 'BACKEND:<name>'."""
    e = {k: v for k, v in os.environ.items()
         if k not in ("TPCORE_NCCL_LIBRARY", "CUDA_HOME", "CUDA_PATH", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    e.update(PYTHONPATH=PYTHONPATH, TPCORE_SETTLE_S="0", **env)
    r = subprocess.run([sys.executable, "-c", CHILD, backend], capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("ERROR:", "BACKEND:"))]
    assert len(lines) == 1, r.stdout + r.stderr
    return lines[0]


def cuda_usable():
    f = getattr(tpcore, "cuda_available", None)
    return bool(f and f())


def test_backends_listed():
    assert tpcore.build_info()["backends"] == ["shm", "nccl", "mpi"]


def test_no_library_at_the_override():
    out = child("nccl", TPCORE_NCCL_LIBRARY="/nonexistent/libnccl.so.2")
    assert out.startswith("ERROR:init: backend nccl: cannot load NCCL from "
                          "TPCORE_NCCL_LIBRARY=/nonexistent/libnccl.so.2")


def test_no_library_names_the_search_order(tmp_path):
    home = tmp_path / "cuda-home"
    out = child("nccl", CUDA_HOME=str(home))
    assert out.startswith("ERROR:init: backend nccl: cannot find NCCL: tried TPCORE_NCCL_LIBRARY (unset)"), out
    # the override, then CUDA_HOME, then /usr/local/cuda, then the loader path, each soname in order
    places = [f"{home}/lib64/libnccl.so.2", f"{home}/lib64/libnccl.so", "/usr/local/cuda/lib64/libnccl.so.2",
              ", libnccl.so.2", ", libnccl.so;"]
    pos = [out.find(p) for p in places]
    assert all(p > 0 for p in pos) and pos == sorted(pos), out
    assert "TPCORE_NCCL_LIBRARY at the library file" in out


def test_library_too_old_names_path_and_version(tmp_path):
    lib = fake(tmp_path, "old", "-DFAKE_VERSION=21603")
    out = child("nccl", TPCORE_NCCL_LIBRARY=str(lib))
    assert out.startswith("ERROR:init: backend nccl: NCCL at "), out
    assert f"{lib} is version 2.16.3, too old: tpcore needs 2.19.0 or later" in out


def test_old_version_numbering_before_2_9(tmp_path):
    lib = fake(tmp_path, "older", "-DFAKE_VERSION=2804")  # NCCL_VERSION(2,8,4) = 2804: the old encoding
    out = child("nccl", TPCORE_NCCL_LIBRARY=str(lib))
    assert "is version 2.8.4, too old" in out, out


def test_library_found_through_cuda_home(tmp_path):
    lib = fake(tmp_path, "home", "-DFAKE_VERSION=21603", subdir="lib64")
    out = child("nccl", CUDA_HOME=str(tmp_path / "home"))
    assert f"NCCL at {lib} is version 2.16.3, too old" in out, out


def test_library_lacking_a_symbol(tmp_path):
    lib = fake(tmp_path, "nosym", "-DFAKE_OMIT_SPLIT")
    out = child("nccl", TPCORE_NCCL_LIBRARY=str(lib))
    assert out == f"ERROR:init: backend nccl: NCCL at {lib} has no symbol ncclCommSplit (too old a version?)", out


@pytest.mark.skipif(cuda_usable(), reason="this machine has a usable CUDA device")
def test_good_library_without_a_cuda_device(tmp_path):
    lib = fake(tmp_path, "good")
    out = child("nccl", TPCORE_NCCL_LIBRARY=str(lib))
    assert out.startswith("ERROR:init: backend nccl: no CUDA device is usable in this process ("), out


@pytest.mark.skipif(cuda_usable(), reason="this machine has a usable CUDA device")
@pytest.mark.parametrize("which", ["none", "good"])
def test_auto_falls_back_to_shm(tmp_path, which):
    env = {"TPCORE_NCCL_LIBRARY": str(fake(tmp_path, "good"))} if which == "good" else {}
    assert child("auto", **env) == "BACKEND:shm"
    assert child("shm", **env) == "BACKEND:shm"


def test_probe_names_unknown_backends():
    assert tpcore._C.Comm.probe("shm") is None
    why = tpcore._C.Comm.probe("gloo")
    assert why == "backend 'gloo' is not available in this build (available: shm, nccl, mpi)"


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match=r"init: backend must be one of 'auto', 'shm', 'nccl', 'mpi', got 'gloo'"):
        tpcore.init(backend="gloo")


@pytest.mark.slow  # builds the C core and test_nccl.c; the tests above cover the same paths from Python
def test_c_error_paths(c_builds):
    """csrc/tests/test_nccl.c: the same paths through the C API (probe and tp_comm_init_rank)."""
    b = build(c_builds, False, "test_nccl", "fake_nccl/old/libnccl.so.2", "fake_nccl/nosym/libnccl.so.2",
              "fake_nccl/good/libnccl.so.2", "fake_nccl/home/lib64/libnccl.so.2")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["TPCORE_TEST_FAKE_NCCL"] = str(b / "fake_nccl")
    r = subprocess.run([str(b / "test_nccl")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "nccl error paths: passed" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable() or tpcore._C.Comm.probe("nccl") is not None,
                    reason="needs a CUDA device and NCCL (the device check, scripts/gpu_check.sh, runs "
                           "csrc/tests/test_nccl_gpu.c there)")
def test_nccl_world_1_on_the_gpu():
    c = tpcore.init(backend="nccl")
    try:
        assert c.backend == "nccl" and c.size == 1
    finally:
        c.close()
