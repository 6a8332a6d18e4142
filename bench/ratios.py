"""Ratio measurement for benchmarks on shared, noisy machines.

Absolute times here drift (this machine's memory bandwidth switches between two states for minutes
at a time), so benchmarks report ratios measured within one run: the two contenders run
alternately (A B A B …) and the median of the per-round ratios is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def best_time(fn: Callable[[], object], inner: int) -> float:
    """Seconds per call: the best of ``inner`` consecutive calls (one warm call first)."""
    fn()
    best = float("inf")
    for _ in range(inner):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def alternating_ratio(
    fn_a: Callable[[], object], fn_b: Callable[[], object], rounds: int = 5, inner: int = 3
) -> tuple[float, float, float]:
    """``(median time_a / time_b, median time_a, median time_b)`` over alternating rounds."""
    ratios, ta, tb = [], [], []
    for _ in range(rounds):
        a = best_time(fn_a, inner)
        b = best_time(fn_b, inner)
        ratios.append(a / b)
        ta.append(a)
        tb.append(b)
    return statistics.median(ratios), statistics.median(ta), statistics.median(tb)


def best_over_best(a: list[float], b: list[float]) -> float:
    """``max(a) / max(b)``: the ratio of the best throughputs of two contenders measured alternately.

    For whole generations (a second or more each, a few rounds) the best round is the one least
    disturbed by other processes on a shared machine; a median of per-round ratios would let one
    disturbed round of either contender move the figure.
    """
    if not a or not b:
        raise ValueError("best_over_best: both contenders need at least one measurement")
    return max(a) / max(b)


def cuda_event_time(fn: Callable[[], object], reps: int, *, warm: bool = False) -> float:
    """Seconds per call of ``fn`` on the current CUDA stream, from CUDA events around ``reps`` back-to-back
    calls; ``warm=True`` makes one untimed call first (otherwise ``fn`` must already be warm)."""
    import torch

    if warm:
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps
