#!/usr/bin/env bash
# Everything GPU-side of tpcore in one go, on a machine with one NVIDIA GPU, Python 3.12, PyTorch,
# CuPy, nvcc and no internet, in under 7 minutes on an H200; the summary table comes LAST.
#
#   scripts/prepare_gpu_wheels.sh          # here, once: .whl/ (build wheels) and .nccl230/ (NCCL 2.30.7)
#   scripts/gpu_check.sh                   # there, from the repository root (the device tool:
#                                          # carry [".whl", ".nccl230"])
#
# Steps, each time-boxed (`timeout`), so one hang cannot eat the budget:
#   env     date, card, driver, versions; NCCL library (TPCORE_NCCL_LIBRARY, else .nccl230/)
#   wheels  pip install the carried .whl/*.whl into a private folder on PYTHONPATH
#   build   tpcore from source without build isolation (setup.py build_ext --inplace,
#           TPCORE_CUDA_ARCHS=90: _C and the CUDA plugin python/tpcore/.libs/libtpcore_cuda.so)
#           and, at the same time, the C core and the kernel parity harness (make
#           BUILD=build-gpucheck; GPU_CHECK_MAKE_CUDA=1: make CUDA=1, its own plugin as well)
#   parity  build-gpucheck/test_kernels with TPCORE_CUDA_PLUGIN at that plugin: every kernel
#           table, CUDA's included, against the references; its quant_* cases (quantized weights:
#           GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K and int8 rows through the lp entries, the decode GEMV
#           and the prefill panel GEMM, against a host dequantizer equal to gguf's and a float64
#           GEMM) make the "quant" row
#   tests   pytest tests/devices/test_gpu.py: layers and blocks on device="cuda" at world 1 and 2
#           (host-staged shm and NCCL), NCCL collectives at world 1 and 2 on the one GPU
#           (all_to_all with uneven counts among them: grouped ncclSend / ncclRecv),
#           DLPack round trips with torch and CuPy, error cases
#   bench   python -m tpcore.bench gpu: GEMM TFLOP/s vs torch.matmul, decode tok/s and TTFT vs
#           Hugging Face generate, per-rank GPU memory
#
# Without a GPU the tests run the same parity cases of every CUDA entry on a host emulator
# (csrc/tests/cuda_emu, under ASan+UBSan): the kernels' logic.  This script is the one that runs them
# on the hardware: nvcc's code, cuBLAS, NCCL, the device memory paths, timing.
#
# It fails soft: a step that cannot run (no GPU, no library, out of time) becomes a "not run: <why>"
# row and the summary is still printed.  Exit status: 0 every row ran and passed; 1 something failed
# or timed out; 3 nothing failed but some row did not run (e.g. no GPU).
#
# Environment: OUT (a folder: logs, the summary, the benchmark's JSON and pytest's JUnit XML go
# there; 4 files), GPU_CHECK_SITE (where the carried wheels are installed, default
# $TMPDIR/tpcore_gpu_check_site), GPU_CHECK_BUDGET_S (total seconds, default 400), GPU_CHECK_ONLY (a
# comma list of the steps above to run, the others are "not run: not selected"), PYTHON (default
# python3), GPU_CHECK_BENCH_ARGS (extra arguments of the benchmark).
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-400}
ONLY=${GPU_CHECK_ONLY:-}
PY=${PYTHON:-python3}
JOBS=$(nproc 2>/dev/null || echo 4)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
HBUILD=build-gpucheck   # make's build folder (setup.py's build/ is separate: both run at once)
export PYTHONUNBUFFERED=1 GPU_CHECK_RUNNING=1

declare -A ROW=()
ORDER=()
FAILED=0
NOTRUN=0

