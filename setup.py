"""Build of tpcore: the C core plus the CPython extension tpcore._C, in one
setuptools Extension (as msgspec does it).

Switches (environment variables):
  TPCORE_SANITIZE=address,undefined   build with sanitizers (-O1 -g)
  TPCORE_DEBUG=1                      -O0 -g
  TPCORE_BLAS=system                  link a system CBLAS found by pkg-config (openblas, cblas)
                                      instead of vendoring the scipy-openblas32 wheel's OpenBLAS
  TPCORE_CUDA=0                       CPU-only: no CUDA plugin (also when nvcc is not found,
                                      and in sanitized builds)
  TPCORE_CUDA_ARCHS="80 90"           the CUDA plugin's machine code (sm_XX for each, PTX of the
                                      last); "90" alone makes quick development builds
The CUDA plugin, tpcore/.libs/libtpcore_cuda.so, is built by nvcc (PATH, $CUDA_HOME/bin,
/usr/local/cuda/bin) from csrc/sources.mk's TP_CUDA_DIRS, the CUDA runtime linked statically;
tpcore._C never links CUDA and loads it on first GPU use.
  TPCORE_MPI=0                        no MPI plugin (else built when mpicc is found)
The MPI plugin, tpcore/.libs/libtpcore_mpi.so, is compiled from csrc/sources.mk's TP_MPI_DIRS
(csrc/comm/mpi/plugin/*.c) with the flags of
`mpicc --showme:compile` / `--showme:link` (pkg-config ompi as a fallback) and linked to libmpi;
tpcore._C opens it on first use of the mpi backend, so tpcore imports without MPI.
The build prints what it detected.
"""
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version(header=os.path.join(HERE, "csrc", "include", "tpcore", "tpcore.h")):
    """The version, from its one source: TP_VERSION_MAJOR/MINOR/PATCH of the public C header
    (pyproject.toml declares it dynamic; tpcore.__version__ is the extension's build_info)."""
    with open(header) as f:
        text = f.read()
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^#define\s+TP_VERSION_{name}\s+(\d+)\s*$", text, re.M)
        if not m:
            raise SystemExit(f"{header}: no '#define TP_VERSION_{name} <number>' line")
        parts.append(m.group(1))
    return ".".join(parts)


