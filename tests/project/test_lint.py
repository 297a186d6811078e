"""The tree is lint-clean: ruff over the Python (configured in pyproject.toml) and
clang-format over the C and CUDA sources (.clang-format).  Both come with the test extras,
pinned, so that these checks, `make check` and the pre-commit hooks agree."""
import os
import shutil
import subprocess

import pytest
import paths

ROOT = str(paths.ROOT)


def _tool(name):
    path = shutil.which(name)
    assert path, f"{name} is not installed: pip install '.[test]' brings the pinned version"
    return path


def _tracked(*patterns):
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout (an sdist): the lint runs on the repository")
    r = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_ruff_finds_nothing():
    files = _tracked("*.py")
    assert files
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", *files], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_c_sources_are_clang_formatted():
    files = _tracked("csrc/*.c", "csrc/*.h", "csrc/*.cu", "csrc/*.cuh")
    assert files
    r = subprocess.run([_tool("clang-format"), "--dry-run", "--Werror", *files], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-6000:]


def test_a_finding_fails_the_checks(tmp_path):
    # the checks can fail: a file with an unused import and a badly indented C function
    (tmp_path / "bad.py").write_text("import os\n")
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", "--config", os.path.join(ROOT, "pyproject.toml"),
                        str(tmp_path / "bad.py")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "F401" in r.stdout, r.stdout + r.stderr
    (tmp_path / "bad.c").write_text("int f(void){\n        return 0;}\n")
    shutil.copy(os.path.join(ROOT, ".clang-format"), tmp_path / ".clang-format")
    r = subprocess.run([_tool("clang-format"), "--dry-run", "--Werror", str(tmp_path / "bad.c")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0, r.stderr