say() { printf '[gpu_check %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
# row KEY TEXT: one line of the summary (the last value of a key wins, the first order stays)
row() {
  local key=$1; shift
  [[ -v "ROW[$key]" ]] || ORDER+=("$key")
  ROW[$key]="$*"
}
selected() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
tail_of() { [ -f "$1" ] && tail -n "${2:-3}" "$1" | tr -s '\n\t' '  ' | cut -c1-160; }

# limit_for MAX: seconds a step may take (MAX, or what is left of the budget minus 20 s for the
# summary); 0 when less than 10 s would be left
limit_for() {
  local rem=$(( $(left) - 20 )) t=$1
  (( rem < t )) && t=$rem
  (( t < 10 )) && t=0
  echo "$t"
}

# run_step NAME MAX_S CMD...: runs CMD under timeout, output to $WORK/NAME.log; RC is its status
# (124: timed out; 125: not started, no time left)
run_step() {
  local name=$1 max=$2 t s
  shift 2
  t=$(limit_for "$max")
  if [ "$t" = 0 ]; then
    echo "not run: the time budget (${BUDGET}s) was spent" > "$WORK/$name.log"
    say "$name: not run (time budget spent)"
    RC=125
    return
  fi
  s=$(date +%s)
  say "$name: start (limit ${t}s)"
  timeout -k 10 "$t" "$@" > "$WORK/$name.log" 2>&1
  RC=$?
  echo "$(( $(date +%s) - s ))" > "$WORK/$name.secs"
  say "$name: exit status $RC after $(( $(date +%s) - s ))s$([ $RC = 124 ] || [ $RC = 137 ] && echo ' (TIMED OUT)')"
}
timed_out() { [ "$1" = 124 ] || [ "$1" = 137 ]; }

# ------------------------------------------------------------------------------------------- env
CARD="unknown"
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
if command -v nvidia-smi >/dev/null 2>&1; then
  CARD=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2 |
         tr '\n' ';' | sed 's/;$//')
  [ -n "$CARD" ] || CARD="nvidia-smi printed nothing"
else
  CARD="no GPU: nvidia-smi not found"
fi
row date "$DATE"
row card "$CARD"
say "card: $CARD"
if selected env; then
  {
    echo "date: $DATE"; echo "card: $CARD"; uname -a
    timeout 30 nvidia-smi 2>&1 | head -20
    command -v nvcc >/dev/null && nvcc --version | tail -2
    timeout 60 "$PY" - <<'EOF' 2>&1
import importlib, sys
print("python", sys.version.split()[0])
for m in ("numpy", "torch", "cupy", "transformers", "pytest", "setuptools"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:  # noqa: BLE001 - any import failure is reported as broken
        print(m, "missing" if isinstance(e, ImportError) else f"broken ({type(e).__name__}: {e})")
EOF
  } > "$WORK/env.log" 2>&1
  row versions "$(grep -E '^(python|torch|cupy|transformers) ' "$WORK/env.log" | tr '\n' ',' | sed 's/,$//; s/,/, /g')"
fi

# NCCL for two ranks on the one GPU: 2.30+ (../shared/device/README.md)
if [ -z "${TPCORE_NCCL_LIBRARY:-}" ]; then
  if [ -f "$ROOT/.nccl230/libnccl.so.2" ]; then
    export TPCORE_NCCL_LIBRARY="$ROOT/.nccl230/libnccl.so.2"
  elif [ -f "$ROOT/shared/device/libnccl.so.2.30.7-sm90.gz" ]; then
    mkdir -p "$WORK/nccl230" && gunzip -c "$ROOT/shared/device/libnccl.so.2.30.7-sm90.gz" > "$WORK/nccl230/libnccl.so.2" &&
      export TPCORE_NCCL_LIBRARY="$WORK/nccl230/libnccl.so.2"
  fi
fi
export NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=${NCCL_MAX_CTAS:-4}
if [ -n "${TPCORE_NCCL_LIBRARY:-}" ]; then
  NCCL_VER=$(timeout 30 "$PY" -c "
import ctypes, sys
v = ctypes.c_int(0)
ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v))
print(v.value)" "$TPCORE_NCCL_LIBRARY" 2>&1 | tail -1)
  row nccl_lib "${TPCORE_NCCL_LIBRARY#$ROOT/} (ncclGetVersion $NCCL_VER)"
