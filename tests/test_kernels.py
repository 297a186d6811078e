"""The kernel parity harness (csrc/tests/test_kernels*.c), built with make and run
without Python in the loop: every entry of every available kernel table against
double-precision references on odd sizes, and the public tensor API's checks.  Also
asserts that every entry of the table (TP_KERNEL_ENTRIES in csrc/kernels/kernels_impl.h)
has a parity case, so a new entry without one fails here."""
import re

import pytest

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


def test_cuda_attention_entries_under_the_host_emulator():
    """The CUDA attention entries (csrc/kernels/cuda/attention*.cu) through the same parity
    cases on the host: csrc/tests/cuda_emu runs each CUDA thread as a fiber with cooperative
    barriers and shuffles, shared memory poisoned with NaN, fibers in both orders.  Checks the
    kernels' index math, masks, tiles, online softmax, split-K and backward sums where no GPU
    is; the GPU machine runs the real thing (test_kernel_parity)."""
    import shutil
    import subprocess
    if not shutil.which("g++") or not shutil.which("make"):
        pytest.skip("needs g++ (C++20) and make")
    subprocess.run(["make", "-s", "-j2"], cwd=ROOT, check=True, capture_output=True)
    r = subprocess.run([str(ROOT / "csrc/tests/cuda_emu/run.sh")], cwd=ROOT, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    for e in ("positions", "kv_cache_write", "attention_workspace", "attention_forward", "attention_backward"):
        assert len(re.findall(rf"^(\(reverse order\) )?cudaemu {e}: ok ", r.stdout, re.M)) == 2, r.stdout
