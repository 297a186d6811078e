"""Build of tpcore: the C core plus the CPython extension tpcore._C, in one
setuptools Extension (as msgspec does it).

Switches (environment variables):
  TPCORE_SANITIZE=address,undefined   build with sanitizers (-O1 -g)
  TPCORE_DEBUG=1                      -O0 -g
  TPCORE_BLAS=system                  link a system CBLAS found by pkg-config (openblas, cblas)
                                      instead of vendoring the scipy-openblas32 wheel's OpenBLAS
The build prints what it detected.
"""
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"


def log(msg):
    print(f"[tpcore build] {msg}", file=sys.stderr, flush=True)


def detect_cuda():
    nvcc = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if not nvcc and os.path.exists(os.path.join(home, "bin", "nvcc")):
        nvcc = os.path.join(home, "bin", "nvcc")
    nccl = any(os.path.exists(os.path.join(d, "nccl.h"))
               for d in (os.path.join(home, "include"), "/usr/include"))
    return nvcc, nccl


def detect_mpi():
    return shutil.which("mpicc")


def blas_config():
    """Compile and link settings for BLAS, and the library file to vendor (or None).

    Default: the OpenBLAS of the scipy-openblas32 wheel, a pinned build dependency.
    Its library is copied into the package (tpcore/.libs) and found through an
    $ORIGIN rpath: that wheel asks not to be a run-time dependency of projects
    other than NumPy and SciPy, but welcomes being vendored.  Its symbols carry a
    scipy_ prefix, so they never clash with NumPy's own OpenBLAS."""
    mode = os.environ.get("TPCORE_BLAS", "bundled").strip().lower()
    if mode == "system":
        for name in ("openblas", "cblas", "blas-openblas"):
            if subprocess.run(["pkg-config", "--exists", name]).returncode == 0:
                cflags = subprocess.check_output(["pkg-config", "--cflags", name], text=True).split()
                libs = subprocess.check_output(["pkg-config", "--libs", name], text=True).split()
                return {"cflags": cflags, "libs": libs, "macros": [], "vendor": None, "license": None,
                        "info": f"system {name} via pkg-config ({' '.join(libs)})"}
        raise SystemExit("TPCORE_BLAS=system: pkg-config finds none of openblas, cblas, blas-openblas "
                         "(on Debian: apt-get install libopenblas-dev pkg-config)")
    if mode not in ("bundled", ""):
        raise SystemExit(f"TPCORE_BLAS must be 'system' or unset, got {mode!r}")
    try:
        import scipy_openblas32 as sob
    except ImportError:
        raise SystemExit("tpcore needs the scipy-openblas32 wheel to build (a pinned build requirement in "
                         "pyproject.toml; with --no-build-isolation install it first: pip install "
                         "scipy-openblas32==0.3.34.481.3), or TPCORE_BLAS=system") from None

    lib = os.path.join(sob.get_lib_dir(), sob.get_library(fullname=True))
    lic = None
    try:  # OpenBLAS's BSD license travels with the vendored library
        from importlib.metadata import files
        lic = next((str(f.locate()) for f in files("scipy-openblas32") or [] if f.name.startswith("LICENSE")), None)
    except Exception:  # noqa: BLE001
        lic = None
    return {"cflags": [f"-I{sob.get_include_dir()}"],
            "libs": [f"-L{sob.get_lib_dir()}", f"-l{sob.get_library()}", "-Wl,-rpath,$ORIGIN/.libs"],
            "macros": [("TP_BLAS_SCIPY_OPENBLAS", "1")], "vendor": lib, "license": lic,
            "info": f"OpenBLAS from scipy-openblas32 {sob.__version__}, vendored as tpcore/.libs/{os.path.basename(lib)}"}


def build_config():
    """What decides the machine code: objects of one configuration are never
    linked or reused by another (build/ is shared by `pip install .` runs)."""
    return {
        "sanitize": os.environ.get("TPCORE_SANITIZE", "").strip(),
        "debug": os.environ.get("TPCORE_DEBUG", "") not in ("", "0"),
        "blas": os.environ.get("TPCORE_BLAS", "bundled").strip().lower() or "bundled",
        **{k: os.environ.get(k, "") for k in ("CC", "CFLAGS", "CPPFLAGS", "LDFLAGS")},
    }