else
  row nccl_lib "none given: no TPCORE_NCCL_LIBRARY, no .nccl230/ (run scripts/prepare_gpu_wheels.sh and carry .nccl230); NCCL is searched for by tpcore"
fi

# ---------------------------------------------------------------------------------------- wheels
# A fixed folder, not $WORK: the harness make links keeps it as the rpath of the BLAS, and a
# later run may find that binary up to date
SITE=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/tpcore_gpu_check_site}
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
if selected wheels; then
  if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    run_step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$ROOT"/.whl/*.whl
    if [ "$RC" = 0 ]; then
      export PYTHONPATH="$SITE:$PYTHONPATH"
      row wheels "installed $(ls "$ROOT"/.whl/*.whl | wc -l) carried wheel(s): $(cd "$ROOT/.whl" && ls *.whl | sed 's/-py3.*//; s/-cp3.*//' | tr '\n' ' ')"
    else
      row wheels "FAIL: pip install of .whl/*.whl (exit $RC): $(tail_of "$WORK/wheels.log" 2)"
    fi
  else
    row wheels "no .whl/ folder carried: the image's packages are used"
  fi
fi

# ----------------------------------------------------------------------------------------- build
BUILD_OK=0
if selected build; then
  t=$(limit_for 300)
  MAKE_PID=""
  if [ "$t" != 0 ]; then
    say "make (the parity harness): start in the background (limit ${t}s)"
    # The harness is C only; it loads the plugin named by TPCORE_CUDA_PLUGIN (the one setup.py
    # builds, below), so nvcc compiles the kernels once.  GPU_CHECK_MAKE_CUDA=1: make builds its
    # own plugin too (make CUDA=1), beside the harness.
    MAKE_ARGS=("$HBUILD/test_kernels")
    if [ "${GPU_CHECK_MAKE_CUDA:-0}" = 1 ]; then
      MAKE_ARGS=(CUDA=1 CUDA_ARCHS="${CUDA_ARCHS:-90}" "$HBUILD/test_kernels" "$HBUILD/libtpcore_cuda.so")
    fi
    rm -f "$HBUILD/test_kernels"  # relinked every run: its rpath names this run's BLAS folder
    ( timeout -k 10 "$t" make -j"$JOBS" BUILD="$HBUILD" "${MAKE_ARGS[@]}" \
        > "$WORK/make.log" 2>&1; echo $? > "$WORK/make.rc" ) &
    MAKE_PID=$!
  fi
  TPCORE_CUDA_ARCHS=${TPCORE_CUDA_ARCHS:-90} run_step build 300 "$PY" setup.py -q build_ext --inplace
  if [ "$RC" = 0 ]; then
    timeout 60 "$PY" -c "
import tpcore
info = tpcore.build_info()
avail = getattr(tpcore, 'cuda_available', None)
print('cuda_available:', avail() if avail else 'no tpcore.cuda_available in this build')
print('cuda:', info.get('cuda', 'no cuda key in build_info'))" > "$WORK/import.log" 2>&1
    if [ $? = 0 ]; then
      BUILD_OK=1
      row build "ok in $(cat "$WORK/build.secs")s; $(tr '\n' ';' < "$WORK/import.log" | sed 's/;$//; s/;/; /g' | cut -c1-220)"
    else
      row build "FAIL: import tpcore after the build: $(tail_of "$WORK/import.log" 2)"
    fi
  elif timed_out "$RC"; then
    row build "TIMED OUT: setup.py build_ext --inplace: $(tail_of "$WORK/build.log" 2)"
  elif [ "$RC" = 125 ]; then
    row build "not run: the time budget was spent"
  else
    row build "FAIL: setup.py build_ext --inplace (exit $RC): $(tail_of "$WORK/build.log" 3)"
  fi
  [ -n "$MAKE_PID" ] && wait "$MAKE_PID"
  say "make (the parity harness): exit status $(cat "$WORK/make.rc" 2>/dev/null || echo '?')"
