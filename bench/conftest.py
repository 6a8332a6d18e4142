"""Benchmark suite setup: modes, gated figures, the machine kind, and the end-of-run ratio table.

Layout (by layer): ``bench/kernels`` (one op: GB/s, fraction of measured bandwidth, width ratios),
``bench/runtime`` (one replay step: draft/verify over AR step cost, CUDA-graph replay over eager),
``bench/e2e`` (whole generations: speedup over AR on the same runtime, committed tokens/iteration).

Modes: ``--bench-mode quick|full`` (default: ``BITMTP_BENCH_MODE``, else ``quick``). ``quick`` keeps
the whole ``pytest bench --benchmark-only`` under 5 minutes on a 2-core machine — fewer rounds,
fewer shapes and widths, smaller end-to-end models — and still measures every gated ratio of its
baseline; benchmarks marked ``full_only`` (SmolLM2 against transformers, the 30-layer BitNet-2B
decoder end to end, the pure-torch reference kernel at every shape) run in ``full`` only.

Every benchmark stores its figures with :func:`record`: they land in pytest-benchmark's
``extra_info`` (so ``--benchmark-json`` carries them), and the ones named in ``gates`` are the
ratios ``python -m bench.compare`` checks against ``bench/baselines/<machine kind>.json``.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

MODE_ENV = "BITMTP_BENCH_MODE"
MODES = ("quick", "full")
HIGHER, LOWER, EXACT = "higher", "lower", "exact"  # as bench.goals
#: Cores' worth of CPU that other processes may use during a run before its ratios are suspect.
FOREIGN_LOAD_WARN = 0.25

#: The mode of this session (set by ``pytest_configure``; the environment decides before that).
MODE: str = os.environ.get(MODE_ENV, "quick").strip() or "quick"

_ROWS: list[tuple[str, dict[str, Any]]] = []
T = TypeVar("T")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--bench-mode", choices=MODES, default=None,
                     help=f"benchmark mode: quick (CI, <= 5 min on 2 cores) or full (default: ${MODE_ENV} or quick)")


def pytest_configure(config: pytest.Config) -> None:
    global MODE
    mode = config.getoption("--bench-mode", default=None) or os.environ.get(MODE_ENV, "").strip() or "quick"
    if mode not in MODES:
        raise pytest.UsageError(f"{MODE_ENV}={mode!r}: expected one of {', '.join(MODES)}")
    MODE = mode
    os.environ[MODE_ENV] = mode  # subprocesses and late imports see the same mode
    config.addinivalue_line("markers", "full_only: heavy benchmark, runs with --bench-mode full only")


def by_mode(quick: T, full: T) -> T:
    """``quick`` or ``full`` according to the session's mode (module-level constants may use it:
    test modules are imported after ``pytest_configure``)."""
    return full if MODE == "full" else quick


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if MODE == "full":
        return
    skip = pytest.mark.skip(reason="full_only: run with --bench-mode full")
    for item in items:
        if "full_only" in item.keywords:
            item.add_marker(skip)


def _cpu_seconds() -> tuple[float, float, float] | None:
    """``(wall, busy CPU seconds of the whole machine, CPU seconds of this process)`` (Linux only)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    jiffies = [int(x) for x in fields]
    busy = sum(jiffies) - jiffies[3] - (jiffies[4] if len(jiffies) > 4 else 0)  # all but idle and iowait
    return time.monotonic(), busy / tick, (int(own[11]) + int(own[12])) / tick


_START: tuple[float, float, float] | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _START
    _START = _cpu_seconds()


def foreign_load() -> float | None:
    """Mean number of cores other processes kept busy since the session started (None off Linux).
    Ratios measured while another process competes for a 2-core machine are unreliable: every
    OpenMP barrier can wait a scheduler time slice."""
    end = _cpu_seconds()
    if _START is None or end is None or end[0] <= _START[0]:
        return None
    wall = end[0] - _START[0]
    return max(0.0, ((end[1] - _START[1]) - (end[2] - _START[2])) / wall)


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """Stamp the run JSON with the machine kind and mode (``bench.compare`` picks the baseline by them)
    and the load other processes put on the machine during the run (it warns when that was high)."""
    from bench.machine import machine_kind

    machine_info["bitmtp_machine_kind"] = machine_kind()
    machine_info["bitmtp_bench_mode"] = MODE
    machine_info["torch_threads"] = torch.get_num_threads()
    load = foreign_load()
    if load is not None:
        machine_info["bitmtp_foreign_load"] = round(load, 3)


def record(benchmark: Any, gates: dict[str, str] | None = None, **figures: Any) -> None:
    """Store ``figures`` in the benchmark's extra_info and in the end-of-run table.

    ``gates`` maps the figures the regression gate checks to ``"higher"`` or ``"lower"`` (which way
    is better) or ``"exact"`` (a count, not a measurement: gated by equality); each must be among
    ``figures`` and a finite number. Figures that are not gated
    (absolute times, GB/s, goals) are context: they drift with the machine's state, ratios do not.
    """
    gates = dict(gates or {})
    for name, direction in gates.items():
        if direction not in (HIGHER, LOWER, EXACT):
            raise ValueError(f"gate {name!r}: direction must be {HIGHER!r}, {LOWER!r} or {EXACT!r}, not {direction!r}")
        value = figures.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"gate {name!r}: needs a finite number among the figures, got {value!r}")
    benchmark.extra_info.update(figures)
    if gates:
        benchmark.extra_info["gates"] = gates
    _ROWS.append((benchmark.name, {**figures, **({"gated": ",".join(gates)} if gates else {})}))


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _ROWS:
        return
    from bench.machine import machine_kind

    terminalreporter.section(f"bitmtp ratio table (mode {MODE}, machine kind {machine_kind()})")
    load = foreign_load()
    if load is not None:
        terminalreporter.write_line(f"other processes kept {load:.2f} of {os.cpu_count()} cores busy during the run"
                                    + (" — ratios may be disturbed" if load > FOREIGN_LOAD_WARN else ""))
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, figs in _ROWS:  # one sub-table per benchmark function: same columns
        groups.setdefault(name.split("[")[0], []).append((name, figs))
    for rows in groups.values():
        keys: list[str] = []
        for _, figs in rows:
            keys += [k for k in figs if k not in keys]
        terminalreporter.write_line("")
        terminalreporter.write_line("| benchmark | " + " | ".join(keys) + " |")
        terminalreporter.write_line("|" + "---|" * (len(keys) + 1))
        for name, figs in rows:
            terminalreporter.write_line(f"| {name} | " + " | ".join(_cell(figs.get(k, "")) for k in keys) + " |")
