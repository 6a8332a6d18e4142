"""bitmtp against llama.cpp's ``llama-bench`` on the same GGUF (issue "CPU runtime ahead of llama.cpp").

Figures (tokens/s) in three KV settings (:data:`KV_MODES`): ``default`` — each program as a user runs it
(llama.cpp's KV cache is f16 by default, bitmtp's float32); ``f16`` — both f16 (bitmtp ``kv_type="f16"``);
``f32`` — both float32 (llama.cpp ``-ctk f32 -ctv f32``):

* ``tg_d0`` — decode, short context (llama-bench ``-n N``; bitmtp: AR steps after a 16-token prompt);
* ``pp512`` / ``pp2048`` — prefill of a 512 / 2048-token prompt (``-p N``; bitmtp: ``Engine.prefill``);
* ``tg_d1024`` / ``tg_d4096`` — decode after 1024 / 4096 tokens of context (``-n N -d D``).

Every figure alternates the two programs (llama-bench one repetition, then bitmtp once, per round) and
reports the median of the per-round ratios bitmtp / llama.cpp — these machines' bandwidth and CPU share
change for minutes at a time, so separate runs are not comparable. Prompt tokens are random ids, as
llama-bench's are.

``python scripts/peer_bench.py [--model X.gguf] [--threads 2] [--rounds 3] [--figures tg_d0,pp512]`` prints
the table; ``bench/e2e/test_bench_peer.py`` records it in full mode.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.llama_cpp import ensure_llama_bench, llama_bench

#: figure -> (llama-bench prompt, gen, depth)
FIGURES: dict[str, tuple[int, int, int]] = {
    "tg_d0": (0, 64, 0),
    "pp512": (512, 0, 0),
    "pp2048": (2048, 0, 0),
    "tg_d1024": (0, 32, 1024),
    "tg_d4096": (0, 32, 4096),
}


#: KV setting -> (bitmtp's kv_type, llama-bench's extra arguments, label)
KV_MODES: dict[str, tuple[str | None, dict, str]] = {
    "default": (None, {}, "bitmtp f32, llama.cpp f16 (defaults)"),
    "f16": ("f16", {}, "both f16"),
    "f32": (None, {"cache_type": "f32"}, "both f32"),
}


@dataclass
class PeerRow:
    figure: str
    kv: str  # a KV_MODES key: "default" (llama.cpp f16, bitmtp f32), "f16" (both f16) or "f32" (both f32)
    bitmtp_tps: float
    llama_tps: float
    ratio: float  # median over rounds of bitmtp / llama.cpp
    #: decode figures: bitmtp's host glue per step, ms (a step's time outside the native kernels: bench/glue.py)
    glue_ms: float = float("nan")

    def as_dict(self) -> dict:
        return {"figure": self.figure, "kv": self.kv, "bitmtp_tps": self.bitmtp_tps, "llama_tps": self.llama_tps,
                "ratio": self.ratio, "glue_ms": self.glue_ms}


def bitmtp_measure(model, figure: str, seed: int = 0) -> float:
    """bitmtp's tokens/s for ``figure`` on ``model`` (a ``bitmtp.load``-ed model; AR, one thread count as
    set by the caller)."""
    prompt, gen, depth = FIGURES[figure]
    eng = model.engine
    g = torch.Generator().manual_seed(seed)
    vocab = model.args.vocab_size
    lo, hi = (100, vocab - 100) if vocab > 400 else (0, vocab)  # away from special tokens where there is room
    eng.reset()
    if prompt:
        ids = torch.randint(lo, hi, (prompt,), generator=g).tolist()
        t0 = time.perf_counter()
        eng.prefill(ids)
        return prompt / (time.perf_counter() - t0)
    ctx = torch.randint(lo, hi, (max(depth, 16),), generator=g).tolist()
    tok = eng.prefill(ctx)
    t0 = time.perf_counter()
    for _ in range(gen):
        tok = eng.ar_step(tok)
    return gen / (time.perf_counter() - t0)


#: the settings compared by default: llama-bench 0.3.36 (the pinned llama-cpp-python sdist) refuses
#: ``-ctk f32`` ("invalid parameter"), so "f32" runs only against a llama-bench that takes it
DEFAULT_KV_MODES = ("default", "f16")


def compare(gguf: Path, *, threads: int = 2, rounds: int = 3, figures: tuple[str, ...] = tuple(FIGURES),
            kv_modes: tuple[str, ...] = DEFAULT_KV_MODES, log: Callable[[str], None] = print) -> list[PeerRow]:
    """The peer table (module docstring) for the KV settings ``kv_modes`` (:data:`KV_MODES` keys). Raises
    ``bench.llama_cpp.PeerUnavailable`` without llama-bench."""
    import bitmtp

    unknown = [k for k in kv_modes if k not in KV_MODES]
    if unknown:
        raise ValueError(f"kv_modes: unknown {unknown}; expected some of {list(KV_MODES)}")
    binary = ensure_llama_bench(log=log)
    torch.set_num_threads(threads)
    need = max(p + g + d for p, g, d in (FIGURES[f] for f in figures)) + 64
    models = {t: bitmtp.load(str(gguf), capacity=need, adapter=None, kv_type=t)
              for t in {KV_MODES[k][0] for k in kv_modes}}
    rows = []
    for figure in figures:
        p, g, d = FIGURES[figure]
        for kv in kv_modes:
            kv_type, extra, _ = KV_MODES[kv]
            model = models[kv_type]
            bitmtp_measure(model, figure)  # warm-up (first-step allocations)
            ours, theirs = [], []
            for r in range(rounds):
                rec = llama_bench(binary, gguf, threads=threads, prompt=p, gen=g, depth=d, reps=1, **extra)
                theirs.append(float(rec["avg_ts"]))
                ours.append(bitmtp_measure(model, figure, seed=r))
            ratio = statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
            glue = _decode_glue(model, g, d) if g else float("nan")
            row = PeerRow(figure, kv, statistics.median(ours), statistics.median(theirs), ratio, glue)
            log(f"{figure:10s} kv={kv:7s} bitmtp {row.bitmtp_tps:8.1f} tok/s  llama.cpp {row.llama_tps:8.1f} tok/s"
                f"  ratio {ratio:.2f}")
            rows.append(row)
    return rows


def _decode_glue(model, gen: int, depth: int) -> float:
    """bitmtp's host glue per AR step at this figure's depth, ms (``bench.glue``; NaN without the extension)."""
    from bench.glue import solo_ar_glue

    try:
        return solo_ar_glue(model, steps=gen, context=max(depth, 16)).glue_ms
    except ImportError:
        return float("nan")


def format_table(rows: list[PeerRow]) -> str:
    out = ["| figure | KV | bitmtp tok/s | llama.cpp tok/s | bitmtp / llama.cpp | bitmtp host glue, ms a step |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        glue = "" if r.glue_ms != r.glue_ms else f"{r.glue_ms:.2f}"
        out.append(f"| {r.figure} | {KV_MODES[r.kv][2]} | {r.bitmtp_tps:.1f} | {r.llama_tps:.1f} | {r.ratio:.2f} "
                   f"| {glue} |")
    return "\n".join(out)
