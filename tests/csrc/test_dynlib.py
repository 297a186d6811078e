"""The run-time library finder (csrc/core/dynlib.c) and the nvidia-* wheel search of
tpcore.utils.cuda: search order, exclusive override, errors naming every place tried, a corrupt
file reported as found-but-did-not-load.  Fake libraries are built with cc into temporary
directories; each scenario runs in a fresh process (the loader path and the registered
directories are per process)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

import tpcore
import paths

ROOT = str(paths.ROOT)

# Where the tpcore under test lives (the source tree after build_ext --inplace, or
# site-packages after pip install): child processes import that one.
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(tpcore.__file__)))

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler to build the fake libraries")

SONAMES = ["libtpfake.so.1", "libtpfake.so"]


def _fake_lib(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    src = path + ".c"
    with open(src, "w") as f:
        f.write("int tp_fake_symbol(void) { return 42; }\n")
    subprocess.run([CC, "-shared", "-fPIC", "-o", path, src], check=True, capture_output=True, timeout=120)
    os.remove(src)
    return path


def _find(dirs=(), env=None, what="Fake", override="TPCORE_FAKE_LIBRARY", sonames=SONAMES):
    """_C._find_library in a fresh process: {"path": ...} or {"error": ..., "type": ...}."""
    code = (
        "import json, sys, tpcore._C as C\n"
        f"C._set_library_dirs({list(dirs)!r})\n"
        "try:\n"
        f"    out = {{'path': C._find_library({what!r}, {override!r}, {list(sonames)!r})}}\n"
        "except Exception as e:\n"
        "    out = {'error': str(e), 'type': type(e).__name__}\n"
        "out['searches'] = C._library_searches()\n"
        "print(json.dumps(out))\n"
    )
    base = {k: v for k, v in os.environ.items()
            if k not in ("CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH", "TPCORE_FAKE_LIBRARY")}
    base["PYTHONPATH"] = PKG_PARENT
    base.update(env or {})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    t = tmp_path_factory.mktemp("dynlib")
    return {
        "override": _fake_lib(str(t / "override" / "libtpfake.so.1")),
        "reg1": _fake_lib(str(t / "reg1" / "libtpfake.so.1")),
        "reg2": _fake_lib(str(t / "reg2" / "libtpfake.so.1")),
        "reg2_plain": _fake_lib(str(t / "reg2" / "libtpfake.so")),
        "home": _fake_lib(str(t / "home" / "lib64" / "libtpfake.so.1")),
        "loader": _fake_lib(str(t / "loader" / "libtpfake.so.1")),
        "root": str(t),
    }


def test_override_variable_wins_and_is_exclusive(libs):
    env = {"CUDA_HOME": os.path.join(libs["root"], "home"), "LD_LIBRARY_PATH": os.path.join(libs["root"], "loader")}
    dirs = [os.path.dirname(libs["reg1"])]
    out = _find(dirs, dict(env, TPCORE_FAKE_LIBRARY=libs["override"]))
    assert out["path"] == libs["override"]
    # set but wrong: its failure is the error; nothing else is tried although every other place has the library
    missing = os.path.join(libs["root"], "nowhere", "libtpfake.so.1")
    out = _find(dirs, dict(env, TPCORE_FAKE_LIBRARY=missing))
    assert out["type"] == "RuntimeError"
    assert f"TPCORE_FAKE_LIBRARY={missing}" in out["error"] and "No such file" in out["error"]
    assert libs["reg1"] not in out["error"]
    assert out["searches"]["Fake"]["found"] is False


def test_registered_dirs_before_cuda_home_before_loader_path(libs):
    env = {"CUDA_HOME": os.path.join(libs["root"], "home"), "LD_LIBRARY_PATH": os.path.join(libs["root"], "loader")}
    reg1, reg2 = os.path.dirname(libs["reg1"]), os.path.dirname(libs["reg2"])
    assert _find([reg2, reg1], env)["path"] == libs["reg2"]  # registered directories in their order
    assert _find([reg1, reg2], env)["path"] == libs["reg1"]
    assert _find([], env)["path"] == libs["home"]  # then $CUDA_HOME/lib64
    out = _find([], {"CUDA_PATH": os.path.join(libs["root"], "home"), "LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"]})
    assert out["path"] == libs["home"]  # $CUDA_PATH likewise
    out = _find([], {"LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"]})  # then the loader path
    assert os.path.realpath(out["path"]) == os.path.realpath(libs["loader"])
    assert out["searches"]["Fake"] == {"found": True, "path": out["path"]}


def test_sonames_in_order_of_preference_within_a_directory(libs):
    reg2 = os.path.dirname(libs["reg2"])
    assert _find([reg2], sonames=["libtpfake.so.1", "libtpfake.so"])["path"] == libs["reg2"]
    assert _find([reg2], sonames=["libtpfake.so", "libtpfake.so.1"])["path"] == libs["reg2_plain"]


def test_not_found_names_every_place_in_order(libs, tmp_path):
    empty1, empty2 = str(tmp_path / "e1"), str(tmp_path / "e2")
    home = str(tmp_path / "cudahome")
    out = _find([empty1, empty2], {"CUDA_HOME": home}, sonames=["libtpnothere.so.3"])
    err = out["error"]
    assert out["type"] == "RuntimeError" and err.startswith("cannot find Fake: tried TPCORE_FAKE_LIBRARY (unset)")
    places = [f"{empty1}/libtpnothere.so.3", f"{empty2}/libtpnothere.so.3", f"{home}/lib64/libtpnothere.so.3",
              "/usr/local/cuda/lib64/libtpnothere.so.3", ", libtpnothere.so.3"]
    at = [err.find(p) for p in places]
    assert all(i >= 0 for i in at), (places, err)
    assert at == sorted(at), err
    assert "point TPCORE_FAKE_LIBRARY at the library file" in err
    assert "did not load" not in err


def test_corrupt_library_is_found_but_did_not_load(tmp_path):
    d = tmp_path / "nvidia" / "nccl" / "lib"
    d.mkdir(parents=True)
    (d / "libnccl.so.2").write_bytes(b"this is not an ELF file\n" * 4)
    out = _find([str(d)], what="NCCL", override="TPCORE_NCCL_LIBRARY", sonames=["libnccl.so.2"])
    err = out["error"]
    assert "cannot find NCCL" in err and f"{d}/libnccl.so.2" in err
    assert "one was found but did not load" in err and "invalid ELF header" in err


def test_set_library_dirs_rejects_bad_lists():
    import tpcore._C as C
    with pytest.raises(ValueError, match="33 directories"):
        C._set_library_dirs(["/tmp"] * 33)
    with pytest.raises(ValueError, match="directory 1 is empty"):
        C._set_library_dirs(["/tmp", ""])
    with pytest.raises(TypeError, match="not a str"):
        C._set_library_dirs(["/tmp", 3])
    with pytest.raises(TypeError, match="list of str"):
        C._set_library_dirs("/tmp")
    C._set_library_dirs([])  # clears


def test_wheel_lib_dirs_both_layouts_and_registered(tmp_path):
    # nvidia/ as a namespace package spread over two sys.path entries: nccl a namespace
    # package itself (no __init__.py), cublas a regular one; cuda_runtime has no lib folder.
    a, b = tmp_path / "site_a", tmp_path / "site_b"
    nccl_lib = a / "nvidia" / "nccl" / "lib"
    cublas_lib = b / "nvidia" / "cublas" / "lib"
    nccl_lib.mkdir(parents=True)
    cublas_lib.mkdir(parents=True)
    (b / "nvidia" / "cublas" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (b / "nvidia" / "cuda_runtime").mkdir(parents=True)
    _fake_lib(str(nccl_lib / "libnccl.so.2"))
    code = (
        "import json, sys, tpcore\n"
        "from tpcore.utils import cuda as _cuda\n"
        "dirs = _cuda.register_library_dirs()\n"
        "path = tpcore._C._find_library('NCCL', 'TPCORE_NCCL_LIBRARY', ['libnccl.so.2'])\n"
        "print(json.dumps({'dirs': dirs, 'path': path, 'torch': 'torch' in sys.modules,\n"
        "                  'cublas_imported': 'nvidia.cublas' in sys.modules}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TPCORE_NCCL_LIBRARY",)}
    # the fake wheels first: PKG_PARENT may be site-packages, with real nvidia wheels in it
    env["PYTHONPATH"] = os.pathsep.join([str(a), str(b), PKG_PARENT])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # _WHEEL_PACKAGES order: cublas, nccl (real nvidia wheels installed in site-packages, as
    # PyTorch's CUDA builds bring them, add their own folders: only the fake ones are compared)
    mine = [d for d in out["dirs"] if d.startswith(str(tmp_path))]
    assert mine == [str(cublas_lib), str(nccl_lib)], out["dirs"]
    assert out["path"] == str(nccl_lib / "libnccl.so.2")
    assert out["torch"] is False and out["cublas_imported"] is False


def test_build_info_reports_searches_only_after_one(libs, tmp_path):
    missing = str(tmp_path / "no" / "libcublas.so.13")
    code = (
        "import json, tpcore\n"
        "from tpcore.utils import cuda as _cuda\n"
        "before = tpcore.build_info()['cuda']\n"
        "found = _cuda.search_libraries()\n"
        "after = tpcore.build_info()['cuda']\n"
        "print(json.dumps({'before': sorted(before), 'found': found, 'after': after}))\n"
    )
    env = dict(os.environ, PYTHONPATH=PKG_PARENT, TPCORE_NCCL_LIBRARY=libs["reg1"],
               TPCORE_CUBLAS_LIBRARY=missing)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "nccl" not in out["before"] and "cublas" not in out["before"]
    assert out["found"]["nccl"] == libs["reg1"] == out["after"]["nccl"]
    assert out["found"]["cublas"].startswith(f"not found: cannot load cuBLAS from TPCORE_CUBLAS_LIBRARY={missing}: ")
    assert out["after"]["cublas"] == out["found"]["cublas"]
