"""The kernel parity harness (csrc/tests/test_kernels*.c), built with make and run
without Python in the loop: every entry of every available kernel table against
double-precision references on odd sizes, and the public tensor API's checks.  Also
asserts that every entry of the table (TP_KERNEL_ENTRIES in csrc/kernels/kernels_impl.h)
has a parity case, so a new entry without one fails here."""
import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_and_run(tmp_path, sanitize):
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.skip("make or a C compiler is missing")
    build = tmp_path / ("san" if sanitize else "plain")
    args = ["make", "-s", "-C", str(ROOT), f"BUILD={build}", f"{build}/test_kernels"]
    if sanitize:
        args.insert(1, "SANITIZE=1")
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    # the binaries carry their own sanitizer runtime (or none): not the one the sanitized
    # suite preloads into Python; a hostile size must come back as an error, not abort
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:allocator_may_return_null=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    r = subprocess.run([str(build / "test_kernels")], capture_output=True, text=True, timeout=900, env=env)
    assert "ERROR: AddressSanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr
    return r


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
