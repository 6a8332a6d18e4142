"""Machine-independent checks of gated figures: floors from the goals, and exact oracle figures.

A baseline (``bench/baselines/<kind>.json``) only exists for machine kinds someone measured; on any
other kind the gate would otherwise check nothing. The checks here hold on *every* machine, so
``bench.compare`` applies them to every run, with or without a baseline:

* **floors** (higher is better) and **ceilings** (lower is better) — :data:`BOUNDS`. Each comes from
  a benchmark's own goal (``bw_fraction >= 0.6``, ``speedup_vs_f32 >= 8``, ``speedup_vs_hf >= 2``)
  or from what the figure means: a *speedup* below 1.0 is a slowdown, so it never passes; an oracle
  policy that is slower than AR has lost its reason to exist; a step of width M that costs more than
  M width-1 steps batches worse than a loop. Where quiet runs on a known machine kind already fell
  below a goal, the floor sits just under the worst such run (said in its ``why``): a floor is for
  gross regressions on kinds without a baseline, and a flaky floor would block CI everywhere.
* **exact figures** — committed tokens per iteration with the oracle drafter
  (:func:`oracle_committed`). The oracle drafts the true AR continuation, so every policy's token
  count per iteration is fixed by the block size and the number of new tokens alone: computed here
  from the policy rules (DESIGN.md "One iteration"), independently of the runtime, and compared with
  a tolerance of :data:`EXACT_TOL`. One token more or fewer changes the mean by ``1 / iterations``;
  a lost bonus token changes the tokens of a full iteration (:func:`oracle_committed_full`) even
  where the mean cannot show it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

HIGHER, LOWER, EXACT = "higher", "lower", "exact"
#: Relative tolerance of an exact figure: token counts over iteration counts are rationals with small
#: denominators (≤ new_tokens), so any real difference is ≥ 1 / new_tokens² ≫ this; the tolerance only
#: absorbs the 6 digits a baseline file rounds to.
EXACT_TOL = 1e-5

POLICIES_TEST = "bench/e2e/test_bench_policies.py::test_policies_over_ar"
SMOLLM2_MTP_TEST = "bench/e2e/test_bench_smollm2_mtp.py::test_smollm2_policies_vs_ar"
THREADS_TEST = "bench/e2e/test_bench_threads.py::test_generate_from_any_thread"


def test_of(benchmark: str) -> str:
    """``path::function`` of a benchmark's fullname (its ``[params]`` dropped)."""
    return benchmark.split("[", 1)[0]


def oracle_committed(policy: str, block: int, new_tokens: int) -> float:
    """Mean committed tokens per iteration of ``policy`` with the oracle drafter.

    The prefill commits the first of ``new_tokens`` (not an iteration), so iterations commit the
    other ``n = new_tokens − 1``. Every draft is right, so a full iteration commits:

    * ``speculative`` and ``hybrid_verify`` (hybrid with τ = 1: d₁'s probability is below 1, the
      confident prefix never reaches m, every block is verified): all D drafts accepted plus the
      verifier's bonus token v_D → ``D + 1``;
    * ``hybrid`` with τ below every probability: the whole confident prefix d₁..d_D, no verify
      → ``D``.

    The last iteration commits what is left (``max_new_tokens`` stops it), so the mean is
    ``n / ceil(n / per_iteration)``.
    """
    if block < 1 or new_tokens < 2:
        raise ValueError(f"oracle_committed: need D >= 1 and new_tokens >= 2, got D={block}, new_tokens={new_tokens}")
    per = {"speculative": block + 1, "hybrid_verify": block + 1, "hybrid": block}.get(policy)
    if per is None:
        raise ValueError(f"oracle_committed: unknown policy {policy!r} (speculative, hybrid, hybrid_verify)")
    n = new_tokens - 1
    return n / math.ceil(n / per)


def oracle_committed_full(policy: str, block: int, new_tokens: int) -> float:
    """Tokens one full iteration of ``policy`` commits with the oracle drafter: ``D + 1`` (speculative,
    hybrid τ = 1: every draft accepted plus the bonus token) or ``D`` (hybrid, confidence commits),
    at most the ``new_tokens − 1`` there are to commit. Where ``ceil(n / (D + 1)) == ceil(n / D)`` the
    mean of :func:`oracle_committed` cannot tell a lost bonus token; this can."""
    oracle_committed(policy, block, new_tokens)  # validates the arguments
    return float(min(block + (policy != "hybrid"), new_tokens - 1))


#: test -> figure -> (policy, which count) of the oracle figures the gate computes
ORACLE_FIGURES: dict[str, dict[str, tuple[str, str]]] = {
    POLICIES_TEST: {f"{label}_committed{suffix}": (label, kind)
                    for label in ("speculative", "hybrid", "hybrid_verify")
                    for suffix, kind in (("", "mean"), ("_full", "full"))},
    SMOLLM2_MTP_TEST: {"oracle_speculative_committed": ("speculative", "mean")},
}


