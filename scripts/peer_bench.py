"""bitmtp against llama.cpp's llama-bench on one GGUF, alternated, on this machine.

    python scripts/peer_bench.py                       # the embedded SmolLM2 GGUF, 2 threads, every figure
    python scripts/peer_bench.py --model my.gguf --threads 4 --rounds 5 --figures tg_d0,pp512
    python scripts/peer_bench.py --json out.json

The first run builds llama-bench from the llama-cpp-python sdist (~6 min on 2 cores; cached in
~/.cache/bitmtp/peers, or $BITMTP_PEER_DIR). Figures and method: bench/peer.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llama_cpp import PeerUnavailable  # noqa: E402
from bench.peer import DEFAULT_KV_MODES, FIGURES, KV_MODES, compare, format_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both programs (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations per figure (default 3)")
    ap.add_argument("--figures", default=",".join(FIGURES), help=f"comma-separated, from {', '.join(FIGURES)}")
    ap.add_argument("--kv", default=",".join(DEFAULT_KV_MODES),
                    help=f"comma-separated KV settings, from {', '.join(KV_MODES)} (default "
                         f"{','.join(DEFAULT_KV_MODES)}): default = each program's own default (llama.cpp f16, "
                         "bitmtp f32), f16 / f32 = both programs so (llama-bench 0.3.36 refuses f32 KV)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    figures = tuple(f for f in args.figures.split(",") if f)
    kv_modes = tuple(k for k in args.kv.split(",") if k)
    bad_kv = [k for k in kv_modes if k not in KV_MODES]
    if bad_kv or not kv_modes:
        ap.error(f"--kv: unknown {', '.join(bad_kv) or '(none given)'}; choose from {', '.join(KV_MODES)}")
    bad = [f for f in figures if f not in FIGURES]
    if bad:
        ap.error(f"--figures: unknown {', '.join(bad)}; choose from {', '.join(FIGURES)}")
    if args.model:
        model = Path(args.model)
        if not model.is_file():
            ap.error(f"--model: {model} is not a file")
    else:
        from bitmtp.cli_common import default_model_path

        model = Path(default_model_path())
    try:
        rows = compare(model, threads=args.threads, rounds=args.rounds, figures=figures, kv_modes=kv_modes)
    except PeerUnavailable as exc:
        print(f"peer_bench: llama-bench is not available here: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