fi

# ---------------------------------------------------------------------------------------- parity
HARNESS="$ROOT/$HBUILD/test_kernels"
# The plugin the harness loads: make's (GPU_CHECK_MAKE_CUDA=1), else setup.py's
PLUGIN=$(find "$ROOT/$HBUILD" -name 'libtpcore_cuda*.so' 2>/dev/null | head -1)
[ -z "$PLUGIN" ] && [ -f "$ROOT/python/tpcore/.libs/libtpcore_cuda.so" ] && PLUGIN="$ROOT/python/tpcore/.libs/libtpcore_cuda.so"
[ -n "${TPCORE_CUDA_PLUGIN:-}" ] && PLUGIN=$TPCORE_CUDA_PLUGIN
if ! selected parity; then
  :
elif selected build && [ ! -f "$WORK/make.rc" ]; then
  row parity "not run: make (the harness) was not started (time budget spent)"
elif selected build && [ "$(cat "$WORK/make.rc")" != 0 ]; then
  mrc=$(cat "$WORK/make.rc")
  if timed_out "$mrc"; then
    row parity "TIMED OUT: make (the harness): $(tail_of "$WORK/make.log" 2)"
  else
    row parity "FAIL: make (the harness, exit $mrc): $(tail_of "$WORK/make.log" 3)"
  fi
elif [ ! -x "$HARNESS" ]; then
  row parity "not run: no $HBUILD/test_kernels (the build step did not run)"
else
  if [ -n "$PLUGIN" ]; then
    run_step parity 150 env TPCORE_CUDA_PLUGIN="$PLUGIN" "$HARNESS"
  else
    run_step parity 150 "$HARNESS"
  fi
  L="$WORK/parity.log"
  entries=$(grep -m1 '^entries:' "$L" | wc -w)
  entries=$(( entries > 0 ? entries - 1 : 0 ))
  # the entries' own cases (the quant_* extra cases make their own row, below)
  cuda_ok=$(grep -E '^cuda[^ ]* [a-z0-9_]+: ok' "$L" | grep -vc '^cuda[^ ]* quant_')
  cuda_fail=$(grep -E '^cuda[^ ]* [a-z0-9_]+: FAIL' "$L" | grep -vc '^cuda[^ ]* quant_')
  q_ok=$(grep -cE '^cuda[^ ]* quant_[a-z0-9_]+: ok' "$L")
  q_fail=$(grep -cE '^cuda[^ ]* quant_[a-z0-9_]+: FAIL' "$L")
  cpu_fail=$(grep -cE '^cpu [a-z0-9_]+: FAIL' "$L")
  total=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$L" | tail -1)
  if [ "$RC" = 125 ]; then
    row parity "not run: the time budget was spent"
  elif timed_out "$RC"; then
    row parity "TIMED OUT after $cuda_ok CUDA entries ok, $cuda_fail failed: $(tail_of "$L" 1)"
  elif (( cuda_ok + cuda_fail == 0 )) && [ "$RC" != 0 ]; then
    row parity "FAIL: the harness exited with status $RC before any CUDA entry: $(tail_of "$L" 2)"
  elif (( cuda_ok + cuda_fail == 0 )); then
    why=$(grep -m1 -E '^(device cuda|cuda plugin)' "$L" | cut -c1-160)
    row parity "not run: no CUDA kernel table in the harness (${why:-$(tail_of "$L" 1)}); CPU table: ${total:-no total}"
  elif (( cuda_fail == 0 && cpu_fail == 0 )) && [ "$RC" = 0 ]; then
    row parity "ok: $cuda_ok/$entries CUDA entries pass against the references; all: $total"
  elif (( cuda_fail == 0 && cpu_fail == 0 && q_fail > 0 )); then
    row parity "FAIL: exit $RC: the entries' own cases pass ($cuda_ok/$entries CUDA entries), $q_fail quant_* case(s) fail (the quant row); $total"
  else
    names=$(grep -E '^cuda[^ ]* [a-z0-9_]+: FAIL' "$L" | grep -v '^cuda[^ ]* quant_' | awk '{print $2}' | tr -d ':' |
            head -8 | tr '\n' ' ')
    row parity "FAIL: $cuda_fail of $entries CUDA entries fail (${names}), $cuda_ok ok; cpu failures $cpu_fail; exit $RC; $total"
  fi
  if [ "$RC" = 125 ]; then
    row quant "not run: the time budget was spent"
  elif (( q_ok + q_fail == 0 )); then
    row quant "not run: no quant_* case of the CUDA table in the harness's log$(timed_out "$RC" && echo ' (TIMED OUT before them)')"
  elif (( q_fail == 0 )); then
    row quant "ok: $q_ok quantized-weight cases (q8_0 q4_0 q4_1 q4_k q5_k q6_k int8: GEMV M<=8, panel GEMM, dx, embedding) vs host dequant + float64"
  else
    qn=$(grep -E '^cuda[^ ]* quant_[a-z0-9_]+: FAIL' "$L" | awk '{print $2}' | tr -d ':' | tr '\n' ' ')
    qwhy=$(grep -B3 -E '^cuda[^ ]* quant_[a-z0-9_]+: FAIL' "$L" | grep '^    ' | head -1 | cut -c5-140)
    row quant "FAIL: $q_fail quantized-weight case(s) fail ($qn), $q_ok ok; first: $qwhy"
  fi
