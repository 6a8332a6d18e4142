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
trap 'rm -rf "$out"' EXIT
# One nvcc per (arch, source), as many at once as there are CPUs: nvcc is single-threaded, and the 10
# compiles took 100 s one after another on 2 cores (~55 s two at a time). Results print in a fixed order.
check_one() {  # arch src: compile, then write the verdict to $out/<name>.res (exit status 1 on failure)
  local arch=$1 src=$2 name log res
  name="$(basename "$src" .cu)_sm$arch"; log="$out/$name.log"; res="$out/$name.res"
  if ! "$NVCC" -std=c++17 -O3 -arch=sm_$arch -cubin -Xptxas -v -Icsrc/cuda -o "$out/$name.cubin" "$src" \
      >"$log" 2>&1; then
    { echo "FAIL sm_$arch $src"; cat "$log"; } >"$res"; return 1
  fi
  local spills
  spills=$(grep -B2 -E "[1-9][0-9]* bytes spill (stores|loads)" "$log" | grep -E "Compiling entry function '.*decode" || true)
  if [ -n "$spills" ]; then
    { echo "SPILL in a decode kernel, sm_$arch $src:"; grep -A3 "decode" "$log" | grep -E "spill|entry"; } >"$res"
    return 1
  fi
  echo "ok   sm_$arch $src ($(grep -c "Compiling entry function" "$log" || true) kernels)" >"$res"
}
export -f check_one
export NVCC out
jobs=()
for arch in 80 86 87 89 90; do
  for src in "${srcs[@]}"; do jobs+=("$arch" "$src"); done
done
status=0
printf '%s\0%s\0' "${jobs[@]}" | xargs -0 -n 2 -P "$(nproc)" bash -c 'check_one "$0" "$1"' || status=1
for ((i = 0; i < ${#jobs[@]}; i += 2)); do
  res="$out/$(basename "${jobs[i + 1]}" .cu)_sm${jobs[i]}.res"
  if [ -f "$res" ]; then cat "$res"; else echo "FAIL sm_${jobs[i]} ${jobs[i + 1]}: no result"; status=1; fi
done
exit $status
