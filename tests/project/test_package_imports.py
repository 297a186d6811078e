"""The package's import graph: every module imports on its own in a fresh interpreter, the
modules import each other without cycles (function-level imports counted), the subpackages
depend on each other in one direction only (the ALLOWED table), and no private name crosses
a subpackage."""
import ast
import json
import os
import select
import subprocess
import sys

import pytest
import paths

PKG = str(paths.ROOT / "python" / "tpcore")


def _modules():
    out = {}
    for dp, _, fs in os.walk(PKG):
        for f in fs:
            if f.endswith(".py"):
                path = os.path.join(dp, f)
                name = "tpcore." + os.path.relpath(path, PKG)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = _modules()


def _imports(name, path):
    """{imported tpcore module: True if at module level (not inside a function)}."""
    tree = ast.parse(open(path).read())
    pkg = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    top = {id(n) for n in tree.body}
    for n in tree.body:  # module-level try/if blocks count as module level
        if isinstance(n, (ast.Try, ast.If)):
            top |= {id(m) for m in ast.walk(n)}
    out = {}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [base + "." + a.name if base + "." + a.name in MODULES else base for a in node.names
                       if base + "." + a.name != "tpcore._C"]  # the extension: every layer may use it
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            if t in MODULES and t != name:
                out[t] = out.get(t, False) or id(node) in top
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_no_import_cycles_between_modules():
    # the package's __init__ imports everything, and a module may import the package's
    # public functions (spawn's child calls tpcore.init): edges to "tpcore" itself do not count
    graph = {m: {d for d in deps if d != "tpcore"} for m, deps in GRAPH.items() if m != "tpcore"}
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m)


# The subpackages and what each may import (besides itself, tpcore._C and the standard
# library).  Dependencies run one way: a subpackage may import only those below it.
# tpcore itself (the face, __init__.py) imports everything and is imported by nothing
# inside the package but the tools on top (bench, demo).
ALLOWED = {
    "utils": set(),
    "distributed": {"utils"},
    "io": {"utils"},
    "nn": {"utils", "distributed", "io"},
    "models": {"utils", "distributed", "io", "nn"},
    "parallel": {"utils", "distributed", "io", "nn", "models"},
    "serve": {"utils", "distributed", "io", "nn", "models"},
    "launch": {"utils", "distributed"},
    "torch": {"utils", "distributed", "nn"},  # the subpackage tpcore.torch/ (imports PyTorch; tpcore never imports it)
    "cleanup": {"utils"},
    "bench": {"tpcore", "utils", "distributed", "io", "nn", "models", "parallel", "serve", "launch", "torch"},
    "demo": {"tpcore", "utils", "distributed", "io", "nn", "models", "parallel", "serve", "launch", "bench"},
    "chat": {"tpcore", "utils", "distributed", "models", "launch"},   # python -m tpcore.chat, a tool on top
}


def _home(mod):
    """The subpackage a module belongs to ("tpcore" for the face, "_C" for the extension)."""
    parts = mod.split(".")
    return "tpcore" if len(parts) == 1 else parts[1]


def test_every_module_belongs_to_a_known_subpackage():
    homes = {_home(m) for m in MODULES} - {"tpcore"}
    assert homes == set(ALLOWED), \
        f"subpackages without a row in ALLOWED, or rows without a subpackage: {homes ^ set(ALLOWED)}"


def test_dependencies_run_one_way():
    bad = []
    for mod, deps in GRAPH.items():
        home = _home(mod)
        if home == "tpcore":
            continue
        for dep in deps:
            there = _home(dep)
            if there != home and there not in ALLOWED[home]:
                bad.append(f"{mod} imports {dep} ({home} may import {sorted(ALLOWED[home]) or 'nothing of tpcore'})")
    assert not bad, "imports against the layering:\n  " + "\n  ".join(sorted(bad))


def _private_uses(mod, path):
    """(name, module) for each private name (a leading underscore) this module takes from a
    tpcore module of another subpackage: imported by name, or read as an attribute of a
    module it imported."""
    tree = ast.parse(open(path).read())
    pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    aliases = {}  # local name -> tpcore module
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base.startswith("tpcore"):
                continue
            for a in node.names:
                full = base + "." + a.name
                if full == "tpcore._C":
                    continue
                if full in MODULES:
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and base in MODULES:
                    out.append((a.name, base))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.value.id in aliases):
            out.append((node.attr, aliases[node.value.id]))
    return [(n, m) for n, m in out if _home(m) != _home(mod) and m != "tpcore._C"]


def test_no_private_name_crosses_a_subpackage():
    bad = [f"{mod} uses {name} of {there}" for mod, path in MODULES.items() if _home(mod) != "tpcore"
           for name, there in _private_uses(mod, path)]
    assert not bad, "private names used across subpackages:\n  " + "\n  ".join(sorted(set(bad)))


def test_io_knows_no_model():
    # the file formats know files only: no layer, model or Hugging Face module
    for mod in MODULES:
        if _home(mod) == "io":
            assert all(_home(d) in ("io", "utils") for d in GRAPH[mod]), (mod, GRAPH[mod])


def test_the_face_only_reexports():
    """tpcore/__init__.py and each subpackage's __init__ hold imports, __all__ and a docstring:
    no function or class of their own."""
    for mod, path in MODULES.items():
        if not path.endswith("__init__.py") or _home(mod) == "bench":
            continue
        tree = ast.parse(open(path).read())
        defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
        assert not defs, f"{path} defines {defs}: an __init__ only re-exports"
        assert ast.get_docstring(tree), f"{path} has no docstring saying what the subpackage holds"


# A process that has imported the third-party packages tpcore's modules use (never a tpcore
# module), then forks a child per module name read from stdin: the child imports that module
# alone, as a fresh interpreter would, and the parent answers with its exit status and error.
# Saves an interpreter start and a torch import per module.
_IMPORTER = r"""
import importlib, json, os, sys, traceback
for dep in ("numpy", "ml_dtypes", "cloudpickle", "torch"):
    try:
        importlib.import_module(dep)
    except ImportError:
        pass
assert not any(m == "tpcore" or m.startswith("tpcore.") for m in sys.modules), "tpcore imported early"
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(line.strip())
            code, err = 0, ""
        except BaseException:
            code, err = 1, traceback.format_exc()
        os.write(w, err.encode()[-20000:])
        os._exit(code)
    os.close(w)
    err = b""
    while chunk := os.read(r, 65536):
        err += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": status, "error": err.decode(errors="replace")}), flush=True)
"""


@pytest.fixture(scope="module")
def importer():
    proc = subprocess.Popen([sys.executable, "-c", _IMPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert json.loads(proc.stdout.readline()) == {"ready": True}

    def import_alone(mod, timeout=120):
        proc.stdin.write(mod + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        assert ready, f"import {mod} did not finish within {timeout} s"
        return json.loads(proc.stdout.readline())

    yield import_alone
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if not m.startswith("tpcore.bench.")))
def test_each_module_imports_alone(mod, importer):
    out = importer(mod)
    assert out["status"] == 0 and not out["error"], out["error"]


def test_the_importer_reports_a_failing_import(importer):
    out = importer("tpcore.no_such_module")
    assert out["status"] != 0 and "No module named 'tpcore.no_such_module'" in out["error"]
