"""One source list, one set of flags and one version: setup.py, the Makefile, pyproject.toml,
the C header and the package must agree; the build checks its tools first."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import tpcore

import paths
from c_binaries import setup_py_functions
ROOT = str(paths.ROOT)

# setup.py run with setuptools.setup replaced: what it would pass to setuptools
_CAPTURE = r"""
import json, os, runpy, sys
import setuptools
seen = {}
setuptools.setup = lambda **kw: seen.update(kw)
os.chdir(sys.argv[1])
sys.argv = ["setup.py"]
runpy.run_path("setup.py", run_name="__main__")
ext = seen["ext_modules"][0]
print(json.dumps({"version": seen["version"], "sources": ext.sources}))
"""


def _setup_py():
    out = subprocess.run([sys.executable, "-c", _CAPTURE, ROOT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _header_version():
    with open(os.path.join(ROOT, "csrc", "include", "tpcore", "tpcore.h")) as f:
        text = f.read()
    return ".".join(re.search(rf"^#define\s+TP_VERSION_{n}\s+(\d+)", text, re.M).group(1)
                    for n in ("MAJOR", "MINOR", "PATCH"))


def test_version_has_one_source():
    want = _header_version()
    assert tpcore.__version__ == want
    assert tpcore.build_info()["version"] == want
    assert _setup_py()["version"] == want
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert re.search(r'^dynamic\s*=\s*\[[^\]]*"version"', text, re.M), \
        "pyproject.toml must take the version from setup.py"
    assert not re.search(r"^version\s*=", text, re.M), "pyproject.toml must not write the version a second time"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_setup_py_and_makefile_compile_the_same_core():
    out = subprocess.run(["make", "-s", "--no-print-directory", "print-core-sources"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    make = out.stdout.split()
    assert make and all(f.endswith(".c") for f in make)
    srcs = _setup_py()["sources"]
    python = [f for f in srcs if f.startswith("csrc/python/")]
    assert python, "the extension's own files come from TP_PYTHON_DIRS"
    assert sorted(f for f in srcs if f not in python) == sorted(make)
    # every C file of csrc/ outside the tests is built by one of them
    every = {os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "csrc"))
             for f in fs if f.endswith(".c") and "/tests" not in d}
    mk = setup_py_functions()["read_source_dirs"](os.path.join(ROOT, "csrc", "sources.mk"))
    plugins = set(mk["TP_CUDA_DIRS"]) | set(mk["TP_MPI_DIRS"])  # the plugins' own directories
    assert {"csrc/cuda/plugin", "csrc/comm/mpi/plugin"} <= plugins
    every = {f for f in every if os.path.dirname(f) not in plugins}
    assert every == set(srcs)


def test_source_list_is_read_by_both():
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert re.search(r"^include csrc/sources\.mk$", f.read(), re.M)
    with open(os.path.join(ROOT, "setup.py")) as f:
        assert "sources.mk" in f.read()
    with open(os.path.join(ROOT, "MANIFEST.in")) as f:  # an sdist must carry it: setup.py reads it
        assert re.search(r"^recursive-include csrc .*\*\.mk", f.read(), re.M)


def test_flags_are_read_by_both():
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert re.search(r"^include csrc/flags\.mk$", f.read(), re.M)
    fl = setup_py_functions()["read_flags"]()
    assert "-std=c11" in fl["TP_CFLAGS"] and fl["TP_PLUGIN_CFLAGS"][:len(fl["TP_CFLAGS"])] == fl["TP_CFLAGS"]
    assert "-fsanitize=address,undefined" in fl["TP_OPT_SANITIZE"]
    assert "-fsanitize=address" in setup_py_functions()["read_flags"]("address")["TP_OPT_SANITIZE"]


def _make_commands(target, *make_vars):
    """The compiler and linker commands `make -n -B` would run for target (in ROOT), split as
    the shell does."""
    out = subprocess.run(["make", "-n", "-B", "--no-print-directory", *make_vars, target], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout.replace("\\\n", " ")
    return [shlex.split(ln) for ln in text.splitlines() if ln.split(" ", 1)[0] in ("CC", "NVCC")]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_and_setup_py_build_the_plugins_with_the_same_commands(tmp_path, monkeypatch):
    """No nvcc or mpicc needed: both are asked for their commands with the same stand-ins."""
    s = setup_py_functions()
    monkeypatch.chdir(ROOT)
    build = str(tmp_path / "b")
    steps, link, lib = s["cuda_plugin_commands"]({"nvcc": "NVCC", "root": "/CUDA", "archs": [80, 90]},
                                                 build, ["CC"])
    make = _make_commands(f"{build}/libtpcore_cuda.so", "CUDA=1", "NVCC=NVCC", "CC=CC", "CUDA_ROOT=/CUDA",
                          "CUDA_ARCHS=80 90", f"BUILD={build}")
    mine = [cmd for _, _, cmd in steps] + [link]
    assert len(steps) > 10 and any(c[0] == "NVCC" and "-c" in c for c in mine)
    assert sorted(make) == sorted(mine)
    assert lib == f"{build}/libtpcore_cuda.so"
    plan = {"mpicc": "mpicc", "cflags": ["-I/MPI/include"], "libs": ["-L/MPI/lib", "-lmpi"]}
    for cfg, make_vars in (({"sanitize": "", "debug": False}, []), ({"sanitize": "", "debug": True}, ["DEBUG=1"])):
        mine = s["mpi_plugin_command"](plan, f"{build}/libtpcore_mpi.so", ["CC"], cfg)
        make = _make_commands(f"{build}/libtpcore_mpi.so", "MPICC=mpicc", "CC=CC", "MPI_CFLAGS=-I/MPI/include",
                              "MPI_LIBS=-L/MPI/lib -lmpi", f"BUILD={build}", *make_vars)
        assert make == [mine], (make, mine)


def test_extension_takes_the_core_flags():
    s = setup_py_functions()
    fl = s["read_flags"]()
    cflags, ldflags = s["extension_flags"]({"sanitize": "", "debug": False})
    assert cflags == fl["TP_CFLAGS"] + fl["TP_OPT_RELEASE"] and ldflags == fl["TP_LIBS"]
    cflags, ldflags = s["extension_flags"]({"sanitize": "address", "debug": False})
    assert "-fsanitize=address" in cflags and ldflags[0] == "-fsanitize=address"


def test_make_fragments_are_read_as_make_reads_them(tmp_path):
    read_mk = setup_py_functions()["read_mk"]
    mk = tmp_path / "x.mk"
    mk.write_text("# a comment\nA := -x -y  # trailing\nB := $(A) -z\n\nC = plain\n")
    assert read_mk(str(mk)) == {"A": ["-x", "-y"], "B": ["-x", "-y", "-z"], "C": ["plain"]}
    assert read_mk(str(mk), {"A": "-q"})["B"] == ["-q", "-z"]  # as `make A=-q`
    for bad, msg in (("B := $(NOPE)\n", r"\$\(NOPE\) is not a name defined above"),
                     ("B := $(wildcard *.c)\n", "only \\$\\(NAME\\) references"),
                     ("ifeq (a,b)\n", "plain 'NAME := words' lines only")):
        mk.write_text(bad)
        with pytest.raises(SystemExit, match=msg):
            read_mk(str(mk))


def test_toolchain_problems_say_what_to_install(tmp_path):
    problem = setup_py_functions()["toolchain_problem"]
    import sysconfig
    msg = problem(["tpcore-no-such-cc", "-O2"])
    assert "tpcore needs a C compiler to build, and 'tpcore-no-such-cc'" in msg
    assert "apt-get install build-essential" in msg and "conda install -c conda-forge c-compiler" in msg
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    msg = problem([cc], str(tmp_path))  # a Python without its headers
    assert f"{tmp_path}/Python.h is missing" in msg and "-dev" in msg and "python3-devel" in msg
    (tmp_path / "Python.h").write_text("#error this Python.h is broken\n")
    msg = problem([cc], str(tmp_path))
    assert "cannot compile a C file" in msg and "this Python.h is broken" in msg
    assert problem([cc], sysconfig.get_path("include")) is None


def test_a_missing_compiler_stops_the_build_first(tmp_path):
    env = dict(os.environ, CC="tpcore-no-such-cc", TPCORE_CUDA="0")
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                        "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    assert "tpcore needs a C compiler to build, and 'tpcore-no-such-cc'" in r.stderr, r.stderr[-3000:]
    assert "No such file or directory" not in r.stderr
    assert not (tmp_path / "lib").exists()  # nothing was built


def test_license_is_an_spdx_string_and_setuptools_new_enough():
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert meta["project"]["license"] == "Apache-2.0"
    req = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    m = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", req[0]) if req else None
    assert m and int(m.group(1)) >= 77, req  # the string form needs setuptools 77


# Modules the tests take with pytest.importorskip, and the distribution that brings each.  A test
# extra lost from pyproject.toml (a list item swallowed by a comment) skips its tests silently;
# this fails instead.  cupy is no test extra: the GPU check installs it where there is a GPU.
_OPTIONAL_TEST_MODULES = {"gguf": "gguf", "hypothesis": "hypothesis", "ipykernel": "ipykernel", "jax": "jax",
                          "ml_dtypes": "ml_dtypes", "mypy": "mypy", "nbclient": "nbclient", "nbformat": "nbformat",
                          "safetensors": "safetensors", "torch": "torch", "transformers": "transformers",
                          "tokenizers": "tokenizers", "accelerate": "accelerate", "openai": "openai", "httpx": "httpx",
                          "uvicorn": "uvicorn", "starlette": "starlette", "jinja2": "jinja2", "selenium": "selenium"}


def test_the_test_extra_brings_every_module_the_tests_skip_without():
    import importlib.util
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("-", "_") for r in extra}
    skipped = set()
    for d, _, files in os.walk(os.path.join(ROOT, "tests")):
        for fn in files:
            if fn.endswith(".py"):
                with open(os.path.join(d, fn)) as f:
                    skipped |= set(re.findall(r"importorskip\(\s*[\"']([A-Za-z_][A-Za-z0-9_]*)", f.read()))
    skipped.discard("cupy")
    unknown = skipped - set(_OPTIONAL_TEST_MODULES)
    assert not unknown, f"map these to their distributions: {unknown}"
    missing = {m: d for m, d in _OPTIONAL_TEST_MODULES.items() if d not in names}
    assert not missing, f"pyproject.toml's test extra lacks {sorted(missing.values())}"
    if os.environ.get("CI"):  # CI installs the extra: every one of them must import there
        absent = [m for m in _OPTIONAL_TEST_MODULES if importlib.util.find_spec(m) is None]
        assert not absent, f"installed by '.[test]' but not importable: {absent}"


def test_the_files_run_first_exist():
    from conftest import RUN_FIRST
    missing = [f for f in RUN_FIRST if not (paths.ROOT / "tests" / f).is_file()]
    assert not missing, f"conftest.RUN_FIRST names files that are not there: {missing}"
