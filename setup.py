"""Build of tpcore: the C core plus the CPython extension tpcore._C, in one
setuptools Extension (as msgspec does it).

Switches (environment variables):
  TPCORE_SANITIZE=address,undefined   build with sanitizers (-O1 -g)
  TPCORE_DEBUG=1                      -O0 -g
The build prints what it detected.
"""
import glob
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


class BuildExt(build_ext):
    def build_extensions(self):
        sanitize = os.environ.get("TPCORE_SANITIZE", "").strip()
        debug = os.environ.get("TPCORE_DEBUG", "") not in ("", "0")
        nvcc, nccl = detect_cuda()
        log(f"compiler: {self.compiler.compiler_so[0] if hasattr(self.compiler, 'compiler_so') else '?'}")
        log(f"backends: shm (always); nccl: {'headers found, backend not built yet' if nccl else 'not found'}; "
            f"mpi: {'mpicc found, backend not built yet' if detect_mpi() else 'not found'}")
        log(f"cuda: {nvcc or 'not found'} (CUDA kernels are not part of this version)")
        log(f"sanitizers: {sanitize or 'off'}; debug: {'on' if debug else 'off'}")
        for ext in self.extensions:
            args = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-D_GNU_SOURCE",
                    "-fvisibility=hidden"]
            link = []
            if sanitize:
                args += ["-O1", "-g", "-fno-omit-frame-pointer", f"-fsanitize={sanitize}"]
                link += [f"-fsanitize={sanitize}"]
            elif debug:
                args += ["-O0", "-g"]
            else:
                args += ["-O3"]
            ext.extra_compile_args = args
            ext.extra_link_args = link
            ext.define_macros += [
                ("TPCORE_VERSION_STR", f'"{VERSION}"'),
                ("TPCORE_SANITIZE_STR", f'"{sanitize}"'),
                ("TPCORE_BUILD_STR", '"debug"' if debug else '"release"'),
            ]
        super().build_extensions()


def numpy_include():
    import numpy
    return numpy.get_include()


def sources():
    files = []
    for sub in ("core", "comm", "kernels/cpu", "layers", "python"):
        files += sorted(glob.glob(os.path.join("csrc", sub, "*.c")))
    return files


setup(
    ext_modules=[
        Extension(
            "tpcore._C",
            sources=sources(),
            include_dirs=["csrc/include", numpy_include()],
            libraries=["rt", "pthread", "m"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