def read_source_dirs(path=os.path.join(HERE, "csrc", "sources.mk")):
    """{variable: [directories]} of csrc/sources.mk, the source list the Makefile includes."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\s*:?=\s*(.*)", line)
            if not m:
                raise SystemExit(f"{path}: cannot read {line!r} (plain 'NAME := dir dir ...' lines only)")
            out[m.group(1)] = m.group(2).split()
    for key in ("TP_CORE_DIRS", "TP_PYTHON_DIRS"):
        if key not in out:
            raise SystemExit(f"{path}: no {key} line")
    return out


VERSION = read_version()


def log(msg):
    print(f"[tpcore build] {msg}", file=sys.stderr, flush=True)


def find_nvcc():
    """nvcc on PATH, else $CUDA_HOME/bin ($CUDA_PATH), else /usr/local/cuda/bin; None when absent."""
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return None


def cuda_root(nvcc):
    """The toolkit's root (its include/ has cuda_runtime_api.h): above the real nvcc (PATH may
    hold a wrapper script), $CUDA_HOME, $CUDA_PATH, /usr/local/cuda."""
    for root in (os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), os.environ.get("CUDA_HOME"),
                 os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return root
    return None


def cuda_archs():
    """TPCORE_CUDA_ARCHS ("80 90" by default; commas or spaces) as a sorted list of ints."""
    text = os.environ.get("TPCORE_CUDA_ARCHS", "").replace(",", " ").split() or ["80", "90"]
    archs = []
    for a in text:
        a = a.lower().removeprefix("sm_").removeprefix("compute_")
        if not a.isdigit() or not 50 <= int(a) <= 150:
            raise SystemExit(f"TPCORE_CUDA_ARCHS: {a!r} is not an architecture like 80 or 90")
        archs.append(int(a))
    return sorted(set(archs))


def cuda_plan(sanitize):
    """{"nvcc", "root", "archs"} when the CUDA plugin is built, else {"why_not": sentence}."""
    flag = os.environ.get("TPCORE_CUDA", "").strip().lower()
    if flag in ("0", "off", "no", "false"):
        return {"why_not": "TPCORE_CUDA=0 at build time"}
    if sanitize:
        return {"why_not": "sanitized builds are CPU-only (TPCORE_SANITIZE)"}
    nvcc = find_nvcc()
    if not nvcc:
        return {"why_not": "nvcc was not found at build time (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"}
    root = cuda_root(nvcc)
    if not root:
        return {"why_not": f"{nvcc} has no toolkit headers (cuda_runtime_api.h) beside it"}
    return {"nvcc": nvcc, "root": root, "archs": cuda_archs()}


def arch_text(archs):
    return " ".join(f"sm_{a}" for a in archs) + f" + compute_{archs[-1]} PTX"


def detect_mpi():
    return shutil.which("mpicc")


def mpi_plan(sanitize):
    """{"cflags", "libs", "mpicc"} when the MPI plugin is built, else {"why_not": sentence}."""
    if os.environ.get("TPCORE_MPI", "") == "0":
        return {"why_not": "TPCORE_MPI=0"}
    if sanitize:
        return {"why_not": "sanitized build"}
    mpicc = detect_mpi()
    flags = {}
    if mpicc:
        for key, arg in (("cflags", "--showme:compile"), ("libs", "--showme:link")):
            rc, out, _ = _run([mpicc, arg])
            if rc == 0:
                flags[key] = out.split()
    if len(flags) < 2 and shutil.which("pkg-config"):
        for key, arg in (("cflags", "--cflags"), ("libs", "--libs")):
            rc, out, _ = _run(["pkg-config", arg, "ompi"])
            if rc == 0:
                flags[key] = out.split()
    if len(flags) < 2:
        return {"why_not": "no mpicc on PATH and no pkg-config ompi (apt-get install libopenmpi-dev openmpi-bin)"
                if not mpicc else f"{mpicc} --showme:compile/--showme:link failed (not Open MPI's wrapper?)"}
    return {"mpicc": mpicc or "pkg-config ompi", **flags}


def build_mpi_plugin(plan, build_temp, compiler, force=False):
    """libtpcore_mpi.so from csrc/sources.mk's TP_MPI_DIRS and csrc/core/dtype.c, exporting its entry
    only (csrc/comm/mpi/plugin/plugin.map).  Returns the library's path."""
    tag = hashlib.sha1(json.dumps([plan, compiler], sort_keys=True).encode()).hexdigest()[:10]
    lib = os.path.join(build_temp, f"mpi-{tag}", "libtpcore_mpi.so")
    srcs = sorted(f for d in read_source_dirs().get("TP_MPI_DIRS", []) for f in glob.glob(os.path.join(d, "*.c")))
    srcs.append("csrc/core/dtype.c")
    deps = srcs + sorted(glob.glob("csrc/**/*.h", recursive=True)) + ["csrc/comm/mpi/plugin/plugin.map"]
    if force or _stale(lib, deps):
        os.makedirs(os.path.dirname(lib), exist_ok=True)
        cmd = [compiler, "-std=c11", "-O2", "-fPIC", "-fvisibility=hidden", "-D_GNU_SOURCE", "-Wall", "-Wextra",
               "-Wno-unused-parameter", "-Icsrc/include", "-Icsrc", *plan["cflags"], "-shared", *srcs, "-o", lib,
               "-Wl,--version-script=csrc/comm/mpi/plugin/plugin.map", "-Wl,--no-undefined", *plan["libs"]]
        rc, out, _ = _run(cmd)
        log(" ".join(cmd))
        if rc != 0:
            raise SystemExit(f"MPI plugin: building failed:\n{out}\n(TPCORE_MPI=0 builds tpcore without it)")
    return lib


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
        # whether the CUDA plugin is built (the extension reports why not); its archs and
        # nvcc key the plugin's own object directory instead (build_cuda_plugin)
        "cuda": cuda_plan(os.environ.get("TPCORE_SANITIZE", "").strip()).get("why_not", "built"),
        "mpi": mpi_plan(os.environ.get("TPCORE_SANITIZE", "").strip()).get("why_not", "built"),
    }


def _stale(obj, deps):
    try:
        t = os.path.getmtime(obj)
    except OSError:
        return True
    return any(os.path.getmtime(d) > t for d in deps)


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, (r.stdout + r.stderr).strip(), cmd


