"""The CUDA plugin's build and loading, on a machine with or without a GPU: the plugin is
built when nvcc exists and loads; `import tpcore` does not load it; status says why CUDA
is or is not usable; TPCORE_CUDA_PLUGIN pointing at a missing file, a wrong file, or a
plugin of another ABI or version gives a clear error; a TPCORE_CUDA=0 build is CPU-only;
the device table's stream entries on the CPU."""
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import tpcore
from tpcore import _C

import paths
from c_binaries import cpu_only_extension, setup_py_functions
ROOT = str(paths.ROOT)

# Where the tpcore under test lives (the source tree after build_ext --inplace, or
# site-packages after pip install): child processes import that one.
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(tpcore.__file__)))

CC = shutil.which("cc") or shutil.which("gcc")
PLUGIN = os.path.join(os.path.dirname(_C.__file__), ".libs", "libtpcore_cuda.so")
ENTRY = "tp_cuda_plugin_init_v1"


def _nvcc():
    plan = setup_py_functions()["cuda_plan"]("")
    return plan.get("nvcc")


def _driver_present():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _run(code, env_extra=None, drop=("TPCORE_CUDA_PLUGIN",)):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = PKG_PARENT
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


_PROBE = """
import json, tpcore
from tpcore import _C
out = {"available": tpcore.cuda_available(), "info": tpcore.build_info()["cuda"], "status": _C._cuda_status(),
       "devices": tpcore.build_info()["devices"]}
try:
    _C._device_stream_entries(1, 0)
    out["use"] = "ok"
except Exception as e:
    out["use"] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""

needs_plugin = pytest.mark.skipif(not os.path.exists(PLUGIN), reason="this build has no CUDA plugin (no nvcc, "
                                  "or TPCORE_CUDA=0)")


def test_plugin_is_built_when_nvcc_exists():
    info = _C._cuda_info()
    if _nvcc() is None:
        assert info["why_not_built"].startswith("nvcc was not found")
        pytest.skip("no nvcc here: the build is CPU-only, as checked")
    if os.environ.get("TPCORE_CUDA", "") == "0" or info["why_not_built"]:
        pytest.skip(f"this build is CPU-only on purpose: {info['why_not_built']}")
    assert info["why_not_built"] == ""
    assert os.path.exists(PLUGIN), "setup.py must place the plugin beside the vendored BLAS (tpcore/.libs)"


@needs_plugin
def test_plugin_exports_one_symbol_and_links_cudart_statically():
    nm, readelf = shutil.which("nm"), shutil.which("readelf")
    if not nm or not readelf:
        pytest.skip("no binutils (nm, readelf)")
    syms = subprocess.run([nm, "-D", "--defined-only", PLUGIN], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in syms.splitlines() if line.strip()]
    assert names == [ENTRY], names
    needed = subprocess.run([readelf, "-d", PLUGIN], capture_output=True, text=True, check=True).stdout
    assert "libcudart" not in needed and "libcuda.so" not in needed, needed  # cudart static; the driver by dlopen
    assert "libcublas" not in needed and "libnccl" not in needed


def test_import_does_not_load_the_plugin():
    out = _run("import json, tpcore\n"
               "maps = open('/proc/self/maps').read()\n"
               "print(json.dumps({'mapped': 'libtpcore_cuda' in maps, 'status': tpcore._C._cuda_status(),\n"
               "                  'devices': tpcore._C.build_info()['devices']}))\n")
    assert out == {"mapped": False, "status": "not loaded: nothing has used CUDA yet", "devices": ["cpu"]}


@needs_plugin
def test_loads_and_says_why_cuda_is_not_usable():
    out = _run(_PROBE)
    info = out["info"]
    assert info["built"] is True
    assert os.path.realpath(info["plugin"]) == os.path.realpath(PLUGIN)
    assert info["runtime"].startswith("CUDA ") and "sm_" in info["arch"] and "PTX" in info["arch"]
    assert info["status"] == out["status"]
    if _driver_present():
        pytest.skip(f"a driver is present here: status is {out['status']!r}")
    assert out["status"] == "no NVIDIA driver (libcuda.so.1 not found)"
    assert out["available"] is False and out["devices"] == ["cpu"]
    assert out["use"] == ("RuntimeError: device_set_current: no cuda device is usable in this process: "
                          "no NVIDIA driver (libcuda.so.1 not found)")


def test_cuda_available_is_false_without_a_gpu():
    if _driver_present():
        pytest.skip("a driver is present here")
    assert tpcore.cuda_available() is False
    status = tpcore.build_info()["cuda"]["status"]
    assert status.startswith("not built: ") or status.startswith("no NVIDIA driver"), status


def _plugin_env_case(path):
    out = _run(_PROBE, {"TPCORE_CUDA_PLUGIN": str(path)})
    assert out["available"] is False and out["devices"] == ["cpu"]
    assert out["status"].startswith("not loaded: ")
    assert out["use"].startswith("RuntimeError: device_set_current: no cuda device is usable in this process: "
                                 "not loaded: ")
    return out["status"]


def test_plugin_variable_missing_file(tmp_path):
    path = tmp_path / "nowhere" / "libtpcore_cuda.so"
    status = _plugin_env_case(path)
    assert f"cannot load the CUDA plugin from TPCORE_CUDA_PLUGIN={path}" in status and "No such file" in status


def test_plugin_variable_wrong_file(tmp_path):
    path = tmp_path / "libtpcore_cuda.so"
    path.write_text("not a shared library\n" * 200)  # long enough to be read as a (bad) ELF header
    status = _plugin_env_case(path)
    assert f"TPCORE_CUDA_PLUGIN={path}" in status and "invalid ELF header" in status


def _fake_plugin(tmp_path, body, name="libfake_plugin.so"):
    src = tmp_path / "fake.c"
    src.write_text('#include <stdint.h>\n#include <string.h>\n'
                   'typedef struct { uint32_t abi_version, size; const char *tpcore_version, *build;\n'
                   '  const void *device, *kernels; const char *(*status)(void); } plugin_t;\n' + body)
    out = tmp_path / name
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True, timeout=120)
    return out


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_plugin_of_another_abi_is_refused(tmp_path):
    lib = _fake_plugin(tmp_path, f"int {ENTRY}(const void *host, plugin_t *out) {{\n"
                                 "  out->abi_version = 99; out->size = sizeof *out; out->tpcore_version = \"9.9.9\";\n"
                                 "  return 9; }\n")
    status = _plugin_env_case(lib)
    assert f"the CUDA plugin {lib} has plugin ABI 99 (tpcore 9.9.9), but this tpcore {tpcore.__version__} " \
           "needs ABI 3" in status
    assert "rebuild" in status


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_plugin_of_another_version_is_refused(tmp_path):
    lib = _fake_plugin(tmp_path, f"int {ENTRY}(const void *host, plugin_t *out) {{\n"
                                 "  out->abi_version = 3; out->size = sizeof *out; out->tpcore_version = \"9.9.9\";\n"
                                 "  return 0; }\n")
    status = _plugin_env_case(lib)
    assert f"was built from tpcore 9.9.9, but this is tpcore {tpcore.__version__}" in status


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_library_without_the_entry_is_refused(tmp_path):
    lib = _fake_plugin(tmp_path, "int something_else(void) { return 0; }\n")
    status = _plugin_env_case(lib)
    assert f"{lib} is not a tpcore CUDA plugin: it has no symbol {ENTRY}" in status


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_plugin_that_fails_to_start_or_gives_no_table(tmp_path):
    failing = _fake_plugin(tmp_path, f"int {ENTRY}(const void *host, plugin_t *out) {{\n"
                                     "  out->abi_version = 3; out->size = sizeof *out; return 10; }\n", "libfail.so")
    assert f"the CUDA plugin {failing} failed to start" in _plugin_env_case(failing)
    version = tpcore.__version__
    empty = _fake_plugin(tmp_path, f"int {ENTRY}(const void *host, plugin_t *out) {{\n"
                                   "  out->abi_version = 3; out->size = sizeof *out;\n"
                                   f"  out->tpcore_version = \"{version}\"; return 0; }}\n", "libempty.so")
    assert f"the CUDA plugin {empty} gave no CUDA device table" in _plugin_env_case(empty)


def test_device_stream_entries_on_the_cpu():
    out = _C._device_stream_entries(0, 0)  # set_current, query, stream_wait, mem_info: no streams on the CPU
    assert out["done"] == 1
    assert 0 < out["free"] <= out["total"]
    with pytest.raises(ValueError, match="device_set_current: device type 7 is not a tp_device_t"):
        _C._device_stream_entries(7, 0)
    with pytest.raises(ValueError, match="device_set_current: device type -1 is not a tp_device_t"):
        _C._device_stream_entries(-1, 0)


def test_cuda_plan_without_nvcc_or_with_cuda_off(monkeypatch):
    s = setup_py_functions()
    monkeypatch.setenv("TPCORE_CUDA", "0")
    assert s["cuda_plan"]("") == {"why_not": "TPCORE_CUDA=0 at build time"}
    monkeypatch.delenv("TPCORE_CUDA")
    assert "sanitized" in s["cuda_plan"]("address")["why_not"]
    monkeypatch.setitem(s["cuda_plan"].__globals__, "find_nvcc", lambda: None)
    assert s["cuda_plan"]("")["why_not"].startswith("nvcc was not found at build time")
    monkeypatch.setenv("TPCORE_CUDA_ARCHS", "sm_90, 80")
    assert s["cuda_archs"]() == [80, 90] and s["arch_text"]([80, 90]) == "sm_80 sm_90 + compute_90 PTX"
    monkeypatch.setenv("TPCORE_CUDA_ARCHS", "hopper")
    with pytest.raises(SystemExit, match="not an architecture"):
        s["cuda_archs"]()


@pytest.mark.slow  # a whole build; its TPCORE_CUDA=0 plan: test_cuda_plan_without_nvcc_or_with_cuda_off
def test_cpu_only_build(c_builds, tmp_path):
    """TPCORE_CUDA=0: the build says so, places no plugin, and build_info / cuda_available
    report why (the same as a machine without nvcc).  The build is the session's CPU-only one
    (c_binaries.cpu_only_extension), which test_sanitized builds on top of."""
    built = cpu_only_extension(c_builds)
    log, lib = built["log"], built["lib"]
    assert "cuda: CPU-only build, no CUDA plugin: TPCORE_CUDA=0 at build time" in log
    # what a user sees under `pip install -v .`: each step as it starts and ends, no deprecation
    # the MPI plugin follows when mpicc is there; the CUDA plugin must not (TPCORE_CUDA=0)
    steps = re.search(r"^\[tpcore build\] to build: (the extension tpcore\._C[^\n]*)$", log, re.M)
    assert steps and "CUDA" not in steps.group(1), log[-3000:]
    assert re.search(r"\[tpcore build\] extension tpcore._C: built in \d+ s", log), log[-3000:]
    assert "SetuptoolsDeprecationWarning" not in log and "project.license" not in log
    assert "nvcc " not in log.replace("nvcc was", "")  # nothing was compiled by nvcc
    assert not os.path.exists(lib / "tpcore" / ".libs" / "libtpcore_cuda.so")
    env = dict(os.environ, PYTHONPATH=str(lib))
    env.pop("TPCORE_CUDA_PLUGIN", None)
    code = ("import json, tpcore\n"
            "print(json.dumps({'available': tpcore.cuda_available(), 'cuda': tpcore.build_info()['cuda'],\n"
            "                  'file': tpcore._C.__file__}))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(str(lib))
    assert out["available"] is False
    assert out["cuda"] == {"built": False, "why_not_built": "TPCORE_CUDA=0 at build time",
                           "status": "not built: TPCORE_CUDA=0 at build time"}


@pytest.mark.slow  # nvcc compiles the plugin; the one setup.py built: test_loads_and_says_why_cuda_is_not_usable
@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_makefile_cuda_builds_the_plugin(tmp_path):
    if _nvcc() is None:
        pytest.skip("no nvcc")
    build = tmp_path / "b"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # nvcc crashes under the sanitized suite's ASan
    r = subprocess.run(["make", "-s", "CUDA=1", "CUDA_ARCHS=90", f"BUILD={build}", f"{build}/libtpcore_cuda.so"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lib = build / "libtpcore_cuda.so"
    assert lib.exists()
    status = _run(_PROBE, {"TPCORE_CUDA_PLUGIN": str(lib)})["status"]
    assert not status.startswith("not loaded"), status  # it loads (and says why a GPU is usable or not)


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_plugin_with_incomplete_tables_is_refused(tmp_path):
    """A kernel table with a NULL entry, or a device table without alloc, fails the load, and
    then no CUDA device is registered (usable exactly when the load succeeded)."""
    version = tpcore.__version__
    tables = ("static struct { int type; const char *name; void *entries[13]; } dev = {1, \"cuda\", {0}};\n"
              "static void *kernels[64];\n")
    no_kernel = _fake_plugin(tmp_path, tables + f"int {ENTRY}(const void *host, plugin_t *out) {{\n"
                             "  out->abi_version = 3; out->size = sizeof *out;\n"
                             f"  out->tpcore_version = \"{version}\"; out->device = &dev; out->kernels = kernels;\n"
                             "  out->status = (const char *(*)(void))0x1; return 0; }\n", "libnokernels.so")
    status = _plugin_env_case(no_kernel)
    assert f"the CUDA plugin {no_kernel}: kernels_register: the cuda kernel table lacks gemm" in status
    no_alloc = _fake_plugin(tmp_path, tables + f"int {ENTRY}(const void *host, plugin_t *out) {{\n"
                            "  out->abi_version = 3; out->size = sizeof *out;\n"
                            f"  out->tpcore_version = \"{version}\"; out->device = &dev;\n"
                            "  out->status = (const char *(*)(void))0x1; return 0; }\n", "libnoalloc.so")
    assert f"the CUDA plugin {no_alloc}: device_register: cuda table lacks a required entry" in \
        _plugin_env_case(no_alloc)


def _selftest_expected(n):
    src = bytes((i * 7 + 3) & 0xFF for i in range(n))
    want = bytearray(b"\x5a" * n)
    want[: n // 2] = src[: n // 2]
    for r in range(2):
        at = n // 2 + r * (n // 4)
        want[at: at + n // 8] = src[at: at + n // 8]
    return src, bytes(want)


@pytest.mark.parametrize("n", [64, 4096 + 64])
def test_device_table_selftest_on_the_cpu(n):
    out = _C._device_selftest(0, 0, n)
    src, want = _selftest_expected(n)
    assert out["src"] == src and out["back"] == want
    assert out["owns_device"] is True and out["host_claimed"] is False and out["done"] == 1
    with pytest.raises(ValueError, match="multiple of 64"):
        _C._device_selftest(0, 0, 65)


@pytest.mark.gpu
@pytest.mark.skipif(not tpcore.cuda_available(), reason="no CUDA GPU in this process: "
                    + tpcore.build_info()["cuda"]["status"])
@pytest.mark.parametrize("n", [64, (1 << 20) + 64])
def test_device_table_selftest_on_the_gpu(n):
    out = _C._device_selftest(1, 0, n)
    src, want = _selftest_expected(n)
    assert out["back"] == want
    assert out["owns_device"] is True and out["owner_id"] == 0 and out["host_claimed"] is False
    assert out["done"] == 1
    free, total = _C._device_stream_entries(1, 0)["free"], _C._device_stream_entries(1, 0)["total"]
    assert 0 < free <= total
    with pytest.raises(ValueError, match="device id 99 is out of range"):
        _C._device_stream_entries(1, 99)


def test_cuda_plugin_step_reports_its_progress(tmp_path, monkeypatch, capsys):
    """build_cuda_plugin with stand-ins for nvcc and the C compiler (each writes its -o file): the
    step says when it starts (archs, how to skip it), each file as it ends, when it is done,
    and that a second build has nothing to do."""
    s = setup_py_functions()
    monkeypatch.chdir(ROOT)
    fake = tmp_path / "fake-tool"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    fake.chmod(0o755)
    plan = {"nvcc": str(fake), "root": str(tmp_path), "archs": [80, 90]}
    lib = s["build_cuda_plugin"](plan, str(tmp_path / "b"), [str(fake)], jobs=2)
    assert os.path.exists(lib)
    err = capsys.readouterr().err
    steps, _, _ = s["cuda_plugin_commands"](plan, "x", ["cc"])
    n = len(steps)
    assert (f"[tpcore build] CUDA plugin: building libtpcore_cuda.so for sm_80, sm_90 (+ compute_90 PTX) with "
            f"{fake}: {n} of {n} files, 2 at a time") in err
    assert "TPCORE_CUDA=0 skips it" in err
    assert len(re.findall(rf"CUDA plugin: \[\d+/{n}\] \S+ \(\d+ s\)", err)) == n
    assert re.search(r"CUDA plugin: built in \d+ s", err)
    s["build_cuda_plugin"](plan, str(tmp_path / "b"), [str(fake)], jobs=2)
    assert capsys.readouterr().err == "[tpcore build] CUDA plugin: up to date\n"
