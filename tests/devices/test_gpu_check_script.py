"""scripts/gpu_check.sh without a GPU: valid bash, its summary printed with a "not run" row
for each step that did not run, and the summary read from made-up reports (a stand-in for python3
writes them).  The GPU tests it runs: test_gpu.py."""
import os
import re
import subprocess

import pytest


from c_binaries import ROOT


@pytest.mark.slow  # runs gpu_check.sh; test_gpu_check_summary_reads_the_reports checks its summary
def test_gpu_check_script_prints_its_summary_without_a_gpu(tmp_path):
    """bash -n, then one fast run (only the env step): every row of the summary is there and the
    rows that did not run say why; this is what a machine without a GPU sees."""
    if os.environ.get("GPU_CHECK_RUNNING"):
        pytest.skip("running inside scripts/gpu_check.sh")
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = {**os.environ, "GPU_CHECK_ONLY": "env", "OUT": str(tmp_path / "out"), "TPCORE_NCCL_LIBRARY": ""}
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=str(ROOT))
    out = r.stdout
    tail = out[out.index("tpcore GPU check: summary"):]
    for label in ("card", "build (tpcore + CUDA plugin)", "kernel parity, C harness", "quantized weights", "GPU tests",
                  "NCCL world 1", "NCCL world 2", "host-staged shm", "DLPack round trips",
                  "GEMM column-parallel vs torch.matmul", "decode GPT-2-small", "decode Llama-1B-sized",
                  "GPU memory per rank", "verdict"):
        assert re.search(rf"^\s*{re.escape(label)}.*\|", tail, re.M), f"no {label!r} row:\n{tail}"
    assert re.search(r"^GPU tests.*\| not run: not selected", tail, re.M), tail
    assert tail.rstrip().splitlines()[-1].startswith("verdict"), "the summary is not last"
    assert r.returncode == 3, (r.returncode, out[-2000:], r.stderr[-2000:])
    assert (tmp_path / "out" / "summary.txt").read_text().strip().splitlines()[-1].startswith("verdict")


FAKE_PY = r'''#!/usr/bin/env bash
# Stands in for python3 in gpu_check.sh: pytest and the benchmark write made-up reports, the
# rest goes to the real interpreter.
if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then
  for a in "$@"; do case "$a" in --junitxml=*) x=${a#--junitxml=} ;; esac; done
  cat > "$x" <<'XML'
<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu" name="test_parity_cuda_kernel_table"/>
<testcase classname="tests.test_gpu" name="test_layers_w1_linear[float32]"/>
<testcase classname="tests.test_gpu" name="test_collectives[nccl_w1-nccl-1]"/>
<testcase classname="tests.test_gpu" name="test_collectives[nccl_w2-nccl-2]">
<failure message="rank 1 broadcast: relative error 1e-2"/></testcase>
<testcase classname="tests.test_gpu" name="test_collectives[staged_w2-shm-2]"/>
<testcase classname="tests.test_gpu" name="test_dlpack_cupy_round_trip_no_copy">
<skipped message="CuPy is not installed"/></testcase>
<testcase classname="tests.test_gpu" name="test_errors_bad_dtype_and_strides"/>
</testsuite></testsuites>
XML
  echo "1 failed, 5 passed, 1 skipped"
  exit 1
fi
if [ "$1" = "-m" ] && [ "$2" = "tpcore.bench" ]; then
  for ((i = 1; i <= $#; i++)); do [ "${!i}" = "--json" ] && j=$((i + 1)) && x=${!j}; done
  cat > "$x" <<'JSON'
{"card": "Made-up GPU", "gemm": {"rows": [
  {"M": 64, "K": 32, "N": 16, "dtype": "float32", "tpcore_tflops": 1.5, "torch_tflops": 2.0, "ok": true},
  {"M": 64, "K": 32, "N": 16, "dtype": "bfloat16", "tpcore_tflops": null, "torch_tflops": 4.0,
   "note": "n/a: the layer does not take dtype=bfloat16"}]},
 "decode": {"gpt2-small": {"tpcore": {"dtype": "bfloat16", "ttft_ms": 5.0, "decode_tok_s": 300.0},
                           "hf": {"dtype": "bfloat16", "ttft_ms": 10.0, "decode_tok_s": 100.0}},
            "llama-1b": {"tpcore": {"skipped": "time budget"}, "hf": {"skipped": "transformers missing"}}},
 "memory": [{"what": "tpcore gpt2-small world 1 (bfloat16)", "text": "rank 0 123 MiB"}]}
JSON
  exit 0
fi
exec python3 "$@"
'''


def test_gpu_check_summary_reads_the_reports(tmp_path):
    """The summary's rows come from pytest's JUnit XML (per group) and the benchmark's JSON: fed
    made-up reports, it counts, names the first failure, computes the ratios and exits 1."""
    if os.environ.get("GPU_CHECK_RUNNING"):
        pytest.skip("running inside scripts/gpu_check.sh")
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    env = {**os.environ, "GPU_CHECK_ONLY": "tests,bench", "PYTHON": str(fake), "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                       timeout=120, env=env, cwd=str(ROOT))
    tail = r.stdout[r.stdout.index("tpcore GPU check: summary"):]
    rows = dict(re.findall(r"^\s*(.+?)\s+\| (.*)$", tail, re.M))
    assert rows["GPU tests (tests/devices/test_gpu.py)"].startswith("FAIL: 5 passed, 1 failed, 1 skipped"), rows
    assert "rank 1 broadcast" in rows["NCCL world 2, one GPU"], rows
    assert rows["NCCL world 1"] == "1 passed, 0 failed, 0 skipped", rows
    assert rows["host-staged shm, world 2"] == "1 passed, 0 failed, 0 skipped", rows
    assert rows["DLPack round trips (torch, CuPy)"].startswith("not run: 0 passed, 0 failed, 1 skipped (CuPy"), rows
    assert "1.5 vs torch 2.0 TFLOP/s = 75%" in rows["GEMM column-parallel vs torch.matmul"], rows
    assert "bfloat16: n/a" in rows["GEMM column-parallel vs torch.matmul"], rows
    assert "decode 3.00x, TTFT 2.00x of HF" in rows["decode GPT-2-small (124M) vs HF"], rows
    assert "tpcore n/a (time budget)" in rows["decode Llama-1B-sized vs HF"], rows
    assert rows["GPU memory per rank"] == "tpcore gpt2-small world 1 (bfloat16): rank 0 123 MiB", rows
    assert rows["verdict"] == "FAILURES (exit 1)" and r.returncode == 1, (r.returncode, tail)