class BuildExt(build_ext):
    def _separate_configs(self, cfg):
        """A build directory per configuration, and a full rebuild whenever the
        extension in build_lib came from another one (setuptools would otherwise
        keep an up-to-date-looking extension of the previous configuration)."""
        tag = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]
        stamp = os.path.join(self.build_temp, "last-config.json")  # what build_lib's extension was built as
        self.build_temp = os.path.join(self.build_temp, f"cfg-{tag}")
        try:
            with open(stamp) as f:
                previous = json.load(f)
        except (OSError, ValueError):
            previous = None
        if previous != cfg:
            self.force = True
            log(f"build configuration {tag}: {'changed' if previous else 'new'}; rebuilding from source")
        return stamp

    def build_extensions(self):
        cfg = build_config()
        stamp = self._separate_configs(cfg)
        sanitize, debug = cfg["sanitize"], cfg["debug"]
        nvcc, nccl = detect_cuda()
        log(f"compiler: {self.compiler.compiler_so[0] if hasattr(self.compiler, 'compiler_so') else '?'}")
        log(f"backends: shm (always); nccl: {'headers found, backend not built yet' if nccl else 'not found'}; "
            f"mpi: {'mpicc found, backend not built yet' if detect_mpi() else 'not found'}")
        log(f"cuda: {nvcc or 'not found'} (CUDA kernels are not part of this version)")
        log(f"sanitizers: {sanitize or 'off'}; debug: {'on' if debug else 'off'}")
        blas = blas_config()
        log(f"BLAS: {blas['info']}")
        for ext in self.extensions:
            args = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-D_GNU_SOURCE",
                    "-fvisibility=hidden"]
            link = []
            if sanitize:
                args += ["-O1", "-g", "-fno-omit-frame-pointer", f"-fsanitize={sanitize}",
                         "-fno-sanitize-recover=all"]  # a finding stops the process, as the Makefile's
                link += [f"-fsanitize={sanitize}"]
            elif debug:
                args += ["-O0", "-g"]
            else:
                args += ["-O3"]
            ext.extra_compile_args = args + blas["cflags"]
            ext.extra_link_args = link + blas["libs"]
            ext.define_macros += blas["macros"]
            ext.define_macros += [
                ("TPCORE_VERSION_STR", f'"{VERSION}"'),
                ("TPCORE_SANITIZE_STR", f'"{sanitize}"'),
                ("TPCORE_BUILD_STR", '"debug"' if debug else '"release"'),
            ]
        super().build_extensions()
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as f:
            json.dump(cfg, f)
        if blas["vendor"]:
            dirs = {os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), ".libs")
                    for ext in self.extensions}
            if getattr(self, "editable_mode", False) or self.inplace:
                dirs.add(os.path.join(HERE, "python", "tpcore", ".libs"))  # next to the in-tree extension
            for libs_dir in sorted(dirs):
                _vendor_into(libs_dir, blas)
                log(f"vendored {os.path.basename(blas['vendor'])} into {libs_dir}")
            self._vendored = blas

    def copy_extensions_to_source(self):
        # `build_ext --inplace` builds in build/ and copies the extension next to the
        # sources afterwards: the vendored library must follow it.
        super().copy_extensions_to_source()
        vendored = getattr(self, "_vendored", None)
        if vendored:
            _vendor_into(os.path.join(HERE, "python", "tpcore", ".libs"), vendored)


def _vendor_into(libs_dir, blas):
    os.makedirs(libs_dir, exist_ok=True)
    shutil.copy2(blas["vendor"], libs_dir)
    if blas.get("license"):
        shutil.copy2(blas["license"], os.path.join(libs_dir, "LICENSE.scipy-openblas32.txt"))


def numpy_include():
    import numpy
    return numpy.get_include()


def sources():
    files = []
    for sub in ("core", "devices", "comm", "kernels", "kernels/cpu", "layers", "python"):
        files += sorted(glob.glob(os.path.join("csrc", sub, "*.c")))
    return files


setup(
    ext_modules=[
        Extension(
            "tpcore._C",
            sources=sources(),
            include_dirs=["csrc/include", numpy_include()],
            depends=sorted(glob.glob("csrc/**/*.h", recursive=True)),
            libraries=["rt", "pthread", "m"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