def exact_expectation(benchmark: str, figure: str, extra: Mapping[str, Any]) -> tuple[float, str] | None:
    """``(expected value, how it was computed)`` for an exactly known figure, else None.

    Needs the run's own ``D`` and ``new_tokens`` (``extra_info``) — a run without them (or with a
    drafter other than the oracle) is left to its baseline, where committed figures are gated
    exactly too.
    """
    spec = ORACLE_FIGURES.get(test_of(benchmark), {}).get(figure)
    if spec is None or extra.get("drafter", "oracle") != "oracle":
        return None
    policy, kind = spec
    block, new = extra.get("D"), extra.get("new_tokens")
    if not isinstance(block, int) or not isinstance(new, int) or isinstance(block, bool) or isinstance(new, bool):
        return None
    per = block + 1 if policy != "hybrid" else block
    bonus = " + the bonus token" if per > block else ""
    if kind == "full":
        return oracle_committed_full(policy, block, new), f"oracle drafter, {policy}: a full iteration commits " \
            f"{per} (D = {block}{bonus})"
    return oracle_committed(policy, block, new), (f"oracle drafter, {policy}: {new - 1} tokens after the prefill's "
                                                  f"first, {per} per full iteration (D = {block}{bonus})")


BoundFn = Callable[[re.Match, Mapping[str, Any]], "float | None"]


@dataclass(frozen=True)
class Bound:
    """A machine-independent floor (``direction == "higher"``: the figure must be ≥ the bound) or
    ceiling (``"lower"``: ≤ the bound) for the figures of ``test`` whose name fully matches
    ``figure`` (a regular expression)."""

    test: str
    figure: str
    direction: str
    bound: float | BoundFn
    why: str

    def value(self, figure: str, extra: Mapping[str, Any]) -> float | None:
        match = re.fullmatch(self.figure, figure)
        if match is None:
            return None
        return self.bound(match, extra) if callable(self.bound) else float(self.bound)


def _width(match: re.Match, _extra: Mapping[str, Any]) -> float:
    return float(match.group("m"))


def _extra(key: str, scale: int = 1, add: int = 0) -> BoundFn:
    def bound(_match: re.Match, extra: Mapping[str, Any]) -> float | None:
        v = extra.get(key)
        return float(scale * v + add) if isinstance(v, int) and not isinstance(v, bool) else None
    return bound


def _native(bound: float) -> BoundFn:
    """``bound`` for the native CPU backend only: the pure-torch reference (``backend="torch"``, what
    tests/test_bench_gate.py times) defines results and has no bandwidth goal."""
    def fn(_match: re.Match, extra: Mapping[str, Any]) -> float | None:
        return bound if extra.get("backend") == "cpu" else None
    return fn


_BW = ("goal 0.6 (bench/kernels/test_bench_cpu_kernels.py); a quiet run on the avx512vnni kind measured 0.478 "
       "(2560x6912, 2026-11-29) when the bandwidth state flipped, so the floor is 0.45: catches a 2x regression "
       "of the usual 0.65-0.95")
_WIDTH = "a width-M step may cost at most M width-1 steps (else batching is worse than a loop)"
_SPEEDUP = "a speedup below 1.0 is a slowdown"

