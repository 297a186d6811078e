#!/bin/bash
# Runs the CUDA kernel table (csrc/cuda/kernels: every entry of TP_KERNEL_ENTRIES, and the
# quantized-weight cases quant_<entry> of the low-precision ones) through the kernel parity
# harness on the host, without a GPU.  transform.py rewrites every .cu file and the headers
# they include for cuda_emu.h (one fiber per CUDA thread, cooperative __syncthreads and warp
# shuffles, shared memory poisoned at each block, one block at a time); cublas_emu.cc stands in
# for cuBLAS (host Sgemm / Sgemv / GemmEx that check their arguments as cuBLAS does) and so
# replaces cublas.cu; driver.cc hands the harness the CUDA table itself (table.c) as "cudaemu".
# It checks the index math, masks, tiling, grid-stride loops, block and warp reductions, the
# online softmax, split-K, the backward's reductions, the 16-bit conversions' bits, the GEMM
# arguments (transposes, leading dimensions, workspace layout), the quantized formats'
# dequantization bit for bit, the decode GEMV's warp split and the panel GEMMs; each entry in
# the forward and the reverse order of threads and of blocks (EMU_REVERSE=1), so a result
# that depends on the order of unsynchronized threads or of blocks shows.  Not timing, races
# the fiber schedule hides, cuBLAS itself, or anything of the real hardware:
# scripts/gpu_check.sh runs the same harness on a GPU.
# Usage: csrc/tests/cuda_emu/run.sh [entry...]   (default: every entry of the table)
#   after `make` (BUILD=dir: the make build directory whose libtpcore.a to link, default build/);
#   SANITIZE=1: every object under ASan + UBSan (link the core of `make SANITIZE=1`, build-san/),
#   a finding fails the entry; EMU_JOBS=N: N compilers / runs at a time (default: the cores);
#   EMU_OUT=dir: build and log there, and keep them (default: a temporary folder, removed).
# Prints whose functions fill the emulated table ("emu table: N entries, N of the CUDA table, 0 of
# the CPU table"), one line per entry and order, then "emu: N entries x 2 orders ok" or what failed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
E=$ROOT/csrc/tests/cuda_emu
KD=$ROOT/csrc/cuda/kernels
if [ -n "${EMU_OUT:-}" ]; then # keep the build and the logs there
  OUT=$EMU_OUT
  mkdir -p "$OUT"
else
  OUT=$(mktemp -d /tmp/tpcore_cuda_emu.XXXXXX)
  trap 'rm -rf "$OUT"' EXIT
fi
SAN=""
[ "${SANITIZE:-0}" = 1 ] && SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
BLAS=$(make -s -C "$ROOT" -f Makefile --eval 'print-libs: ; @echo $(LIBS)' print-libs 2>/dev/null || echo "-lopenblas -lpthread -lrt -lm")
jobs=${EMU_JOBS:-$(nproc 2>/dev/null || echo 1)}

# spawn CMD...: in the background, at most $jobs at a time; drain: wait for all.  A failure of
# any sets failed=1.
running=0
failed=0
spawn() {
  "$@" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n || failed=1
    running=$((running - 1))
  fi
}
drain() {
  while [ "$running" -gt 0 ]; do
    wait -n || failed=1
    running=$((running - 1))
  done
}

