"""The kernel parity harness (csrc/tests/test_kernels*.c), built with make and run
without Python in the loop: every entry of every available kernel table against
double-precision references on odd sizes, and the public tensor API's checks.  Also
asserts that every entry of the table (TP_KERNEL_ENTRIES in csrc/kernels/kernels_impl.h)
has a parity case, so a new entry without one fails here."""
import re

from c_binaries import ROOT, build, run


def build_and_run(tmp_path, sanitize):
    return run(build(tmp_path, sanitize, "test_kernels") / "test_kernels")


def check_output(r):
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    entries = re.search(r"^entries: (.*)$", out, re.M).group(1).split()
    covered = re.search(r"^covered: (.*)$", out, re.M).group(1).split()
    assert len(entries) == len(set(entries)) >= 30
    # every entry of the table has a parity case, and every case is an entry of the table
    assert set(entries) - set(covered) == set(), "entries without a parity case"
    assert set(covered) - set(entries) == set(), "cases of entries the table does not have"
    # the CPU table ran every entry, and each passed
    for e in entries:
        assert re.search(rf"^cpu {e}: ok ", out, re.M), f"cpu {e} did not pass:\n{out}"
    # a process with a CUDA kernel table (a GPU machine) ran every entry on it too, on device memory
    if not re.search(r"^device cuda: no kernel table", out, re.M):
        for e in entries:
            assert re.search(rf"^cuda {e}: ok ", out, re.M), f"cuda {e} did not pass:\n{out}"
    assert not re.search(r"FAIL", out), out
    for part in ("linear", "activations", "vocab, norms, rope", "attention, optimizers"):
        assert f"api {part}: ok" in out
    assert re.search(r"^\d+ passed, 0 failed$", out, re.M)


def test_kernel_parity(tmp_path):
    check_output(build_and_run(tmp_path, sanitize=False))


def test_kernel_parity_under_asan_ubsan(tmp_path):
    check_output(build_and_run(tmp_path, sanitize=True))


def test_entries_list_matches_the_table_struct():
    """TP_KERNEL_ENTRIES names the fields of tp_kernel_ops in order (the static assert
    checks the count; this checks the names)."""
    text = (ROOT / "csrc/kernels/kernels_impl.h").read_text()
    struct = text[text.index("typedef struct tp_kernel_ops"):text.index("} tp_kernel_ops;")]
    fields = re.findall(r"\(\*(\w+)\)\(", struct)
    listed = re.findall(r"X\((\w+)\)", text[text.index("#define TP_KERNEL_ENTRIES"):])
    assert fields == listed
