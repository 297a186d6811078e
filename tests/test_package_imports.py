"""The package's import graph: every module imports on its own in a fresh interpreter,
the modules import each other without cycles (function-level imports counted), and the
Hugging Face module and the models import in one direction only (models -> hf)."""
import ast
import os
import subprocess
import sys

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "tpcore")


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
            targets = [base + "." + a.name if base + "." + a.name in MODULES else base for a in node.names]
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


def test_models_and_hf_import_in_one_direction():
    assert "tpcore.models" not in GRAPH["tpcore.hf"], "tpcore.hf must not import tpcore.models (at any level)"
    assert GRAPH["tpcore.models"].get("tpcore.hf") is True, "tpcore.models imports tpcore.hf at module level"
    # the checkpoint formats know files only: no model, layer or Hugging Face module
    assert set(GRAPH["tpcore._formats"]) <= {"tpcore._array"}, GRAPH["tpcore._formats"]


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if not m.startswith("tpcore.bench.")))
def test_each_module_imports_alone(mod):
    out = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
