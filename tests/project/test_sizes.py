"""The house's size rules, over every tracked source file: no Python or C/CUDA file over 800
lines, no function over 150 lines (Python by its syntax tree; C and CUDA by clang-format's
layout, which .clang-format and test_lint.py hold: a definition opens with a line at column 0
ending in `{` and closes with `}` at column 0)."""
import ast
import re
import subprocess

import pytest

import paths

ROOT = paths.ROOT
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 150
C_SUFFIXES = (".c", ".h", ".cu", ".cuh")


def _tracked():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [ROOT / p for p in out.stdout.splitlines() if p.endswith((".py", *C_SUFFIXES))]


def c_functions(text):
    """(name line, first line number, length) of each top-level brace block that is a function."""
    out, start, head = [], None, ""
    for i, line in enumerate(text.split("\n"), 1):
        if start is None:
            if re.match(r"[A-Za-z_].*\)\s*(const\s*)?\{\s*$", line) and not re.match(
                    r"(typedef|struct|enum|union|static const|const)\b.*=", line):
                start, head = i, line
        elif line.startswith("}"):
            out.append((head.strip(), start, i - start + 1))
            start = None
    return out


def test_c_function_finder_sees_definitions_only():
    src = "static int f(int a) {\n  return a;\n}\nstruct s {\n  int x;\n};\nvoid g(void) {\n}\n"
    assert [(h, n) for h, _, n in c_functions(src)] == [("static int f(int a) {", 3), ("void g(void) {", 2)]


def test_no_file_over_800_lines():
    long = {}
    for p in _tracked():
        if p.exists():
            n = p.read_text(errors="replace").count("\n")
            if n > MAX_FILE_LINES:
                long[str(p.relative_to(ROOT))] = n
    assert not long, f"split these by concern (at most {MAX_FILE_LINES} lines): {long}"


def test_no_function_over_150_lines():
    long = []
    for p in _tracked():
        if not p.exists():
            continue
        text = p.read_text(errors="replace")
        rel = str(p.relative_to(ROOT))
        if p.suffix == ".py":
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
        else:
            long += [f"{rel}:{line} {head} ({n} lines)" for head, line, n in c_functions(text)
                     if n > MAX_FUNCTION_LINES]
    assert not long, "split these functions (at most 150 lines):\n" + "\n".join(long)
