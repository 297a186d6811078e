"""Build of tpcore: the C core plus the CPython extension tpcore._C, in one
setuptools Extension (as msgspec does it), and the two plugins tpcore opens at run time.

The Makefile builds the same things without Python (libtpcore.a, the C tests, `make CUDA=1`'s
plugin), and both read one description: csrc/sources.mk (what is compiled) and csrc/flags.mk
(with which flags).  setup.py adds what it finds on the machine (BLAS, mpicc, nvcc).

Switches (environment variables):
  TPCORE_SANITIZE=address,undefined   build with sanitizers (-O1 -g)
  TPCORE_DEBUG=1                      -O0 -g
  TPCORE_BLAS=system                  link a system CBLAS found by pkg-config (openblas, cblas)
                                      instead of vendoring the scipy-openblas32 wheel's OpenBLAS
  TPCORE_CUDA=0                       CPU-only: no CUDA plugin (also when nvcc is not found,
                                      and in sanitized builds)
  TPCORE_CUDA_ARCHS="80 90"           the CUDA plugin's machine code (sm_XX for each, PTX of the
                                      last); "90" alone makes quick development builds
  TPCORE_MPI=0                        no MPI plugin (else built when mpicc is found)
  TPCORE_BUILD_JOBS=N                 files compiled at once (default: the CPUs; `build_ext -j N`)
The CUDA plugin, tpcore/.libs/libtpcore_cuda.so, is built by nvcc (PATH, $CUDA_HOME/bin,
/usr/local/cuda/bin) from csrc/sources.mk's TP_CUDA_DIRS, the CUDA runtime linked statically;
tpcore._C never links CUDA and loads it on first GPU use.
The MPI plugin, tpcore/.libs/libtpcore_mpi.so, is compiled from csrc/sources.mk's TP_MPI_DIRS with
the flags of `mpicc --showme:compile` / `--showme:link` (pkg-config ompi as a fallback) and linked
to libmpi; tpcore._C opens it on first use of the mpi backend, so tpcore imports without MPI.

The build prints what it detected and each step as it starts and ends ("[tpcore build] ..." on
stderr: `pip install -v .` shows them; pip without -v shows only its spinner).
"""
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES_MK = os.path.join(HERE, "csrc", "sources.mk")
FLAGS_MK = os.path.join(HERE, "csrc", "flags.mk")


VERSION_HEADER = os.path.join(HERE, "csrc", "include", "tpcore", "tpcore.h")


def read_version(header=VERSION_HEADER):
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