# every .cu file of the table but cublas.cu (cublas_emu.cc replaces it), every header
cp "$E/cuda_emu.h" "$OUT/"
CU=()
for f in "$KD"/*.cu; do
  b=$(basename "$f" .cu)
  [ "$b" = cublas ] || CU+=("$b")
done
for b in "${CU[@]}"; do python3 "$E/transform.py" "$KD/$b.cu" "$OUT/$b.emu.cc"; done
for f in "$KD"/*.cuh; do python3 "$E/transform.py" "$f" "$OUT/$(basename "$f" .cuh).emu.h"; done
python3 "$E/transform.py" "$KD/cublas_api.h" "$OUT/cublas_api.emu.h"
FL="-std=c++20 -O1 -g1 $SAN -I$OUT -I$ROOT/csrc/include -I$ROOT/csrc -I$KD -w"
# the harness (its references, its random inputs) and table.c: plain C at -O2, never sanitized (the
# kernels, the runtime and cuBLAS's stand-in are); the device memory it hands out still is ASan's
CFL="-std=c11 -O2 -g1 -D_GNU_SOURCE -I$ROOT/csrc/include -I$ROOT/csrc"
for b in "${CU[@]}"; do spawn g++ $FL -c "$OUT/$b.emu.cc" -o "$OUT/$b.o"; done
for f in "$E/driver.cc" "$E/emu_runtime.cc" "$E/cublas_emu.cc"; do
  spawn g++ $FL -c "$f" -o "$OUT/$(basename "$f" .cc).o"
done
spawn gcc $CFL -c "$KD/table.c" -o "$OUT/table.o"
for f in "$ROOT"/csrc/tests/test_kernels*.c; do
  spawn gcc $CFL -Dtp_kernels_of=emu_kernels_of -Dtp_device_alloc=emu_device_alloc -Dtp_device_free=emu_device_free -c "$f" -o "$OUT/$(basename "$f" .c).o"
done
drain
[ "$failed" = 0 ] || { echo "emu: a compile failed"; exit 1; }
g++ $SAN -o "$OUT/emu_test" "$OUT"/*.o "${BUILD:-$ROOT/build}/libtpcore.a" $BLAS

export ASAN_OPTIONS=detect_stack_use_after_return=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
# the table's entries as the harness lists them, and whose functions fill the emulated table
"$OUT/emu_test" no_such_entry >"$OUT/list" 2>&1 || true
table=$(sed -n 's/^emu table: //p' "$OUT/list")
echo "emu table: $table"
if ! [[ "$table" =~ ^([0-9]+)\ entries,\ ([0-9]+)\ of\ the\ CUDA\ table,\ 0\ of ]] ||
  [ "${BASH_REMATCH[1]}" != "${BASH_REMATCH[2]}" ]; then
  echo "emu: FAIL: the emulated table is not the CUDA table: $(head -c 2000 "$OUT/list")"
  exit 1
fi
entries=("$@")
[ ${#entries[@]} -gt 0 ] || read -r -a entries <<<"$(sed -n 's/^entries: //p' "$OUT/list")"
# each (entry, order) is its own process, $jobs at a time; then the report, in order
one() { # entry order(0|1)
  local s=$SECONDS rc=0
  EMU_REVERSE=${2/0/} "$OUT/emu_test" "$1" >"$OUT/out.$1.$2" 2>&1 || rc=$?
  echo "rc $rc, $((SECONDS - s)) s" >>"$OUT/out.$1.$2"
}
for e in "${entries[@]}"; do
  for rev in 0 1; do spawn one "$e" "$rev"; done
done
drain
bad=()
for e in "${entries[@]}"; do
  for rev in 0 1; do
    f=$OUT/out.$e.$rev
    order=$(sed -n 's/^emu order: \([a-z]*\).*/\1/p' "$f")
    grep -v '^entries\|^covered\|^device\|^cuda plugin\|^emu order\|^emu table\|^[0-9]* passed' "$f" | head -20 |
      sed "s/^/[$order] /"
    if ! grep -q "^cudaemu $e: ok" "$f" || grep -q ": FAIL\|runtime error\|Sanitizer\|^emu: " "$f" ||
      ! grep -q '^rc 0,' "$f" || [ "$order" != "$([ $rev = 1 ] && echo reverse || echo forward)" ]; then
      bad+=("$e ($order)")
    fi
  done
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "emu: FAIL: ${bad[*]}"
  exit 1
fi
echo "emu: ${#entries[@]} entries x 2 orders ok${SAN:+ (ASan + UBSan)}"
