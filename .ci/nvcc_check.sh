#!/usr/bin/env bash
# Compile-check every csrc/cuda/*.cu for the GPUs we support, with ptxas statistics; fail on any
# register spill in a decode kernel. Skips (loudly) when the tree has no CUDA sources yet.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
srcs=(csrc/cuda/*.cu)
if [ ${#srcs[@]} -eq 0 ]; then
  echo "no csrc/cuda/*.cu files yet: nothing to compile"
  exit 0
fi
NVCC="${NVCC:-nvcc}"
if ! command -v "$NVCC" >/dev/null; then
  for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do [ -x "$c" ] && NVCC=$c && break; done
fi
command -v "$NVCC" >/dev/null || { echo "nvcc not found: cannot compile-check csrc/cuda"; exit 1; }
out=$(mktemp -d)
status=0
for arch in 80 86 87 89 90; do
  for src in "${srcs[@]}"; do
    log="$out/$(basename "$src" .cu)_sm$arch.log"
    if ! "$NVCC" -std=c++17 -O3 -arch=sm_$arch -cubin -Xptxas -v -Icsrc/cuda -o "$out/k.cubin" "$src" >"$log" 2>&1; then
      echo "FAIL sm_$arch $src"; cat "$log"; status=1; continue
    fi
    spills=$(grep -B2 -E "[1-9][0-9]* bytes spill (stores|loads)" "$log" | grep -E "Compiling entry function '.*decode" || true)
    if [ -n "$spills" ]; then
      echo "SPILL in a decode kernel, sm_$arch $src:"; grep -A3 "decode" "$log" | grep -E "spill|entry"; status=1
    fi
    n=$(grep -c "Compiling entry function" "$log" || true)
    echo "ok   sm_$arch $src ($n kernels)"
  done
done
rm -rf "$out"
exit $status
