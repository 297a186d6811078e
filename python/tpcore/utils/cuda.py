"""CUDA support, Python side: where the run-time libraries are, and loading the plugin.

tpcore._C links no CUDA.  Its CUDA support is a plugin, tpcore/.libs/libtpcore_cuda.so
(csrc/cuda/plugin_abi.h), loaded on first use: here by ``load()`` (``tpcore.cuda_available()``,
``tpcore.build_info()``, the first CUDA layer or communicator), in C by the first
``tp_device_*`` call on a CUDA device.  ``import tpcore`` loads nothing.

cuBLAS and NCCL are opened by the C core at run time (csrc/core/dynlib.h: the override
variable, then the directories registered here, then CUDA_HOME, /usr/local/cuda, the loader
path).  The directories registered here are the ``lib`` folders of the ``nvidia-*`` pip
wheels (the ones PyTorch installs), found with ``importlib.util.find_spec`` without
importing torch or running any of their code.
"""
from __future__ import annotations

import importlib.util
import os
import threading

from tpcore import _C

# nvidia.<name> packages whose lib/ folder may hold what tpcore opens (or what those need):
# the per-library wheels of CUDA 12 and the one-folder wheels of CUDA 13 (nvidia/cu13/lib).
_WHEEL_PACKAGES = ("cublas", "nccl", "cuda_runtime", "cuda_nvrtc", "nvjitlink", "cu13", "cu12")
_MAX_DIRS = 32  # tp_set_library_dirs' limit

_lock = threading.Lock()
_loaded = False
_dirs_registered = False


def wheel_lib_dirs() -> list:
    """The lib directories of the installed nvidia-* wheels, in _WHEEL_PACKAGES order.

    Both layouts: nvidia/ a namespace package (no __init__.py; each wheel adds its folder)
    and nvidia/<pkg> a regular package or a namespace one.  Nothing is imported but the
    ``nvidia`` namespace itself."""
    out = []
    for pkg in _WHEEL_PACKAGES:
        try:
            spec = importlib.util.find_spec(f"nvidia.{pkg}")
        except (ImportError, ValueError, AttributeError):
            continue
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        if not locations and spec.origin:
            locations = [os.path.dirname(spec.origin)]
        for loc in locations:
            for sub in ("lib", "lib64"):
                lib = os.path.join(loc, sub)
                if os.path.isdir(lib) and lib not in out:
                    out.append(lib)
    return out[:_MAX_DIRS]


def register_library_dirs() -> list:
    """Passes wheel_lib_dirs() to the C core's library finder (once); returns them."""
    global _dirs_registered
    dirs = wheel_lib_dirs()
    with _lock:
        if not _dirs_registered:
            _C._set_library_dirs(dirs)
            _dirs_registered = True
    return dirs


def built() -> bool:
    """True when this build has the CUDA plugin (setup.py found nvcc and TPCORE_CUDA was not 0)."""
    return _C._cuda_info()["why_not_built"] == ""


def load() -> None:
    """Loads the plugin once (registers the wheels' library directories first).  Never raises
    for a missing GPU or plugin: status() says why CUDA is not usable."""
    global _loaded
    if _loaded:
        return
    register_library_dirs()
    with _lock:
        if _loaded:
            return
        try:
            _C._cuda_load(None)
        except (RuntimeError, ValueError, MemoryError):
            pass  # recorded: _C._cuda_status() is "not loaded: <why>"
        _loaded = True


def available() -> bool:
    """True when tensors can live on a CUDA device in this process (loads the plugin)."""
    if not built() and not os.environ.get("TPCORE_CUDA_PLUGIN"):
        return False
    load()
    return "cuda" in _C.build_info()["devices"]


def status() -> str:
    """One line: why CUDA is usable or not."""
    why = _C._cuda_info()["why_not_built"]
    if why and not os.environ.get("TPCORE_CUDA_PLUGIN"):
        return f"not built: {why}"
    load()
    return _C._cuda_status()


def search_libraries() -> dict:
    """Searches for cuBLAS and NCCL now (build_info then reports where they are or why not)."""
    register_library_dirs()
    for what, env, names in (("cuBLAS", "TPCORE_CUBLAS_LIBRARY",
                              ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]),
                             ("NCCL", "TPCORE_NCCL_LIBRARY", ["libnccl.so.2", "libnccl.so"])):
        try:
            _C._find_library(what, env, names)
        except RuntimeError:
            pass  # recorded by the finder
    found = info()
    return {k: found[k] for k in ("cublas", "nccl") if k in found}


def info() -> dict:
    """build_info()["cuda"]: built, why_not_built or plugin/arch, status, and the run-time
    libraries searched for so far ("cublas", "nccl": the path, or "not found: <why>")."""
    meta = _C._cuda_info()
    out = {"built": meta["why_not_built"] == ""}
    if not out["built"] and not os.environ.get("TPCORE_CUDA_PLUGIN"):
        out["why_not_built"] = meta["why_not_built"]
        out["status"] = f"not built: {meta['why_not_built']}"
    else:
        load()
        meta = _C._cuda_info()
        out["plugin"] = meta["plugin"] or os.path.join(os.path.dirname(_C.__file__), ".libs", "libtpcore_cuda.so")
        parts = meta["build"].split(", ")
        out["runtime"] = parts[0] if meta["build"] else ""
        out["arch"] = parts[1] if len(parts) > 1 else ""
        out["status"] = _C._cuda_status()
    libs = {}
    for what, rec in _C._library_searches().items():
        libs[what.lower()] = rec["path"] if rec["found"] else f"not found: {rec['error']}"
    out.update(libs)
    return out