fi

# ----------------------------------------------------------------------------------------- tests
# The GPU cases of the other test files (each skips without CUDA; here they run).
GPU_TEST_FILES="tests/devices/test_device_layers.py tests/devices/test_device_arrays.py tests/utils/test_dlpack.py tests/launch/test_launch_gpus.py tests/devices/test_cuda_build.py tests/devices/test_nccl.py"
[ -f tests/devices/test_device_comm.py ] && GPU_TEST_FILES="$GPU_TEST_FILES tests/devices/test_device_comm.py"
if selected tests; then
  if selected build && [ "$BUILD_OK" != 1 ]; then
    row tests "not run: the build failed"
  else
    PT_TIMEOUT=()  # one hanging test must not take the step's whole time
    timeout 30 "$PY" -c "import pytest_timeout" 2>/dev/null && PT_TIMEOUT=(-p pytest_timeout --timeout=170)
    run_step tests 240 env TPCORE_TEST_KERNELS_BIN="$HARNESS" TPCORE_TEST_CUDA_PLUGIN="$PLUGIN" "$PY" -m pytest -q -p no:cacheprovider -rfEs \
      "${PT_TIMEOUT[@]}" \
      -o junit_family=xunit1 --junitxml="$WORK/junit.xml" tests/devices/test_gpu.py $GPU_TEST_FILES
    echo "$RC" > "$WORK/tests.rc"
  fi
fi

# ----------------------------------------------------------------------------------------- bench
if selected bench; then
  if selected build && [ "$BUILD_OK" != 1 ]; then
    row bench "not run: the build failed"
  else
    # shellcheck disable=SC2086
    bt=$(limit_for 180)  # the benchmark skips (and says so) what would not fit in its step
    run_step bench 180 "$PY" -m tpcore.bench gpu --json "$WORK/gpu_bench.json" --budget $(( bt > 30 ? bt - 15 : 15 )) \
      ${GPU_CHECK_BENCH_ARGS:-}
    echo "$RC" > "$WORK/bench.rc"
  fi
fi

