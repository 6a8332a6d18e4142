"""bitmtp against llama.cpp's llama-bench on a BitNet-2B-shaped random ternary GGUF (TQ2_0), alternated.

    python scripts/ternary_peer.py                          # write the GGUF (cached), 2 threads, every figure
    python scripts/ternary_peer.py --layers 8 --rounds 5 --json out.json

The GGUF (~0.9 GB for 30 layers) is written once into ~/.cache/bitmtp/peers (or $BITMTP_PEER_DIR); the first
run also builds llama-bench (bench/llama_cpp.py). Figures and method: bench/ternary_peer.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llama_cpp import PeerUnavailable, cache_root  # noqa: E402
from bench.ternary_peer import BATCHES, SHAPE, compare, format_table, write_ternary_gguf  # noqa: E402

FIGURES = ("tg", *(f"b{m}" for m in BATCHES))


def model_path(layers: int) -> Path:
    """The cached ternary GGUF of ``layers`` layers, written on first use."""
    path = cache_root() / f"ternary-bitnet2b-shapes-{layers}l.gguf"
    if not path.is_file():
        print(f"ternary_peer: writing {path} (once)", file=sys.stderr)
        write_ternary_gguf(path, layers=layers)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=SHAPE["layers"], help="decoder layers (default 30, BitNet-2B's)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both programs (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations per figure (default 3)")
    ap.add_argument("--figures", default=",".join(FIGURES), help=f"comma-separated, from {', '.join(FIGURES)}")
    ap.add_argument("--json", metavar="FILE", help="also write the rows and the roofline as JSON")
    args = ap.parse_args(argv)
    figures = tuple(f for f in args.figures.split(",") if f)
    bad = [f for f in figures if f not in FIGURES]
    if bad:
        ap.error(f"--figures: unknown {', '.join(bad)}; choose from {', '.join(FIGURES)}")
    if not 1 <= args.layers <= 64:
        ap.error(f"--layers: must be in 1..64, got {args.layers}")
    try:
        rows, roof = compare(model_path(args.layers), threads=args.threads, rounds=args.rounds, figures=figures)
    except PeerUnavailable as exc:
        print(f"ternary_peer: llama-bench is not available here: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows, roof))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r.as_dict() for r in rows], "roofline": roof}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
