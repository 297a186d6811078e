"""Hostile arguments to every public entry of the tensor + stream C API
(csrc/tests/test_api_hostile.c), built with make and run without Python in the loop,
plain and under ASan + UBSan: the layers (linear column/row, MLP, embedding,
cross-entropy, block and its KV cache), every public kernel, the device table, the
shard split and the collectives get NULL tensors, NULL data, negative, huge and
overflowing shapes, ndim 0/3/9, wrong dtypes, strided and zero strides, CUDA and
out-of-range devices, mismatched shapes, backward before forward and batches that
grow and shrink.  Each call must fail with a sentence naming the operation and the
argument (zero-size calls succeed), and nothing may crash or trip a sanitizer."""
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
    args = ["make", "-s", "-C", str(ROOT), f"BUILD={build}", f"{build}/test_api_hostile"]
    if sanitize:
        args.insert(1, "SANITIZE=1")
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    # the binaries carry their own sanitizer runtime (or none): not the one the sanitized
    # suite preloads into Python; a hostile size must come back as an error, not abort
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:allocator_may_return_null=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    r = subprocess.run([str(build / "test_api_hostile")], capture_output=True, text=True, timeout=600, env=env)
    assert "ERROR: AddressSanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr
    return r


def check_output(r):
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "FAIL" not in out, out
    for part in ("devices", "partition", "kernels", "collectives", "cpu streams", "linear column", "linear row", "mlp", "vocab",
                 "block"):
        assert f"{part}: done" in out, out
    m = re.search(r"^(\d+) passed, 0 failed$", out, re.M)
    assert m and int(m.group(1)) >= 2000, out


def test_api_hostile(tmp_path):
    check_output(build_and_run(tmp_path, sanitize=False))


def test_api_hostile_under_asan_ubsan(tmp_path):
    check_output(build_and_run(tmp_path, sanitize=True))