# --------------------------------------------------------------------------------------- summary
# The rows of the tests (from pytest's JUnit XML, grouped by test name) and of the benchmark (from
# its JSON), as KEY<TAB>TEXT lines.
timeout 60 "$PY" - "$WORK" "$ONLY" > "$WORK/rows.tsv" 2> "$WORK/summary_py.log" <<'EOF'
import json, os, re, sys
import xml.etree.ElementTree as ET

work, only = sys.argv[1], sys.argv[2]
sel = lambda s: not only or s in only.split(",")  # noqa: E731 (a one-line local helper)


def out(key, text):
    print(f"{key}\t{' '.join(str(text).split())}")


def rc_of(name):
    try:
        return int(open(os.path.join(work, name + ".rc")).read().strip())
    except (OSError, ValueError):
        return None


def tail(name, n=2):
    try:
        lines = [l.strip() for l in open(os.path.join(work, name + ".log"), errors="replace") if l.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[:200]


# ---- tests
GROUPS = [("tests", "all GPU tests (test_gpu.py and the GPU cases of the others)", None),
          ("parity_py", "kernel parity through pytest", "parity"),
          ("layers_w1", "layers/blocks on cuda, world 1", "layers_w1"),
          ("nccl_w1", "NCCL world 1", "nccl_w1"),
          ("nccl_w2", "NCCL world 2 (two ranks on one GPU)", "nccl_w2"),
          ("staged_w2", "host-staged shm world 2", "staged_w2"),
          ("dlpack", "DLPack round trips", "dlpack"),
          ("errors", "error cases", "errors")]
if sel("tests"):
    rc = rc_of("tests")
    path = os.path.join(work, "junit.xml")
    if rc is None:
        pass  # the bash side wrote the row
    elif not os.path.exists(path):
        what = "TIMED OUT" if rc in (124, 137) else ("not run: time budget spent" if rc == 125 else f"FAIL (exit {rc})")
        for key, _, _ in GROUPS:
            out(key, f"{what}: no JUnit report; {tail('tests')}")
    else:
        cases = []
        for tc in ET.parse(path).getroot().iter("testcase"):
            name = tc.get("name", "")
            state, why = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = tc.find(tag)
                if el is not None:
                    state = "skipped" if tag == "skipped" else "failed"
                    why = (el.get("message") or "").strip()
                    break
            cases.append((name, state, why))
        for key, label, pat in GROUPS:
            sub = [c for c in cases if pat is None or pat in c[0]]
            if not sub:
                out(key, "not run: no test of this group in tests/devices/test_gpu.py")
                continue
            n = {s: sum(1 for c in sub if c[1] == s) for s in ("passed", "failed", "skipped")}
            text = f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped"
            if n["failed"]:
                first = next(c for c in sub if c[1] == "failed")
                text = f"FAIL: {text}; first: {first[0]}: {first[2][:140]}"
            elif n["passed"] == 0:
                reasons = sorted({re.sub(r"^Skipped: ", "", c[2]) for c in sub if c[1] == "skipped"})
                text = f"not run: {text} ({'; '.join(reasons)[:200]})"
            if key == "tests" and rc in (124, 137):
                text = f"TIMED OUT: {text}"
            out(key, text)

# ---- bench
if sel("bench"):
    rc = rc_of("bench")
    path = os.path.join(work, "gpu_bench.json")
    data = None
    if os.path.exists(path):
        try:
            data = json.load(open(path))
        except ValueError as e:
            data = None
            out("gemm", f"FAIL: unreadable benchmark JSON: {e}")
    if data is None and rc is not None:
        what = "TIMED OUT" if rc in (124, 137) else ("not run: time budget spent" if rc == 125 else f"FAIL (exit {rc})")
        for key in ("gemm", "decode_gpt2", "decode_llama", "memory"):
            out(key, f"{what}: {tail('bench')}")
    elif data is not None:
        if data.get("skipped"):
            for key in ("gemm", "decode_gpt2", "decode_llama", "memory"):
                out(key, f"not run: {data['skipped']}")
        else:
            g = data.get("gemm") or {}
            rows = g.get("rows") or []
            if g.get("skipped"):
                out("gemm", f"not run: {g['skipped']}")
            elif not rows:
                out("gemm", "not run: no GEMM rows in the benchmark's JSON")
            else:
                parts = []
                for r in rows:
                    shp = f"{r['M']}x{r['K']}x{r['N']} {r['dtype']}"
                    if r.get("tpcore_tflops") is None:
                        parts.append(f"{shp}: n/a ({re.sub(r'^n/a: ', '', r.get('note', ''))[:70]})")
                    else:
                        tt = r.get("torch_tflops")
                        pct = f" = {100 * r['tpcore_tflops'] / tt:.0f}%" if tt else ""
                        parts.append(f"{shp}: {r['tpcore_tflops']:.1f} vs torch {tt if tt is None else round(tt, 1)}"
                                     f" TFLOP/s{pct}" + ("" if r.get("ok", True) else " WRONG RESULT"))
                out("gemm", "; ".join(parts))
            for key, name in (("decode_gpt2", "gpt2-small"), ("decode_llama", "llama-1b")):
                m = (data.get("decode") or {}).get(name)
                if not m:
                    out(key, "not run: no such model in the benchmark's JSON")
                    continue
                t, h = m.get("tpcore") or {}, m.get("hf") or {}

                def fmt(d, who):
                    if d.get("skipped"):
                        return f"{who} n/a ({d['skipped'][:90]})"
                    rate = "n/a" if d.get("decode_tok_s") is None else f"{d['decode_tok_s']:.1f}"
                    return f"{who} {rate} tok/s, TTFT {d['ttft_ms']:.1f} ms ({d.get('dtype', '?')})"
                text = fmt(t, "tpcore") + "; " + fmt(h, "HF generate")
                if not t.get("skipped") and not h.get("skipped") and t.get("decode_tok_s") and h.get("decode_tok_s"):
                    text += (f"; decode {t['decode_tok_s'] / h['decode_tok_s']:.2f}x, "
                             f"TTFT {h['ttft_ms'] / t['ttft_ms']:.2f}x of HF")
                out(key, text)
            mem = data.get("memory") or []
            out("memory", "; ".join(f"{m['what']}: {m['text']}" for m in mem) or "not run: no memory rows")

sys.exit(0)
EOF
while IFS=$'\t' read -r key text; do
  [ -n "$key" ] && row "$key" "$text"
done < "$WORK/rows.tsv"
if [ ! -s "$WORK/rows.tsv" ] && { [ -f "$WORK/tests.rc" ] || [ -f "$WORK/bench.rc" ]; }; then
  row summary "the summary's Python part printed nothing: $(tail_of "$WORK/summary_py.log" 2)"
fi

# Rows that no step filled say why.
declare -A LABEL=(
  [date]="date" [card]="card" [versions]="versions" [nccl_lib]="NCCL library" [wheels]="carried wheels"
  [build]="build (tpcore + CUDA plugin)" [parity]="kernel parity, C harness (CUDA table)"
  [quant]="  quantized weights (GGUF, int8) on CUDA"
  [tests]="GPU tests (tests/devices/test_gpu.py)" [parity_py]="  kernel parity via pytest"
  [layers_w1]="  layers/blocks cuda, world 1" [nccl_w1]="  NCCL world 1" [nccl_w2]="  NCCL world 2, one GPU"
  [staged_w2]="  host-staged shm, world 2" [dlpack]="  DLPack round trips (torch, CuPy)" [errors]="  error cases"
  [gemm]="GEMM column-parallel vs torch.matmul" [decode_gpt2]="decode GPT-2-small (124M) vs HF"
  [decode_llama]="decode Llama-1B-sized vs HF" [memory]="GPU memory per rank" [summary]="summary")
declare -A STEP_OF=([versions]=env [wheels]=wheels [build]=build [parity]=parity [quant]=parity [tests]=tests [parity_py]=tests
         [layers_w1]=tests [nccl_w1]=tests [nccl_w2]=tests [staged_w2]=tests [dlpack]=tests [errors]=tests
         [gemm]=bench [decode_gpt2]=bench [decode_llama]=bench [memory]=bench)
for key in versions wheels build parity quant tests parity_py layers_w1 nccl_w1 nccl_w2 staged_w2 dlpack errors \
           gemm decode_gpt2 decode_llama memory; do
  if [[ ! -v "ROW[$key]" ]]; then
    st=${STEP_OF[$key]:-}
    if [ -n "$st" ] && ! selected "$st"; then
      row "$key" "not run: not selected (GPU_CHECK_ONLY=$ONLY)"
    elif [ -n "$st" ] && [[ -v "ROW[$st]" ]] && [[ "${ROW[$st]}" == not\ run* ]]; then
      row "$key" "${ROW[$st]}"  # the step's own reason (e.g. the build failed)
    else
      row "$key" "not run: its step did not report"
    fi
  fi
done
KEYS=(date card versions nccl_lib wheels build parity quant tests parity_py layers_w1 nccl_w1 nccl_w2 staged_w2 dlpack
      errors gemm decode_gpt2 decode_llama memory summary)
for key in "${KEYS[@]}"; do
  [[ -v "ROW[$key]" ]] || continue
  case "${ROW[$key]}" in
    FAIL*|TIMED\ OUT*|*WRONG\ RESULT*) FAILED=1 ;;
    not\ run*) case "$key" in wheels|nccl_lib) ;; *) NOTRUN=1 ;; esac ;;
  esac
