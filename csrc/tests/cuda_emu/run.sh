#!/bin/bash
# Runs the CUDA attention entries (csrc/cuda/kernels/attention*.cu) and the low-precision
# ones (lowp.cu, quant.cu: 16-bit and quantized weights) through the kernel parity harness on the host, without a GPU: transform.py
# rewrites the .cu files and the headers they include for cuda_emu.h (one ucontext fiber per
# CUDA thread, cooperative __syncthreads and warp shuffles, shared memory filled with NaN at
# each block, one block at a time), cublas_emu.cc stands in for cuBLAS (a host GemmEx that
# checks its arguments as cuBLAS does), driver.cc puts the emulated entries in a copy of the
# CPU table named "cudaemu".  It checks the index math, masks, tiling, the online softmax,
# split-K, the backward's reductions, the 16-bit conversions' bits and the GEMM arguments
# (transposes, leading dimensions, workspace layout), and for quantized weights (the
# harness's quant_<entry> cases, test_kernels_qlp.c) the dequantization's bits against a
# reference equal to gguf's, the decode GEMV's warp split, the panels of the prefill GEMM and
# of dx; not timing, races the fiber order hides (run with EMU_REVERSE=1 too), cuBLAS itself,
# or anything of the real hardware.
# Usage: csrc/tests/cuda_emu/run.sh [entry...]   (after `make`; SANITIZE=1 adds ASan/UBSan; BUILD=dir: the
# make build directory whose libtpcore.a to link, default build/)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
E=$ROOT/csrc/tests/cuda_emu
OUT=$(mktemp -d /tmp/tpcore_cuda_emu.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
SAN=""
[ "${SANITIZE:-0}" = 1 ] && SAN="-fsanitize=address,undefined"
BLAS=$(make -s -C "$ROOT" -f Makefile --eval 'print-libs: ; @echo $(LIBS)' print-libs 2>/dev/null || echo "-lopenblas -lpthread -lrt -lm")
cp "$E/cuda_emu.h" "$OUT/"
CU=(attention attention_bwd lowp quant)
for f in "${CU[@]}"; do python3 "$E/transform.py" "$ROOT/csrc/cuda/kernels/$f.cu" "$OUT/$f.emu.cc"; done
for f in attention_common common colsum lowp_bits quant; do
  python3 "$E/transform.py" "$ROOT/csrc/cuda/kernels/$f.cuh" "$OUT/$f.emu.h"
done
python3 "$E/transform.py" "$ROOT/csrc/cuda/kernels/cublas_api.h" "$OUT/cublas_api.emu.h"
FL="-std=c++20 -O1 -g $SAN -I$OUT -I$ROOT/csrc/include -I$ROOT/csrc -I$ROOT/csrc/cuda/kernels -w"
# the objects compile concurrently; each wait returns its compiler's status (set -e stops on a failure)
pids=()
for f in "${CU[@]/%/.emu.cc}"; do g++ $FL -c "$OUT/$f" -o "$OUT/${f%.cc}.o" & pids+=($!); done
for f in "$E/driver.cc" "$E/emu_runtime.cc" "$E/cublas_emu.cc"; do
  g++ $FL -c "$f" -o "$OUT/$(basename "$f" .cc).o" & pids+=($!)
done
for f in test_kernels test_kernels_api test_kernels_attn test_kernels_lowp test_kernels_nn test_kernels_qlp test_kernels_quant; do
  gcc -std=c11 -O1 -g $SAN -D_GNU_SOURCE -I"$ROOT/csrc/include" -Dtp_kernels_of=emu_kernels_of \
    -c "$ROOT/csrc/tests/$f.c" -o "$OUT/$f.o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
g++ $SAN -o "$OUT/emu_test" "$OUT"/*.o "${BUILD:-$ROOT/build}/libtpcore.a" $BLAS
entries=("$@")
[ ${#entries[@]} -eq 0 ] && entries=(positions kv_cache_write attention_workspace attention_forward attention_backward
  convert linear_lp_workspace linear_forward_lp linear_backward_lp embedding_forward_lp)
# each (entry, order) is its own process: run them EMU_JOBS at a time (default: one per core),
# then report in order
jobs=${EMU_JOBS:-$(nproc 2>/dev/null || echo 1)}
running=0
for e in "${entries[@]}"; do
  for rev in "" 1; do
    (EMU_REVERSE=$rev ASAN_OPTIONS=detect_stack_use_after_return=0 "$OUT/emu_test" "$e" >"$OUT/out.$e.${rev:-0}" 2>&1 || true) &
    running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then
      wait -n || true
      running=$((running - 1))
    fi
  done
done
wait
fail=0
for e in "${entries[@]}"; do
  for rev in "" 1; do
    line=$(grep -v '^entries\|^covered\|^device\|WARNING: ASan' "$OUT/out.$e.${rev:-0}" || true)
    echo "${rev:+(reverse order) }$line" | head -12
    grep -q "^cudaemu $e: ok" <<<"$line" || fail=1
    ! grep -q ": FAIL" <<<"$line" || fail=1 # the entry's extra cases (quant_<entry>) too
  done
done
exit $fail
