"""Build C test binaries of the core with make (plain, or under ASan + UBSan) and run them
without Python in the loop: the one helper of test_c_core, test_kernels, test_api_hostile and
test_nccl; and the CPU-only extension that test_cuda_build and test_sanitized share.

The builds of a test session share one build directory per configuration (the c_builds
fixture of conftest): the core is compiled once per configuration, and each test makes only
its own binary on top (make rebuilds whatever its sources or headers changed)."""
import os
import pathlib
import shutil
import subprocess

import pytest
from filelock import FileLock

ROOT = pathlib.Path(__file__).resolve().parents[1]


def build(builds, sanitize, *targets):
    """make the targets in the build directory of the configuration under builds (the session's
    c_builds); returns that directory."""
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.skip("make or a C compiler is missing")
    out = builds / ("san" if sanitize else "plain")
    args = ["make", "-s", f"-j{min(2, os.cpu_count() or 1)}", "-C", str(ROOT), f"BUILD={out}",
            *(f"{out}/{t}" for t in targets)]
    if sanitize:
        args.insert(1, "SANITIZE=1")
    out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock", timeout=900):  # another xdist worker building the same directory
        r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def run(path, timeout=900):
    """Run one binary; no sanitizer report may appear (its exit status is the caller's to check)."""
    # the binaries carry their own sanitizer runtime (or none): not the one the sanitized
    # suite preloads into Python; a hostile size must come back as an error, not abort
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:allocator_may_return_null=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    r = subprocess.run([str(path)], capture_output=True, text=True, timeout=timeout, env=env)
    assert "ERROR: AddressSanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr
    return r


def cpu_only_extension(builds):
    """The extension tpcore._C built once per session by setup.py with TPCORE_CUDA=0 and no
    sanitizer (what a machine without nvcc builds), in builds/ext-plain: its lib/ holds the
    package (the pure-Python files copied beside the built extension), tmp/ the objects, and
    log.txt setup.py's stderr.  test_cuda_build checks this build, and test_sanitized builds
    under ASan + UBSan on top of a copy of it (a sanitized build must reuse nothing of it)."""
    import sys
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    out = builds / "ext-plain"
    lib, tmp, log = out / "lib", out / "tmp", out / "log.txt"
    with FileLock(str(out) + ".lock", timeout=900):
        if not log.exists():
            env = dict(os.environ, TPCORE_CUDA="0", TPCORE_SANITIZE="")
            env.pop("TPCORE_CUDA_PLUGIN", None)
            r = subprocess.run([sys.executable, "setup.py", "build_ext", "-j", str(min(2, os.cpu_count() or 1)),
                                "--build-lib", str(lib), "--build-temp", str(tmp)],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, f"build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            shutil.copytree(ROOT / "python" / "tpcore", lib / "tpcore", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("_C*.so", ".libs", "__pycache__"))
            log.write_text(r.stderr)
    return {"lib": lib, "tmp": tmp, "log": log.read_text()}


_SETUP = {}


def setup_py_functions():
    """setup.py's module namespace (its functions: cuda_plan, read_flags, read_mk, ...), read once with
    setuptools.setup replaced, so that nothing is built."""
    if not _SETUP:
        import runpy

        import setuptools
        real, cwd = setuptools.setup, os.getcwd()
        setuptools.setup = lambda **kw: None
        try:
            os.chdir(ROOT)
            _SETUP.update(runpy.run_path(str(ROOT / "setup.py"), run_name="not_main"))
        finally:
            setuptools.setup = real
            os.chdir(cwd)
    return _SETUP
