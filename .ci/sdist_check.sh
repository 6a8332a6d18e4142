#!/usr/bin/env bash
# The sdist carries everything its build needs: build it from the files git tracks (plus new, not ignored
# ones), install it into a fresh venv with BITMTP_REQUIRE_CPU_EXT=1 (the native CPU extension must compile
# from the sdist alone), then, from a temporary folder (never the source tree), import bitmtp._cpu_w2a8 from
# the installed location, run one W2A8 product on it against the torch reference, and check the data files
# (WGSL shaders, CUDA sources, shipped adapters, the prompt sets of bitmtp/data and their license) were
# installed, loading the prompt sets from there against a pinned hash.
#
#   bash .ci/sdist_check.sh               # offline: builds with the dev venv's setuptools + pybind11
#   SDIST_ISOLATED=1 bash .ci/sdist_check.sh   # PEP 517 build isolation: pip fetches pyproject's
#                                              # build-system.requires (small), checking that list too
#
# torch is never downloaded again: the fresh venv reaches the dev venv's packages through a .pth line (a
# plain path: the dev venv's own .pth files, e.g. its editable bitmtp finder, are not run), and the sdist
# is installed with --no-deps. Needs: PYTHON (default .venv/bin/python) with torch, numpy, setuptools,
# pybind11; a C++17 compiler (the extension uses its own thread team, not OpenMP).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || { echo "sdist_check: $PY not found; run scripts/setup.sh first or set PYTHON" >&2; exit 2; }
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
repo="$(pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "--- sdist from the working tree"
mkdir -p "$tmp/src" "$tmp/dist"
# a copy, so the build's egg-info and build/ never touch the checkout
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | xargs -0 cp --parents -t "$tmp/src"
# setup.py sdist, not `python -m build`: the dev venv has setuptools but not `build` (nor `wheel`, which
# build's dependency check would ask for), and this check must run offline
(cd "$tmp/src" && "$PY" setup.py -q sdist -d "$tmp/dist" > "$tmp/sdist.log" 2>&1) || { cat "$tmp/sdist.log"; exit 1; }
sdist=$(ls "$tmp"/dist/bitmtp-*.tar.gz)
echo "built $(basename "$sdist") ($(du -k "$sdist" | cut -f1) KiB) in $((SECONDS - start))s"
# every file the extension's sources #include must be inside (the bug this check exists for)
listing="$tmp/listing.txt"
tar tzf "$sdist" > "$listing"
missing=0
for f in csrc/cpu/*.cpp csrc/cpu/*.h csrc/cpu/*.inc csrc/cuda/* wgsl_fallback/*.wgsl bitmtp/adapters/*/* \
         bitmtp/data/*.json bitmtp/data/*.jsonl bitmtp/data/*.txt bitmtp/data/*.md bitmtp/serve/static/*.html; do
  if ! grep -qx "bitmtp-[^/]*/$f" "$listing"; then echo "sdist lacks $f" >&2; missing=1; fi
done
if grep -E '\.(so|pyc|o)$' "$listing"; then echo "sdist carries build products (above)" >&2; missing=1; fi
[ $missing -eq 0 ] || exit 1

echo "--- fresh venv (the dev venv's packages reachable, the dev venv's bitmtp not)"
"$PY" -m venv --without-pip "$tmp/venv"
base_site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
venv_site=$("$tmp/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$base_site" > "$venv_site/_dev_venv_packages.pth"

echo "--- pip install the sdist (BITMTP_REQUIRE_CPU_EXT=1)"
iso=(--no-build-isolation)
[ "${SDIST_ISOLATED:-0}" = "1" ] && iso=()
# pip runs from the dev venv and installs into the fresh one (--python); --ignore-installed: the dev venv's
# bitmtp metadata is visible through the .pth line, and pip must neither skip nor try to uninstall it
(cd "$tmp" && BITMTP_REQUIRE_CPU_EXT=1 "$PY" -m pip --python "$tmp/venv/bin/python" install -q --no-deps \
  --ignore-installed --no-cache-dir "${iso[@]}" "$sdist")
echo "installed in $((SECONDS - start))s"

echo "--- import the native extension from the installed copy"
(cd "$tmp" && env -u PYTHONPATH -u BITMTP_BACKEND "$tmp/venv/bin/python" - "$venv_site" "$repo" <<'EOF'
import importlib.resources as res
import sys

site, repo = sys.argv[1], sys.argv[2]
import torch

import bitmtp
import bitmtp._cpu_w2a8 as ext
from bitmtp.ops import registry

for mod in (bitmtp, ext):
    assert mod.__file__.startswith(site) and not mod.__file__.startswith(repo), f"{mod.__name__}: {mod.__file__}"
ok, why = registry.availability("cpu")
assert ok, f"cpu backend unavailable from the installed copy: {why}"
# one product through the installed kernels, against the torch reference
from bitmtp.formats.ternary import pack_t2

g = torch.Generator().manual_seed(0)
w = torch.randint(-1, 2, (48, 256), generator=g, dtype=torch.int8)
x = torch.randint(-128, 128, (3, 256), generator=g, dtype=torch.int8)
cpu = registry.backend("cpu").w2a8_accumulate(x, pack_t2(w), 256, 256)
assert torch.equal(cpu[..., 0], x.int() @ w.int().T), "installed kernel disagrees with x @ w.T"
files = [res.files("bitmtp.wgsl_fallback") / "w2a8.wgsl", res.files("bitmtp._csrc.cuda") / "w2a8_decode.cu",
         res.files("bitmtp") / "adapters" / "smollm2-135m-instruct-mask-block-d8" / "adapter_config.json"]
files += [res.files("bitmtp") / "data" / name for name in ("long_docs.jsonl", "chat_prompt_groups.json",
                                                      "eval_prompts.json", "LICENSE-PSF.txt")]
for f in files:
    assert f.is_file(), f"not installed: {f}"
# the prompt sets load from the installed copy and are the ones tests/train/test_chat_prompts.py pins
import hashlib

from bitmtp.train import chat_prompts, evaluate, long_docs

for mod in (chat_prompts, evaluate, long_docs):
    assert mod.__file__.startswith(site), f"{mod.__name__}: {mod.__file__}"
base = hashlib.sha256("\n".join(chat_prompts.all_chat_prompts("base")).encode()).hexdigest()
assert base == "9d42a248e849c612a2dc852dc130e19be02c378bab3f89df768e33a929eb244b", f"base chat pool: {base}"
assert len(long_docs.DOCUMENTS) == 14 and len(evaluate.CHAT_PROMPTS) == 12
print(f"OK: {ext.__file__} ({why})")
EOF
)
echo "sdist check done in $((SECONDS - start))s"
