#!/usr/bin/env bash
# Fill .gl/ with what bench/gpu_check.sh needs on a GPU machine that has no network: the Vulkan loader and
# glvnd (NVIDIA's Vulkan ICD loads through libGLdispatch / libEGL; without them wgpu sees no adapter) as .deb
# files, and wgpu with its pure-Python needs as wheels for the device's Python (default 3.12). Run it here, in
# the repository root, where apt and pip reach their registries; .gl/ is git-ignored through .git/info/exclude.
# Then hand the device tool `carry: [".gl"]` and run, as session 14 did:
#   export GPU_CHECK_LOG_DIR=/tmp/gcl PYTHON=python3; mkdir -p /tmp/gcl
#   bash bench/gpu_check.sh > /tmp/gcl/console.log 2>&1; tar czf $OUT/gpu_logs.tgz -C /tmp gcl; tail -c 11000 /tmp/gcl/console.log
#
# Usage: bash bench/gpu_carry.sh [PYTHON_VERSION]    (about 4 MB; needs apt-get and this venv's pip)
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=${1:-3.12}
grep -qx '/.gl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gl/ >> .git/info/exclude; }
mkdir -p .gl/wheels /tmp/amd64/partial
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
# shellcheck disable=SC2086
apt-get $o update -qq
# shellcheck disable=SC2086
(cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 2>&1 | grep -v unsandboxed || true)
PIP=${PIP:-.venv/bin/python -m pip}
wgpu_version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('wgpu'))" 2>/dev/null || echo 0.32.0)
# numpy is on the device already: leave it out (two versions would stop the install)
$PIP download -q --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gl/wheels "wgpu==$wgpu_version"
rm -f .gl/wheels/numpy-*.whl
ls -la .gl .gl/wheels
du -sh .gl
