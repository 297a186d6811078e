#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on the GPU machine (no internet there), here, in the
# repository root:
#   .whl/       the wheels the build needs that the machine's image lacks, for CPython 3.12 on
#               manylinux x86-64: scipy-openblas32 at the version pyproject.toml pins (the
#               vendored BLAS); with --setuptools also setuptools and wheel (the image has both)
#   .nccl230/   libnccl.so.2, NCCL 2.30.7 for sm_90, unpacked from ../shared/device (or
#               $TPCORE_NCCL_GZ): the NCCL that allows two ranks on one GPU
# Both folders are git-ignored (.gitignore); the device tool takes them along when `carry` names
# them.  The last line printed is the carry list.
#
#   scripts/prepare_gpu_wheels.sh [--setuptools] [--no-nccl]
set -euo pipefail

ROOT=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$ROOT"
WITH_SETUPTOOLS=0
WITH_NCCL=1
for a in "$@"; do
  case "$a" in
    --setuptools) WITH_SETUPTOOLS=1 ;;
    --no-nccl) WITH_NCCL=0 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "prepare_gpu_wheels.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done

# The pin, from its one source (pyproject.toml's build requirements).
PIN=$(grep -o 'scipy-openblas32==[0-9.]*' pyproject.toml | head -1)
if [ -z "$PIN" ]; then
  echo "prepare_gpu_wheels.sh: no scipy-openblas32==<version> pin in pyproject.toml" >&2
  exit 1
fi
WANT=("$PIN")
if [ "$WITH_SETUPTOOLS" = 1 ]; then
  WANT+=("setuptools>=64" "wheel")
fi

# Git must ignore both folders, or the device tool sends them twice (as tree and as carry).
for d in /.whl/ /.nccl230/; do
  if ! git check-ignore -q "${d#/}probe" 2>/dev/null; then
    echo "prepare_gpu_wheels.sh: $d is not ignored by git; add it to .gitignore" >&2
    exit 1
  fi
done

mkdir -p .whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
for spec in "${WANT[@]}"; do
  name=${spec%%[=<>]*}
  norm=$(echo "$name" | tr '-' '_')
  # one version of each package: an older download beside a new one stops the install there
  rm -f .whl/"$norm"-*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$spec"
done
echo "wheels in .whl/:"
ls -l .whl/*.whl | awk '{printf "  %s (%d bytes)\n", $NF, $5}'

CARRY='[".whl"]'
if [ "$WITH_NCCL" = 1 ]; then
  GZ=${TPCORE_NCCL_GZ:-}
  if [ -z "$GZ" ]; then
    for c in "$ROOT/../shared/device/libnccl.so.2.30.7-sm90.gz" /work/shared/device/libnccl.so.2.30.7-sm90.gz; do
      if [ -f "$c" ]; then GZ=$c; break; fi
    done
  fi
  if [ -z "$GZ" ] || [ ! -f "$GZ" ]; then
    echo "prepare_gpu_wheels.sh: libnccl.so.2.30.7-sm90.gz not found (../shared/device/ or \$TPCORE_NCCL_GZ);" \
         "the NCCL world-2 checks will say 'not run'" >&2
  else
    mkdir -p .nccl230
    gunzip -c "$GZ" > .nccl230/libnccl.so.2.tmp
    mv .nccl230/libnccl.so.2.tmp .nccl230/libnccl.so.2
    want=7605c5ce50e3c3b77a6e5779f9b2ff3d3495795eaa818f2e219eb8ea76a1218d  # ../shared/device/README.md
    got=$(sha256sum .nccl230/libnccl.so.2 | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
      echo "prepare_gpu_wheels.sh: .nccl230/libnccl.so.2 has SHA-256 $got, the README says $want" >&2
      exit 1
    fi
    echo "NCCL 2.30.7: .nccl230/libnccl.so.2 ($(stat -c %s .nccl230/libnccl.so.2) bytes, SHA-256 ok)"
    CARRY='[".whl", ".nccl230"]'
  fi
fi

# The device tool's limit: tree + carried folders <= 64 MiB.
tree_kb=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
extra_kb=$(du -sk .whl $( [ -d .nccl230 ] && [ "$WITH_NCCL" = 1 ] && echo .nccl230) | awk '{s += $1} END {print s}')
echo "size that travels: about $(( (tree_kb + extra_kb) / 1024 )) MiB of 64 MiB (tree ${tree_kb} KiB, carried ${extra_kb} KiB)"
echo "carry: $CARRY"
