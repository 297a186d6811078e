"""Hostile arguments to every public entry of the tensor + stream C API
(csrc/tests/test_api_hostile.c), built with make and run without Python in the loop,
plain and under ASan + UBSan: the layers (linear column/row, MLP, embedding,
cross-entropy, block and its KV cache), every public kernel, the device table, the
shard split and the collectives get NULL tensors, NULL data, negative, huge and
overflowing shapes, ndim 0/3/9, wrong dtypes, strided and zero strides, CUDA and
out-of-range devices, mismatched shapes, backward before forward and batches that
grow and shrink.  Each call must fail with a sentence naming the operation and the
argument (zero-size calls succeed), and nothing may crash or trip a sanitizer."""
import re

import pytest

from c_binaries import build, run


def build_and_run(c_builds, sanitize):
    return run(build(c_builds, sanitize, "test_api_hostile") / "test_api_hostile")


def check_output(r):
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "FAIL" not in out, out
    for part in ("devices", "partition", "kernels", "collectives", "cpu streams", "linear column", "linear row", "mlp",
                 "vocab", "block"):
        assert f"{part}: done" in out, out
    m = re.search(r"^(\d+) passed, 0 failed$", out, re.M)
    assert m and int(m.group(1)) >= 2000, out


@pytest.mark.slow  # builds the C core; test_bad_arguments and test_boundaries reach the same checks
def test_api_hostile(c_builds):
    check_output(build_and_run(c_builds, sanitize=False))


@pytest.mark.sanitized
@pytest.mark.slow  # test_api_hostile runs the same binary plain
def test_api_hostile_under_asan_ubsan(c_builds):
    check_output(build_and_run(c_builds, sanitize=True))
