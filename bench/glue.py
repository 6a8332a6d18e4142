"""Host glue: what a decode step spends outside the native kernels (issue 45, "A thin loop").

A step's time is the native extension's calls (``bitmtp._cpu_w2a8``: the fused layers, the linears, the
attention, the head's argmax) plus everything around them in Python and torch — planning the rows, building the
inputs and the mask, the embedding lookup, the one read, the commit and the stats. :class:`NativeTime` times every
call into the extension while it is active (it wraps the module's functions, which every caller looks up at call
time), so a step's glue is its wall time minus its native time.

* :func:`solo_ar_glue` — the solo engine's AR steps (``Engine.ar_step``, what ``tg128`` compares);
* :func:`batch_glue` — the batch engine's decode steps at ``batch`` sequences (after every prompt is in).

The issue's goal: ≤ 0.5 ms a step at batch 1 and ≤ 0.1 ms per extra sequence.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: the extension's entry points a decode step calls (the others are probes and format helpers)
NATIVE_CALLS = ("fused_layers", "linear_f32", "dense", "argmax_prob", "attention", "act_quant", "run", "silu_mul",
                "rms_norm", "norm_head_argmax")


@dataclass
class NativeTime:
    """Seconds spent inside the extension's calls, and how many calls, while :func:`native_time` is active."""

    seconds: float = 0.0
    calls: int = 0


@contextmanager
def native_time() -> Iterator[NativeTime]:
    """Time every call into ``bitmtp._cpu_w2a8`` inside the block (raises ImportError without the extension)."""
    ext = importlib.import_module("bitmtp._cpu_w2a8")
    acc = NativeTime()
    real = {name: getattr(ext, name) for name in NATIVE_CALLS if hasattr(ext, name)}

    def timed(fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc.seconds += time.perf_counter() - t
                acc.calls += 1
        return call

    for name, fn in real.items():
        setattr(ext, name, timed(fn))
    try:
        yield acc
    finally:
        for name, fn in real.items():
            setattr(ext, name, fn)


@dataclass
class Glue:
    """Per decode step: wall milliseconds, native milliseconds and their difference, the host glue."""

    steps: int
    step_ms: float
    native_ms: float

    @property
    def glue_ms(self) -> float:
        return self.step_ms - self.native_ms


def _id_range(model) -> tuple[int, int]:
    """Prompt ids away from the special tokens where the vocabulary has room (as ``bench.peer``'s)."""
    vocab = model.args.vocab_size
    return (100, vocab - 100) if vocab > 400 else (0, vocab)


def solo_ar_glue(model, steps: int = 64, context: int = 16) -> Glue:
    """The solo engine's AR steps after a ``context``-token prompt (random ids, as llama-bench's)."""
    import torch

    eng = model.engine
    lo, hi = _id_range(model)
    ids = torch.randint(lo, hi, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.reset()
    tok = eng.prefill(ids)
    with native_time() as nat:
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = eng.ar_step(tok)
        wall = time.perf_counter() - t0
    return Glue(steps, wall / steps * 1e3, nat.seconds / steps * 1e3)


def batch_glue(model, batch: int, steps: int = 32, context: int = 16, max_batch: int = 16) -> Glue:
    """The batch engine's AR decode steps with ``batch`` sequences decoding (prompts prefilled first)."""
    eng = model.batcher(max_batch)
    lo, hi = _id_range(model)
    gens = [eng.submit([lo + (7 * i + j) % (hi - lo) for j in range(context)], max_new_tokens=steps + 2, eos=())
            for i in range(batch)]
    for g in gens:  # each prompt's first token: every prompt is in
        next(g)
    s0 = eng.steps
    with native_time() as nat:
        t0 = time.perf_counter()
        for _ in range(steps):
            with eng._lock:
                eng.step()
        wall = time.perf_counter() - t0
    n = eng.steps - s0
    for g in gens:
        g.close()
    return Glue(n, wall / n * 1e3, nat.seconds / n * 1e3)


__all__ = ["Glue", "NativeTime", "batch_glue", "native_time", "solo_ar_glue"]
