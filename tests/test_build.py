"""One source list and one version: setup.py, the Makefile, pyproject.toml, the C header
and the package must agree."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import tpcore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    dirs = _setup_module_dirs()
    plugins = set(dirs.get("TP_CUDA_DIRS", [])) | set(dirs.get("TP_MPI_DIRS", []))  # the plugins' own libraries
    assert {"csrc/cuda/plugin", "csrc/comm/mpi/plugin"} <= plugins
    every = {f for f in every if os.path.dirname(f) not in plugins}
    assert every == set(srcs)


def _setup_module_dirs():
    """csrc/sources.mk's directory lists, as setup.py reads them."""
    out = subprocess.run([sys.executable, "-c", "import json, runpy, setuptools, sys, os; os.chdir(sys.argv[1]); "
                          "setuptools.setup = lambda **kw: None; "
                          "print(json.dumps(runpy.run_path('setup.py', run_name='x')['read_source_dirs']()))", ROOT],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_source_list_is_read_by_both():
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert re.search(r"^include csrc/sources\.mk$", f.read(), re.M)
    with open(os.path.join(ROOT, "setup.py")) as f:
        assert "sources.mk" in f.read()
    with open(os.path.join(ROOT, "MANIFEST.in")) as f:  # an sdist must carry it: setup.py reads it
        assert re.search(r"^recursive-include csrc .*\*\.mk", f.read(), re.M)
