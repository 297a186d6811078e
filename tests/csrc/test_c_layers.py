"""The C tree's architecture, as rules over its #include lines (csrc/, tests excluded).

The house, from the ground up (DESIGN.md section 1): each folder may include the public
headers (csrc/include/tpcore/), its own headers and the folders listed for it in ALLOWED,
nothing else; in particular nothing includes a folder above its own.

    include/tpcore   the public C API: includes only itself (no Python, CUDA or MPI)
    core             status, dtypes, partition, the library finder and the plugin opener
    devices          the device registry (cpu built in)
    kernels          the kernel table and its API checks; kernels/cpu the CPU table
    comm             the dispatcher (names no backend: no header of its backends);
                     comm/store the TCP store; comm/shm, comm/nccl, comm/mpi the backends
    cuda             the CUDA plugin's loader in the core (fills the device and kernel tables)
    layers           the parallel layers over kernels and comm
    python           the extension (the only folder with Python.h / NumPy)
The two plugins are libraries of their own: cuda/plugin and cuda/kernels (libtpcore_cuda.so,
the only files with CUDA headers), comm/mpi/plugin (libtpcore_mpi.so, the only ones with
<mpi.h>); each reaches the core only through its ABI header and the stateless core headers.
"""
import re
from pathlib import Path
import paths

ROOT = paths.ROOT
CSRC = ROOT / "csrc"

ALLOWED = {
    "include/tpcore": set(),
    "core": set(),
    "devices": {"core"},
    "kernels": {"core", "devices"},
    "kernels/cpu": {"core", "kernels"},
    "comm": {"core"},
    "comm/store": {"core"},
    "comm/shm": {"core", "comm"},
    "comm/nccl": {"core", "comm", "comm/shm", "comm/store"},
    "comm/mpi": {"core", "comm"},
    "cuda": {"core", "devices", "kernels"},
    "layers": {"core", "devices", "kernels", "comm"},
    "python": {"core", "devices", "kernels", "kernels/cpu", "comm", "comm/store", "cuda", "layers"},
    # the plugins (separate libraries)
    "cuda/plugin": {"core", "cuda"},
    "cuda/kernels": {"core", "kernels"},
    "comm/mpi/plugin": {"comm/mpi"},
}

# System headers that only some folders may include.
ONLY_IN = {
    r"Python\.h|numpy/": {"python"},
    r"mpi\.h": {"comm/mpi/plugin"},
    r"cuda[_a-z]*\.h|cublas|nccl\.h": {"cuda/plugin", "cuda/kernels"},
}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def sources():
    for path in sorted(CSRC.rglob("*")):
        rel = path.relative_to(CSRC)
        if path.suffix in (".c", ".h", ".cu", ".cuh") and rel.parts[0] != "tests":
            yield path, rel.parent.as_posix()


def folder_of(header: Path) -> str:
    return header.parent.relative_to(CSRC).as_posix()


def includes(path):
    """(kind, name, folder of a quoted include or None) of each #include line."""
    for kind, name in INCLUDE.findall(path.read_text(errors="replace")):
        folder = None
        if kind == '"':
            local = (path.parent / name).resolve()
            public = CSRC / "include" / name
            target = local if local.exists() else public if public.exists() else None
            if target is None:  # CPython's own internal headers (python/site.c): a system header
                assert path.parent == CSRC / "python", f"{path.relative_to(ROOT)}: #include \"{name}\" names no file"
                kind = "<"
            else:
                folder = folder_of(target)
        yield kind, name, folder


def test_every_folder_has_its_rule():
    folders = {f for _, f in sources()}
    assert folders == set(ALLOWED), f"folders without a rule: {folders - set(ALLOWED)}; " \
                                    f"rules without a folder: {set(ALLOWED) - folders}"


def test_includes_run_one_way_down():
    bad = []
    for path, folder in sources():
        for _kind, name, target in includes(path):
            if target is None or target == folder or target == "include/tpcore":
                continue
            if target not in ALLOWED[folder]:
                bad.append(f"{path.relative_to(ROOT)} ({folder}) includes {name} ({target})")
    assert not bad, "\n".join(bad)


def test_system_headers_stay_in_their_folders():
    bad = []
    for path, folder in sources():
        for kind, name, _ in includes(path):
            if kind != "<":
                continue
            for pattern, where in ONLY_IN.items():
                if re.fullmatch(f"(?:{pattern}).*", name) and folder not in where:
                    bad.append(f"{path.relative_to(ROOT)} includes <{name}>")
    assert not bad, "\n".join(bad)


def test_the_dispatcher_and_the_core_name_no_backend_or_device():
    """comm/*.c validates and dispatches: no backend's name in its calls; core/ knows no table."""
    for path in (CSRC / "comm").glob("*.c"):
        if path.name == "backends.c":  # the registry: one line per backend
            continue
        text = path.read_text()
        for word in ("tp_shm_", "tp_nccl_", "tp_mpi_"):
            assert word not in text, f"{path.relative_to(ROOT)} names {word}*"
    for path in (CSRC / "core").glob("*.[ch]"):
        text = path.read_text()
        for word in ("tp_device_register", "tp_kernels_register", "tp_cuda_", "struct tp_comm"):
            assert word not in text, f"{path.relative_to(ROOT)} names {word}"


def test_the_rules_catch_an_upward_include(tmp_path, monkeypatch):
    """The rule itself: a core file that includes a devices header is reported."""
    fake = tmp_path / "csrc"
    (fake / "core").mkdir(parents=True)
    (fake / "devices").mkdir()
    (fake / "include").mkdir()
    (fake / "devices" / "device_impl.h").write_text("")
    (fake / "core" / "bad.c").write_text('#include "../devices/device_impl.h"\n')
    monkeypatch.setattr(__import__(__name__), "CSRC", fake)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    try:
        test_includes_run_one_way_down()
    except AssertionError as e:
        assert "core/bad.c (core) includes ../devices/device_impl.h (devices)" in str(e)
    else:
        raise AssertionError("an upward include was not reported")
