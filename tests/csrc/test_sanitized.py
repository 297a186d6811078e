"""The extension under AddressSanitizer + UndefinedBehaviorSanitizer.

One test builds tpcore._C with TPCORE_SANITIZE=address,undefined into a copy of
the session's plain CPU-only build directories (c_binaries.cpu_only_extension) and
checks that the result is sanitized (a build of one configuration must never reuse
another's objects or extension).  The next runs the tests that reach C with bad sizes, positions
and files against that build, in a child pytest with the sanitizer runtimes
preloaded; any report fails it (UBSan aborts on the first finding).

TPCORE_SANITIZED_TESTS=all runs the whole suite there instead (docs/building.md:
the ASan+UBSan run before a change is called done); a space-separated list of
test files runs those.
"""
import os
import shutil
import subprocess
import sys

import pytest
import paths
from c_binaries import cpu_only_extension

ROOT = str(paths.ROOT)
# The tests that reach C with hostile sizes, positions and arguments.
DEFAULT_TESTS = ["nn/test_boundaries.py", "utils/test_errors.py", "distributed/test_comm_edge_cases.py",
                 "utils/test_bad_arguments.py", "csrc/test_quant_kernels.py", "nn/test_quant_frozen_weights.py"]

# slow: the files it runs under the sanitizers run plain in every run
pytestmark = [pytest.mark.sanitized, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TPCORE_UNDER_SANITIZER") == "1",
                                 reason="already running under the sanitizers")]


def _runtime(name):
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def _build(env_extra, lib, tmp):
    env = dict(os.environ, **env_extra)
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "-j", str(min(2, os.cpu_count() or 1)),
                        "--build-lib", lib, "--build-temp", tmp],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stderr


def _build_info(lib, env):
    code = "import json, tpcore; print(json.dumps(tpcore.build_info()))"
    r = subprocess.run([sys.executable, "-c", code], cwd=lib, env=dict(env, PYTHONPATH=lib),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory, c_builds):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is missing")
    asan, ubsan = _runtime("libasan.so"), _runtime("libubsan.so")
    if not asan or not ubsan:
        pytest.skip("gcc's libasan/libubsan runtimes are missing")
    base = tmp_path_factory.mktemp("sanbuild")
    lib, tmp = str(base / "lib"), str(base / "tmp")
    # the plain build before (the session's CPU-only one, copied with its times): the sanitized
    # build in the same directories must rebuild every object and the extension
    plain = cpu_only_extension(c_builds)
    shutil.copytree(plain["lib"], lib, symlinks=True)
    shutil.copytree(plain["tmp"], tmp, symlinks=True)
    plain_so = [f for f in os.listdir(os.path.join(lib, "tpcore")) if f.startswith("_C")]
    # a CUDA plugin of a plain build (not compiled here): the sanitized build, which has none, removes it
    os.makedirs(os.path.join(lib, "tpcore", ".libs"), exist_ok=True)
    stale = os.path.join(lib, "tpcore", ".libs", "libtpcore_cuda.so")
    with open(stale, "wb") as f:
        f.write(b"a plain build's plugin")
    log = _build({"TPCORE_SANITIZE": "address,undefined"}, lib, tmp)
    assert not os.path.exists(stale), "the sanitized build kept a plain build's CUDA plugin"
    # The pure-Python package beside the sanitized extension.
    pkg = os.path.join(lib, "tpcore")
    shutil.copytree(os.path.join(ROOT, "python", "tpcore"), pkg, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("_C*.so", ".libs", "__pycache__"))
    # allocator_may_return_null: a refused huge allocation is a MemoryError, as without ASan.
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", LD_PRELOAD=f"{asan} {ubsan}",
               TPCORE_UNDER_SANITIZER="1")
    return {"lib": lib, "env": env, "log": log, "plain_so": plain_so}


def test_sanitizer_build_never_reuses_a_plain_build(sanitized):
    assert "rebuilding from source" in sanitized["log"], sanitized["log"][-2000:]
    info = _build_info(sanitized["lib"], sanitized["env"])
    assert info["sanitize"] == "address,undefined", info


def test_suite_under_asan_ubsan(sanitized):
    which = os.environ.get("TPCORE_SANITIZED_TESTS", "").strip()
    if which == "all":
        files = ["tests"]
    else:
        names = which.split() if which else DEFAULT_TESTS
        files = [os.path.join("tests", n) for n in names]
        missing = [f for f in files if not os.path.exists(os.path.join(ROOT, f))]
        assert not missing, f"test files to run under the sanitizers are missing: {missing}"
    env = dict(sanitized["env"], PYTHONPATH=sanitized["lib"])
    # the whole suite on two workers as the test command runs it; a subset in one process
    workers = ["-n", "2", "--dist", "loadfile"] if which == "all" else []
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *workers, *files],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    tail = (r.stdout[-6000:] + "\n" + r.stderr[-6000:])
    assert r.returncode == 0, f"under ASan+UBSan ({' '.join(files)}):\n{tail}"
    assert "passed" in r.stdout and "ERROR: AddressSanitizer" not in r.stdout + r.stderr, tail
    assert "runtime error:" not in r.stdout + r.stderr, tail
    print(r.stdout.strip().splitlines()[-1])

