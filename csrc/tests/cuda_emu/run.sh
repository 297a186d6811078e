#!/bin/bash
# Runs the CUDA attention entries (csrc/kernels/cuda/attention*.cu) through the kernel parity
# harness on the host, without a GPU: transform.py rewrites the .cu files for cuda_emu.h (one
# ucontext fiber per CUDA thread, cooperative __syncthreads and warp shuffles, shared memory
# filled with NaN at each block, one block at a time), driver.cc puts the emulated entries in
# a copy of the CPU table named "cudaemu".  It checks the index math, masks, tiling, the
# online softmax, split-K and the backward's reductions; not timing, races the fiber order
# hides (run with EMU_REVERSE=1 too), or anything of the real hardware.
# Usage: csrc/tests/cuda_emu/run.sh [entry...]   (after `make`; SANITIZE=1 adds ASan/UBSan)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
E=$ROOT/csrc/tests/cuda_emu
OUT=$(mktemp -d /tmp/tpcore_cuda_emu.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
SAN=""
[ "${SANITIZE:-0}" = 1 ] && SAN="-fsanitize=address,undefined"
BLAS=$(make -s -C "$ROOT" -f Makefile --eval 'print-libs: ; @echo $(LIBS)' print-libs 2>/dev/null || echo "-lopenblas -lpthread -lrt -lm")
cp "$E/cuda_emu.h" "$OUT/"
for f in attention attention_bwd; do python3 "$E/transform.py" "$ROOT/csrc/kernels/cuda/$f.cu" "$OUT/$f.emu.cc"; done
python3 "$E/transform.py" "$ROOT/csrc/kernels/cuda/attention_common.cuh" "$OUT/attention_common.emu.h"
FL="-std=c++20 -O1 -g $SAN -I$OUT -I$ROOT/csrc/include -I$ROOT/csrc -I$ROOT/csrc/kernels/cuda -w"
for f in "$OUT/attention.emu.cc" "$OUT/attention_bwd.emu.cc" "$E/driver.cc" "$E/emu_runtime.cc"; do
  g++ $FL -c "$f" -o "$OUT/$(basename "$f" .cc).o"
done
for f in test_kernels test_kernels_api test_kernels_attn test_kernels_lowp test_kernels_nn; do
  gcc -std=c11 -O1 -g $SAN -D_GNU_SOURCE -I"$ROOT/csrc/include" -Dtp_kernels_of=emu_kernels_of \
    -c "$ROOT/csrc/tests/$f.c" -o "$OUT/$f.o"
done
g++ $SAN -o "$OUT/emu_test" "$OUT"/*.o "$ROOT/build/libtpcore.a" $BLAS
entries=("$@")
[ ${#entries[@]} -eq 0 ] && entries=(positions kv_cache_write attention_workspace attention_forward attention_backward)
fail=0
for e in "${entries[@]}"; do
  for rev in "" 1; do
    line=$(EMU_REVERSE=$rev ASAN_OPTIONS=detect_stack_use_after_return=0 "$OUT/emu_test" "$e" 2>&1 | grep -v '^entries\|^covered\|^device\|WARNING: ASan' || true)
    echo "${rev:+(reverse order) }$line" | head -12
    grep -q "^cudaemu $e: ok" <<<"$line" || fail=1
  done
done
exit $fail