BOUNDS: tuple[Bound, ...] = (
    # kernels
    Bound("bench/kernels/test_bench_cpu_kernels.py::test_cpu_m1_bandwidth_fraction", "bw_fraction", HIGHER, 0.45, _BW),
    Bound("bench/kernels/test_bench_cpu_kernels.py::test_cpu_width_scaling", r"m(?P<m>\d+)_over_m1", LOWER, _width,
          _WIDTH),
    Bound("bench/kernels/test_bench_cpu_kernels.py::test_cpu_vs_dense_f32", "speedup_vs_f32", HIGHER, 8.0,
          "goal speedup_vs_f32 >= 8 (lowest known: 9.4, avx2 kind; ~10 on the 480 MiB-L3 Intel kind, both streaming)"),
    Bound("bench/kernels/test_bench_ops.py::test_op_bw_fraction", "op_bw_fraction", HIGHER, _native(0.45),
          "the native kernel's bandwidth goal, through the registry: " + _BW),
    Bound("bench/kernels/test_bench_ops.py::test_ternary_linear_overhead", "linear_over_kernel", LOWER, 1.5,
          "goal 1.3 (TernaryLinear at M = 1 within 1.3x its raw kernel: quantization inside the kernel call); "
          "1.17-1.21 in quiet quick runs on the Intel avx512vnni kind (2026-12-05); torch-op quantization gave 3.3-7x"),
    Bound("bench/kernels/test_bench_cuda.py::test_width_scaling", r".+_t(?P<m>\d+)_over_t1", LOWER, _width, _WIDTH),
    # runtime
    Bound("bench/runtime/test_bench_steps.py::test_bitnet2b_step_ratios_cpu", "draft_over_ar", LOWER,
          _extra("draft_width"), "the draft step has width 2D-1: " + _WIDTH),
    Bound("bench/runtime/test_bench_steps.py::test_bitnet2b_step_ratios_cpu", "verify_over_ar", LOWER,
          _extra("D"), "the verify step has width D: " + _WIDTH),
    Bound("bench/runtime/test_bench_steps.py::test_bitnet2b_step_ratios_cpu", "heads_draft_over_ar", LOWER,
          _extra("D", 2, -1), "p <= D pending rows plus D-1 LM-head GEMVs, each at most an AR step: at most 2D-1 "
          "AR steps"),
    Bound("bench/runtime/test_bench_fused.py::test_fused_over_per_op", r"speedup_.+", HIGHER, 1.0,
          "fused layers exist to be faster than the per-op path: " + _SPEEDUP),
    Bound("bench/runtime/test_bench_blocks.py::test_blocks_over_float32", r"speedup_.+", HIGHER, 1.0,
          "block weights stream 5.6x fewer bytes than float32: " + _SPEEDUP),
    Bound("bench/runtime/test_bench_graphs.py::test_graph_replay_vs_eager", "graph_speedup", HIGHER, 1.0, _SPEEDUP),
    # end to end
    Bound("bench/e2e/test_bench_ar.py::test_bitnet2b_shapes_ar_cpu", "bw_fraction", HIGHER, 0.45,
          "decode streams its weights through the same kernels: " + _BW),
    Bound("bench/e2e/test_bench_ar.py::test_smollm2_ar_vs_transformers", "speedup_vs_hf", HIGHER, 2.0,
          "goal speedup_vs_hf >= 2"),
    Bound(POLICIES_TEST, r".+_over_ar", HIGHER, 1.0,
          "with the oracle drafter every draft is right: an MTP policy slower than AR is a runtime regression; "
          + _SPEEDUP),
    Bound(SMOLLM2_MTP_TEST, "oracle_speculative_over_ar", HIGHER, 1.0,
          "with the oracle drafter every draft is right: " + _SPEEDUP),
    Bound(SMOLLM2_MTP_TEST, r"draft(?P<m>\d+)_over_ar", LOWER, _width, _WIDTH),
    Bound(SMOLLM2_MTP_TEST, r"verify(?P<m>\d+)_over_ar", LOWER, _width, _WIDTH),
    Bound(THREADS_TEST, "thread_over_main", HIGHER, 0.85,
          "goal 0.95 (issue 'Full speed from any thread'); quiet runs 1.00-1.02 on the Intel avx512vnni kind "
          "(2026-12-05); the OpenMP team it replaced gave 0.42: the floor catches that"),
    Bound(THREADS_TEST, "serve_decode_over_main", HIGHER, 0.85,
          "goal 0.95; quiet runs 0.97-0.98 on the Intel avx512vnni kind (2026-12-05, one chunk per 30 ms), 0.93 "
          "with one chunk per step, 0.42 with the OpenMP team"),
    Bound(THREADS_TEST, "auto_over_ar", HIGHER, 0.97,
          "issue 'MTP that pays': no chat prompt below 0.97; quiet runs 1.02-1.07 on the Intel avx512vnni kind "
          "(2026-12-05), 0.955-0.987 while torch's spinning OpenMP workers slowed the width-1 step"),
    Bound("bench/e2e/test_bench_smollm2_mtp.py::test_patched_vs_unpatched_generate", "speedup", HIGHER, 3.0,
          "goal of the HF-integration issue: patched generate >= 3x unpatched"),
    Bound("bench/e2e/test_bench_batch.py::test_batch_over_solo", "batch8_over_solo", HIGHER, 1.5,
          "8 sequences in one step against one at a time: 2.55x at 128 new tokens on the Intel avx512vnni kind "
          "(2026-12-05; c8 = 2.74, prefill included); batching that fell apart (a loop over sequences) gives ~1"),
)


def bound_for(benchmark: str, figure: str, extra: Mapping[str, Any]) -> tuple[float, str, str] | None:
    """``(bound, direction, why)`` of the first :data:`BOUNDS` entry for this figure, else None."""
    test = test_of(benchmark)
    for b in BOUNDS:
        if b.test == test:
            value = b.value(figure, extra)
            if value is not None:
                return value, b.direction, b.why
    return None