done

{
  echo
  echo "==================== tpcore GPU check: summary ($(( $(date +%s) - T0 ))s of ${BUDGET}s) ===================="
  for key in "${KEYS[@]}"; do
    [[ -v "ROW[$key]" ]] || continue
    printf '%-40s | %s\n' "${LABEL[$key]:-$key}" "${ROW[$key]}"
  done
  if [ "$FAILED" = 1 ]; then verdict="FAILURES (exit 1)"
  elif [ "$NOTRUN" = 1 ]; then verdict="no failures, but some checks did not run (exit 3)"
  else verdict="all checks ran and passed (exit 0)"; fi
  printf '%-40s | %s\n' "verdict" "$verdict"
} > "$WORK/summary.txt"

if [ -n "${OUT:-}" ] && mkdir -p "$OUT" 2>/dev/null; then
  {
    for f in env wheels build import make parity tests bench summary_py; do
      [ -f "$WORK/$f.log" ] || continue
      echo "======================================== $f.log"
      cat "$WORK/$f.log"
    done
  } > "$OUT/gpu_check.log" 2>&1
  for f in gpu_bench.json junit.xml summary.txt; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/$f"
  done
  say "logs in $OUT: gpu_check.log, summary.txt$([ -f "$WORK/gpu_bench.json" ] && echo ', gpu_bench.json')$([ -f "$WORK/junit.xml" ] && echo ', junit.xml')"
else
  say "logs in $WORK (set OUT to collect them)"
fi
# The benchmark's own tables, then the summary, last.
if [ -f "$WORK/bench.log" ]; then
  echo
  echo "-------------------- python -m tpcore.bench gpu (last 40 lines)"
  tail -n 40 "$WORK/bench.log"
fi
if [ -f "$WORK/tests.log" ]; then
  echo
  echo "-------------------- pytest tests/devices/test_gpu.py (last 15 lines)"
  tail -n 15 "$WORK/tests.log"
fi
cat "$WORK/summary.txt"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then rm -rf "$WORK"; fi
if [ "$FAILED" = 1 ]; then exit 1; elif [ "$NOTRUN" = 1 ]; then exit 3; else exit 0; fi
