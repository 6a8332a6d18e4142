"""Benchmark suite setup: a ratio table printed at the end of the run (what issue notes paste)."""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_ROWS: list[tuple[str, dict]] = []


def record(benchmark, **figures) -> None:
    """Store figures in the benchmark's extra_info and in the end-of-run table."""
    benchmark.extra_info.update(figures)
    _ROWS.append((benchmark.name, figures))


def pytest_terminal_summary(terminalreporter):
    if not _ROWS:
        return
    terminalreporter.section("bitmtp ratio table")
    keys: list[str] = []
    for _, figs in _ROWS:
        keys += [k for k in figs if k not in keys]
    header = "| benchmark | " + " | ".join(keys) + " |"
    terminalreporter.write_line(header)
    terminalreporter.write_line("|" + "---|" * (len(keys) + 1))
    for name, figs in _ROWS:
        cells = []
        for k in keys:
            v = figs.get(k, "")
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        terminalreporter.write_line(f"| {name} | " + " | ".join(cells) + " |")