def build_cuda_plugin(plan, build_temp, compiler, force=False, jobs=None):
    """libtpcore_cuda.so from csrc/sources.mk's TP_CUDA_DIRS: every .cu by nvcc, every .c (and
    csrc/core/dtype.c, dynlib_sym.c) by the C compiler, linked by nvcc with the static CUDA runtime and one
    exported symbol (csrc/cuda/plugin/plugin.map).  Objects live in a directory of their own per nvcc
    and arch list; only stale ones are rebuilt, in parallel.  Returns the library's path."""
    nvcc, root, archs = plan["nvcc"], plan["root"], plan["archs"]
    tag = hashlib.sha1(json.dumps([nvcc, root, archs, compiler], sort_keys=True).encode()).hexdigest()[:10]
    objdir = os.path.join(build_temp, f"cuda-{tag}")
    dirs = read_source_dirs().get("TP_CUDA_DIRS", [])
    cus = sorted(f for d in dirs for f in glob.glob(os.path.join(d, "*.cu")))
    cs = sorted(f for d in dirs for f in glob.glob(os.path.join(d, "*.c"))) + ["csrc/core/dtype.c", "csrc/core/dynlib_sym.c"]
    headers = sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cuh", recursive=True))
    headers.append("csrc/cuda/plugin/plugin.map")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    nvcc_flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-D_GNU_SOURCE",
                  "-Icsrc/include", "-Icsrc", *gencode]
    cc_flags = ["-std=c11", "-O2", "-fPIC", "-fvisibility=hidden", "-D_GNU_SOURCE", "-Wall", "-Wextra",
                "-Wno-unused-parameter", "-Icsrc/include", "-Icsrc", f"-I{os.path.join(root, 'include')}",
                f'-DTP_CUDA_ARCH_STR="{arch_text(archs)}"']
    jobs_list, objs = [], []
    for src in cus + cs:
        obj = os.path.join(objdir, os.path.relpath(src, "csrc") + ".o")
        objs.append(obj)
        if force or _stale(obj, [src] + headers):
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            cmd = ([nvcc, *nvcc_flags] if src.endswith(".cu") else [compiler, *cc_flags]) + ["-c", src, "-o", obj]
            jobs_list.append(cmd)
    from concurrent.futures import ThreadPoolExecutor
    workers = max(1, min(len(jobs_list) or 1, jobs or os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        for rc, out, cmd in pool.map(_run, jobs_list):
            log(" ".join(cmd))
            if rc != 0:
                raise SystemExit(f"CUDA plugin: compiling {cmd[-3]} failed:\n{out}\n"
                                 "(TPCORE_CUDA=0 builds tpcore CPU-only)")
    lib = os.path.join(objdir, "libtpcore_cuda.so")
    if jobs_list or not os.path.exists(lib) or _stale(lib, objs):
        cmd = [nvcc, "-shared", "-o", lib, *objs, "--cudart=static", "-Xlinker", "--exclude-libs,ALL",
               "-Xlinker", "--version-script=csrc/cuda/plugin/plugin.map", "-Xlinker", "--no-undefined",  # missing entries fail here
               "-ldl", "-lrt", "-lpthread"]
        rc, out, _ = _run(cmd)
        log(" ".join(cmd))
        if rc != 0:
            raise SystemExit(f"CUDA plugin: linking failed:\n{out}\n(TPCORE_CUDA=0 builds tpcore CPU-only)")
    return lib


class BuildExt(build_ext):
    def _separate_configs(self, cfg):
        """A build directory per configuration, and a full rebuild whenever the
        extension in build_lib came from another one (setuptools would otherwise
        keep an up-to-date-looking extension of the previous configuration)."""
        tag = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]
        stamp = os.path.join(self.build_temp, "last-config.json")  # what build_lib's extension was built as
        self._base_temp, self._user_force = self.build_temp, self.force  # the CUDA plugin keys its own objects
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
        log(f"compiler: {self.compiler.compiler_so[0] if hasattr(self.compiler, 'compiler_so') else '?'}")
        mplan = mpi_plan(sanitize)
        log("backends: shm (always); nccl (always built: libnccl is opened at run time, "
            "TPCORE_NCCL_LIBRARY or the nvidia-nccl wheel); mpi: "
            + (f"plugin libtpcore_mpi.so built with {mplan['mpicc']}'s flags" if "why_not" not in mplan
               else f"no plugin: {mplan['why_not']}"))
        plan = cuda_plan(sanitize)
        if "why_not" in plan:
            log(f"cuda: CPU-only build, no CUDA plugin: {plan['why_not']}")
        else:
            log(f"cuda: building libtpcore_cuda.so with {plan['nvcc']} (toolkit {plan['root']}; "
                f"{arch_text(plan['archs'])})")
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
                ("TPCORE_CUDA_WHY_NOT_STR", json.dumps(plan.get("why_not", ""))),
                ("TPCORE_VERSION_STR", f'"{VERSION}"'),
                ("TPCORE_SANITIZE_STR", f'"{sanitize}"'),
                ("TPCORE_BUILD_STR", '"debug"' if debug else '"release"'),
            ]
        cuda_lib = None
        if "why_not" not in plan:
            cuda_lib = build_cuda_plugin(plan, self._base_temp, self.compiler.compiler_so[0], force=self._user_force,
                                         jobs=self.parallel if isinstance(self.parallel, int) else None)
        mpi_lib = None
        if "why_not" not in mplan:
            mpi_lib = build_mpi_plugin(mplan, self._base_temp, self.compiler.compiler_so[0], force=self._user_force)
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
        # The plugin goes beside the vendored BLAS (tpcore/.libs), where _C looks for it; a
        # CPU-only build removes a stale one there.
        dirs = {os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), ".libs") for ext in self.extensions}
        if getattr(self, "editable_mode", False) or self.inplace:
            dirs.add(os.path.join(HERE, "python", "tpcore", ".libs"))
        for libs_dir in sorted(dirs):
            _place_plugin(libs_dir, cuda_lib)
            _place_plugin(libs_dir, mpi_lib, "libtpcore_mpi.so")
        if cuda_lib:
            log(f"CUDA plugin: {os.path.basename(cuda_lib)} into {', '.join(sorted(dirs))}")
        if mpi_lib:
            log(f"MPI plugin: {os.path.basename(mpi_lib)} into {', '.join(sorted(dirs))}")
        self._cuda_lib, self._mpi_lib = cuda_lib, mpi_lib

    def copy_extensions_to_source(self):
        # `build_ext --inplace` builds in build/ and copies the extension next to the
        # sources afterwards: the vendored library must follow it.
        super().copy_extensions_to_source()
        vendored = getattr(self, "_vendored", None)
        if vendored:
            _vendor_into(os.path.join(HERE, "python", "tpcore", ".libs"), vendored)
        _place_plugin(os.path.join(HERE, "python", "tpcore", ".libs"), getattr(self, "_cuda_lib", None))
        _place_plugin(os.path.join(HERE, "python", "tpcore", ".libs"), getattr(self, "_mpi_lib", None),
                      "libtpcore_mpi.so")