def read_mk(path, overrides=None):
    """{variable: [words]} of a make fragment the Makefile includes (csrc/sources.mk,
    csrc/flags.mk): plain `NAME := words` lines, '#' comments, and `$(NAME)` of a name defined
    above, expanded as make's `:=` does.  overrides {NAME: "words"} replace a line's value, as a
    variable given on make's command line does."""
    out, overrides = {}, overrides or {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\s*:?=\s*(.*)", line)
            if not m:
                raise SystemExit(f"{path}:{n}: cannot read {line!r} (plain 'NAME := words' lines only)")
            name, value = m.group(1), overrides.get(m.group(1), m.group(2))

            def ref(r, n=n):
                if r.group(1) not in out:
                    raise SystemExit(f"{path}:{n}: $({r.group(1)}) is not a name defined above (make "
                                     "functions are not understood here)")
                return " ".join(out[r.group(1)])
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", ref, value)
            if "$" in value:
                raise SystemExit(f"{path}:{n}: cannot read {line!r} (only $(NAME) references)")
            out[name] = value.split()
    return out


def read_source_dirs(path=SOURCES_MK):
    """{variable: [words]} of csrc/sources.mk, the source list the Makefile includes."""
    out = read_mk(path)
    for key in ("TP_CORE_DIRS", "TP_PYTHON_DIRS", "TP_CUDA_DIRS", "TP_CUDA_EXTRA", "TP_CUDA_MAP",
                "TP_MPI_DIRS", "TP_MPI_EXTRA", "TP_MPI_MAP"):
        if key not in out:
            raise SystemExit(f"{path}: no {key} line")
    return out


def read_flags(sanitizers=None, path=FLAGS_MK):
    """{variable: [flags]} of csrc/flags.mk, the flags the Makefile includes; sanitizers (a
    TPCORE_SANITIZE list) replaces TP_SANITIZERS."""
    out = read_mk(path, {"TP_SANITIZERS": sanitizers} if sanitizers else None)
    for key in ("TP_CFLAGS", "TP_LIBS", "TP_OPT_RELEASE", "TP_OPT_DEBUG", "TP_OPT_SANITIZE", "TP_LDFLAGS_SANITIZE",
                "TP_PLUGIN_CFLAGS", "TP_MPI_LDFLAGS", "TP_CUDA_ARCHS", "TP_NVCCFLAGS", "TP_CUDA_CFLAGS",
                "TP_CUDA_LDFLAGS", "TP_CUDA_LIBS"):
        if key not in out:
            raise SystemExit(f"{path}: no {key} line")
    return out


def _dir_files(dirs, ext):
    return sorted(f for d in dirs for f in glob.glob(os.path.join(d, f"*{ext}")))


VERSION = read_version()


def log(msg):
    print(f"[tpcore build] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the tools the build needs

_INSTALL_CC = ("Debian/Ubuntu: apt-get install build-essential; Fedora/RHEL: dnf install gcc; "
               "conda: conda install -c conda-forge c-compiler")


def toolchain_problem(compiler, include_dir=None):
    """A sentence saying what to install when the C compiler (the command list setuptools
    compiles with) or Python's C headers are missing, or cannot build a file that includes
    <Python.h>; None when the tools work."""
    include_dir = include_dir or sysconfig.get_path("include")
    exe = compiler[0] if compiler else "cc"
    if not (shutil.which(exe) or (os.path.isabs(exe) and os.access(exe, os.X_OK))):
        whence = "the CC variable's" if os.environ.get("CC") else \
            "the compiler this Python was built with; the CC variable chooses another"
        return (f"tpcore needs a C compiler to build, and {exe!r} ({whence}) is not on PATH.  Install one: "
                f"{_INSTALL_CC} (tpcore builds on Linux).")
    if not os.path.exists(os.path.join(include_dir, "Python.h")):
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        return (f"tpcore needs Python's C headers to build its extension, and {include_dir}/Python.h is "
                f"missing.  Install them: Debian/Ubuntu: apt-get install python{ver}-dev (or python3-dev); "
                "Fedora/RHEL: dnf install python3-devel (conda's and pyenv's interpreters carry them).")
    with tempfile.TemporaryDirectory(prefix="tpcore-cc-") as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("#include <Python.h>\n#include <stdlib.h>\nint tp_probe(void) { return (int)sizeof(PyObject); }\n")
        r = subprocess.run([*compiler, f"-I{include_dir}", "-c", src, "-o", os.path.join(tmp, "probe.o")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        return (f"tpcore's build cannot compile a C file with {' '.join(compiler)}: "
                f"{(r.stdout + r.stderr).strip()[-1500:]}\nA complete C toolchain (compiler and the C "
                f"library's headers) is needed: {_INSTALL_CC}.")
    return None


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
    """TPCORE_CUDA_ARCHS (default flags.mk's TP_CUDA_ARCHS; commas or spaces) as a sorted list of ints."""
    text = os.environ.get("TPCORE_CUDA_ARCHS", "").replace(",", " ").split() or read_flags()["TP_CUDA_ARCHS"]
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


# ------------------------------------------------------------------ flags and commands

def opt_flags(cfg):
    """(compile flags, link flags) of a configuration's optimisation and sanitizers (flags.mk's
    TP_OPT_*: release, TPCORE_DEBUG, TPCORE_SANITIZE)."""
    fl = read_flags(cfg["sanitize"] or None)
    if cfg["sanitize"]:
        return fl["TP_OPT_SANITIZE"], fl["TP_LDFLAGS_SANITIZE"]
    return (fl["TP_OPT_DEBUG"] if cfg["debug"] else fl["TP_OPT_RELEASE"]), []


def mpi_plugin_command(plan, lib, compiler, cfg):
    """The one command (compile and link) of libtpcore_mpi.so: sources.mk's TP_MPI_DIRS and
    TP_MPI_EXTRA with flags.mk's plugin flags, the build's optimisation and mpicc's flags, the
    entry alone exported (TP_MPI_MAP).  The Makefile's rule runs the same (tests/project/test_build.py)."""
    src, fl = read_source_dirs(), read_flags()
    opt, ld = opt_flags(cfg)
    srcs = _dir_files(src["TP_MPI_DIRS"], ".c") + src["TP_MPI_EXTRA"]
    return [*compiler, *fl["TP_PLUGIN_CFLAGS"], *opt, *plan["cflags"], *fl["TP_MPI_LDFLAGS"], *srcs, "-o", lib,
            f"-Wl,--version-script={src['TP_MPI_MAP'][0]}", *ld, *plan["libs"]]


def cuda_plugin_commands(plan, build_dir, compiler):
    """([(object, source, command)] and the link command of libtpcore_cuda.so: every .cu of
    sources.mk's TP_CUDA_DIRS by nvcc, every .c (and TP_CUDA_EXTRA) by the C compiler, linked by
    nvcc with the static CUDA runtime and one exported symbol (TP_CUDA_MAP); flags.mk's
    TP_NVCCFLAGS / TP_CUDA_CFLAGS / TP_CUDA_LDFLAGS.  Files are placed as the Makefile's in its
    BUILD (cuda-obj/<path under csrc>.cu.o and .o, libtpcore_cuda.so): tests/project/test_build.py
    compares the two."""
    nvcc, root, archs = plan["nvcc"], plan["root"], plan["archs"]
    objdir = os.path.join(build_dir, "cuda-obj")
    src, fl = read_source_dirs(), read_flags()
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    nvcc_flags = [*fl["TP_NVCCFLAGS"], *gencode]
    cc_flags = [*fl["TP_CUDA_CFLAGS"], f"-I{os.path.join(root, 'include')}", f'-DTP_CUDA_ARCH_STR="{arch_text(archs)}"']
    steps = []
    for s in _dir_files(src["TP_CUDA_DIRS"], ".cu"):
        obj = os.path.join(objdir, os.path.relpath(s, "csrc") + ".o")
        steps.append((obj, s, [nvcc, *nvcc_flags, "-c", s, "-o", obj]))
    for s in _dir_files(src["TP_CUDA_DIRS"], ".c") + src["TP_CUDA_EXTRA"]:
        obj = os.path.join(objdir, os.path.splitext(os.path.relpath(s, "csrc"))[0] + ".o")
        steps.append((obj, s, [*compiler, *cc_flags, "-c", s, "-o", obj]))
    lib = os.path.join(build_dir, "libtpcore_cuda.so")
    link = [nvcc, *fl["TP_CUDA_LDFLAGS"], "-Xlinker", f"--version-script={src['TP_CUDA_MAP'][0]}", "-o", lib,
            *(o for o, _, _ in steps), *fl["TP_CUDA_LIBS"]]
    return steps, link, lib


def _headers():
    return sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cuh", recursive=True))


def _stale(obj, deps):
    try:
        t = os.path.getmtime(obj)
    except OSError:
        return True
    return any(os.path.getmtime(d) > t for d in deps)


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, (r.stdout + r.stderr).strip(), cmd


def build_mpi_plugin(plan, build_temp, compiler, cfg, force=False):
    """libtpcore_mpi.so (mpi_plugin_command), rebuilt when a source, header or the map is newer.
    Returns the library's path."""
    tag = hashlib.sha1(json.dumps([plan, compiler, opt_flags(cfg)], sort_keys=True).encode()).hexdigest()[:10]
    lib = os.path.join(build_temp, f"mpi-{tag}", "libtpcore_mpi.so")
    cmd = mpi_plugin_command(plan, lib, compiler, cfg)
    src = read_source_dirs()
    deps = _dir_files(src["TP_MPI_DIRS"], ".c") + src["TP_MPI_EXTRA"] + _headers() + src["TP_MPI_MAP"]
    if not (force or _stale(lib, deps)):
        log("MPI plugin: up to date")
        return lib
    log(f"MPI plugin: building libtpcore_mpi.so with {plan['mpicc']}'s flags (TPCORE_MPI=0 skips it)")
    t0 = time.monotonic()
    os.makedirs(os.path.dirname(lib), exist_ok=True)
    log(" ".join(cmd))
    rc, out, _ = _run(cmd)
    if rc != 0:
        raise SystemExit(f"MPI plugin: building failed:\n{out}\n(TPCORE_MPI=0 builds tpcore without it)")
    log(f"MPI plugin: built in {time.monotonic() - t0:.0f} s")
    return lib


def build_cuda_plugin(plan, build_temp, compiler, force=False, jobs=None):
    """libtpcore_cuda.so (cuda_plugin_commands).  Objects live in a directory of their own per
    nvcc and arch list; only stale ones are rebuilt, in parallel, each reported as it ends.
    Returns the library's path."""
    nvcc, root, archs = plan["nvcc"], plan["root"], plan["archs"]
    tag = hashlib.sha1(json.dumps([nvcc, root, archs, compiler], sort_keys=True).encode()).hexdigest()[:10]
    steps, link, lib = cuda_plugin_commands(plan, os.path.join(build_temp, f"cuda-{tag}"), compiler)
    deps = _headers() + read_source_dirs()["TP_CUDA_MAP"]
    todo = [(obj, src, cmd) for obj, src, cmd in steps if force or _stale(obj, [src] + deps)]
    if not todo and not _stale(lib, [o for o, _, _ in steps]):
        log("CUDA plugin: up to date")
        return lib
    workers = max(1, min(len(todo) or 1, jobs or os.cpu_count() or 1))
    archs_list = ", ".join(f"sm_{a}" for a in archs)
    log(f"CUDA plugin: building libtpcore_cuda.so for {archs_list} (+ compute_{archs[-1]} PTX) with {nvcc}: "
        f"{len(todo)} of {len(steps)} files, {workers} at a time; the longest step (minutes); TPCORE_CUDA=0 "
        f"skips it, TPCORE_CUDA_ARCHS=90 builds one architecture")
    if todo:
        log("CUDA plugin: nvcc " + " ".join(next((c for o, s, c in steps if s.endswith(".cu")), [nvcc])[1:-4]))
    t0 = time.monotonic()
    for obj, _, _ in todo:
        os.makedirs(os.path.dirname(obj), exist_ok=True)
    with ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(_run, cmd): src for _, src, cmd in todo}
        for done, fut in enumerate(as_completed(futures), 1):
            rc, out, cmd = fut.result()
            if rc != 0:
                for f in futures:
                    f.cancel()
                raise SystemExit(f"CUDA plugin: compiling {futures[fut]} failed:\n{' '.join(cmd)}\n{out}\n"
                                 "(TPCORE_CUDA=0 builds tpcore CPU-only)")
            log(f"CUDA plugin: [{done}/{len(todo)}] {os.path.relpath(futures[fut], 'csrc')} "
                f"({time.monotonic() - t0:.0f} s)")
    log(" ".join(link))
    rc, out, _ = _run(link)
    if rc != 0:
        raise SystemExit(f"CUDA plugin: linking failed:\n{out}\n(TPCORE_CUDA=0 builds tpcore CPU-only)")
    log(f"CUDA plugin: built in {time.monotonic() - t0:.0f} s")
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
            "info": (f"OpenBLAS from scipy-openblas32 {sob.__version__}, "
                     f"vendored as tpcore/.libs/{os.path.basename(lib)}")}


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
        # the flags themselves: an edit of csrc/flags.mk rebuilds
        "flags": read_flags(),
    }


def extension_flags(cfg):
    """(compile flags, link flags) of tpcore._C beyond setuptools' own and BLAS's: flags.mk's
    TP_CFLAGS and the configuration's TP_OPT_*, linked with TP_LIBS."""
    fl = read_flags(cfg["sanitize"] or None)
    opt, ld = opt_flags(cfg)
    return [*fl["TP_CFLAGS"], *opt], [*ld, *fl["TP_LIBS"]]


def _jobs(parallel):
    """Files compiled at once: build_ext -j, else TPCORE_BUILD_JOBS, else the CPUs."""
    if isinstance(parallel, int) and not isinstance(parallel, bool) and parallel > 0:
        return parallel
    text = os.environ.get("TPCORE_BUILD_JOBS", "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise SystemExit(f"TPCORE_BUILD_JOBS must be a number >= 1, got {text!r}")
        return int(text)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _compile_in_parallel(compiler, jobs, counter):
    """Makes compiler.compile compile an extension's sources `jobs` at a time (setuptools compiles
    one extension's files one by one; its -j only runs several extensions at once)."""
    needed = ("_setup_compile", "_get_cc_args", "_compile")
    if jobs <= 1 or not all(hasattr(compiler, n) for n in needed):
        return

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False, extra_preargs=None,
                extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        todo = [o for o in objects if o in build]
        counter["files"] += len(todo)
        with ThreadPoolExecutor(jobs) as pool:
            for f in [pool.submit(one, o) for o in todo]:
                f.result()  # the first failure (a CompileError with the compiler's output) stops the build
        return objects

    compiler.compile = compile


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
        compiler = list(self.compiler.compiler_so) if hasattr(self.compiler, "compiler_so") else ["cc"]
        problem = toolchain_problem(compiler)
        if problem:
            raise SystemExit(problem)
        cfg = build_config()
        stamp = self._separate_configs(cfg)
        sanitize, debug = cfg["sanitize"], cfg["debug"]
        jobs = _jobs(self.parallel)
        log(f"tpcore {VERSION}: compiler {compiler[0]}, {jobs} files at a time (TPCORE_BUILD_JOBS); "
            f"sanitizers: {sanitize or 'off'}; debug: {'on' if debug else 'off'}")
        mplan, plan = mpi_plan(sanitize), cuda_plan(sanitize)
        log("backends: shm (always); nccl (always built: libnccl is opened at run time, "
            "TPCORE_NCCL_LIBRARY or the nvidia-nccl wheel); mpi: "
            + (f"plugin libtpcore_mpi.so built with {mplan['mpicc']}'s flags" if "why_not" not in mplan
               else f"no plugin: {mplan['why_not']}"))
        if "why_not" in plan:
            log(f"cuda: CPU-only build, no CUDA plugin: {plan['why_not']}")
        else:
            log(f"cuda: building libtpcore_cuda.so with {plan['nvcc']} (toolkit {plan['root']}; "
                f"{arch_text(plan['archs'])}; TPCORE_CUDA=0 skips it)")
        blas = blas_config()
        log(f"BLAS: {blas['info']}")
        steps = ["the extension tpcore._C"] + (["the MPI plugin"] if "why_not" not in mplan else []) + \
            ([f"the CUDA plugin ({', '.join(f'sm_{a}' for a in plan['archs'])})"] if "why_not" not in plan else [])
        log(f"to build: {', '.join(steps)}")
        cflags, ldflags = extension_flags(cfg)
        for ext in self.extensions:
            ext.extra_compile_args = cflags + blas["cflags"]
            ext.extra_link_args = ldflags + blas["libs"]
            ext.define_macros += blas["macros"]
            ext.define_macros += [
                ("TPCORE_CUDA_WHY_NOT_STR", json.dumps(plan.get("why_not", ""))),
                ("TPCORE_VERSION_STR", f'"{VERSION}"'),
                ("TPCORE_SANITIZE_STR", f'"{sanitize}"'),
                ("TPCORE_BUILD_STR", '"debug"' if debug else '"release"'),
            ]
        counter = {"files": 0}
        _compile_in_parallel(self.compiler, jobs, counter)
        nfiles = sum(len(ext.sources) for ext in self.extensions)
        log(f"extension tpcore._C: {nfiles} C files (skipped when up to date)")
        t0 = time.monotonic()
        super().build_extensions()
        log(f"extension tpcore._C: built in {time.monotonic() - t0:.0f} s" if counter["files"]
            else "extension tpcore._C: up to date")
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as f:
            json.dump(cfg, f)
        cc = compiler[:1]  # the plugins take flags.mk's flags alone, not Python's
        mpi_lib = None
        if "why_not" not in mplan:
            mpi_lib = build_mpi_plugin(mplan, self._base_temp, cc, cfg, force=self._user_force)
        cuda_lib = None
        if "why_not" not in plan:
            cuda_lib = build_cuda_plugin(plan, self._base_temp, cc, force=self._user_force, jobs=jobs)
        if blas["vendor"]:
            dirs = {os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), ".libs")
                    for ext in self.extensions}
            if getattr(self, "editable_mode", False) or self.inplace:
                dirs.add(os.path.join(HERE, "python", "tpcore", ".libs"))  # next to the in-tree extension
            for libs_dir in sorted(dirs):
                _vendor_into(libs_dir, blas)
                log(f"vendored {os.path.basename(blas['vendor'])} into {libs_dir}")
            self._vendored = blas
        # The plugins go beside the vendored BLAS (tpcore/.libs), where _C looks for them; a
        # build without one removes a stale one there.
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
    return _dir_files(dirs["TP_CORE_DIRS"], ".c") + _dir_files(dirs["TP_PYTHON_DIRS"], ".c")


setup(
    version=VERSION,
    ext_modules=[
        Extension(
            "tpcore._C",
            sources=sources(),
            include_dirs=["csrc/include", numpy_include()],
            depends=sorted(glob.glob("csrc/**/*.h", recursive=True)) + ["csrc/flags.mk", "csrc/sources.mk"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
