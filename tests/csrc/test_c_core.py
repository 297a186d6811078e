"""The C core without Python: build it with make (plain, and under ASan +
UBSan) and run its C tests of the communicator at world sizes 1-4 and of the
parallel MLP, the vocab-parallel embedding + cross-entropy and the Transformer
block (forward, backward, KV cache; equal at every world size) at world sizes
1-3.  Also checks
the layering rule: only csrc/python includes Python.h or NumPy headers."""
import re

import pytest

from c_binaries import ROOT, build, run


def build_and_run(c_builds, sanitize):
    b = build(c_builds, sanitize, "test_comm", "test_layers", "test_layer_memory")
    out = ""
    for exe in ("test_comm", "test_layers", "test_layer_memory"):
        r = run(b / exe, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "0 failed" in r.stdout
        out += r.stdout
    return out


def check_counts(out):
    """Each binary ends with 'N passed, 0 failed'; each ran its whole list (test_comm: 32 cases
    and more, test_layers: 21: the layers at world 1-3, with registered and plain memory,
    test_layer_memory: 5: the memory accounting at world 1-3 and in plain memory)."""
    counts = [(int(p), int(f)) for p, f in re.findall(r"(\d+) passed, (\d+) failed", out)]
    assert len(counts) == 3 and all(f == 0 for _, f in counts), out
    assert counts[0][0] >= 32 and counts[1][0] >= 21 and counts[2][0] >= 5, counts


@pytest.mark.slow  # builds the C core; the layers' Python tests run the same C code
def test_c_core(c_builds):
    check_counts(build_and_run(c_builds, sanitize=False))


@pytest.mark.sanitized
@pytest.mark.slow  # test_c_core runs the same binary plain
def test_c_core_under_asan_ubsan(c_builds):
    check_counts(build_and_run(c_builds, sanitize=True))


def test_python_headers_only_in_the_extension():
    offenders = []
    for path in (ROOT / "csrc").rglob("*.[ch]"):
        if "python" in path.relative_to(ROOT / "csrc").parts:
            continue
        text = path.read_text(errors="replace")
        if "Python.h" in text or "numpy/" in text:
            offenders.append(str(path))
    assert not offenders