def _place_plugin(libs_dir, lib, name="libtpcore_cuda.so"):
    """Copies a plugin (the CUDA one, or name) into libs_dir, or removes a previous build's there (lib None)."""
    dst = os.path.join(libs_dir, name)
    if lib:
        os.makedirs(libs_dir, exist_ok=True)
        tmp = dst + ".tmp"
        shutil.copy2(lib, tmp)
        os.replace(tmp, dst)  # a process that has the old one mapped keeps it
    elif os.path.exists(dst):
        os.remove(dst)


def _vendor_into(libs_dir, blas):
    os.makedirs(libs_dir, exist_ok=True)
    shutil.copy2(blas["vendor"], libs_dir)
    if blas.get("license"):
        shutil.copy2(blas["license"], os.path.join(libs_dir, "LICENSE.scipy-openblas32.txt"))


def numpy_include():
    import numpy
    return numpy.get_include()


def sources():
    """The C core's files and the extension's: every *.c of the directories of csrc/sources.mk."""
    dirs = read_source_dirs()
    core = sorted(f for d in dirs["TP_CORE_DIRS"] for f in glob.glob(os.path.join(d, "*.c")))
    return core + sorted(f for d in dirs["TP_PYTHON_DIRS"] for f in glob.glob(os.path.join(d, "*.c")))


setup(
    version=VERSION,
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
