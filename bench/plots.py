"""Plots (PNG, matplotlib Agg) from a pytest-benchmark JSON run of the suite.

    python -m bench.plots RUN.json [--out bench/out/plots]

writes

* ``speedup_vs_block.png`` — end-to-end speedup over AR against block size D, one line per policy
  (``bench/e2e/test_bench_policies.py``: ``<policy>_over_ar`` per ``D``);
* ``kernel_bandwidth_vs_width.png`` — W2A8 kernel weight bandwidth (packed bytes / time, GB/s)
  against replay width M, one line per shape (and backend on a GPU), with the streaming-read (CPU)
  or copy (GPU) bandwidth measured in the same run as a dashed line
  (``bench/kernels/test_bench_cpu_kernels.py``: ``weights_GBps`` per ``M``;
  ``bench/kernels/test_bench_cuda.py``: ``<backend>_m<M>_GBps``);
* ``serve_latency.png`` — time to first token and inter-token latency (p50, p95) against concurrent streaming
  clients, ``bitmtp serve`` and llama-server, with the run where a 4k-token prompt arrives mid-run
  (``bench/e2e/test_bench_batch.py::test_serve_clients_vs_llama_server``: ``<server>_<clients>_<metric>_ms``).

A plot whose figures the run lacks is skipped with a note; a run with none of them is an error
(exit 2), as are a missing file and a file that is not a pytest-benchmark JSON run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from bitmtp.errors import BitMTPError

DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "plots"


def load_benchmarks(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(benchmarks, machine_info)`` of a pytest-benchmark JSON run."""
    if not path.is_file():
        raise BitMTPError(f"{path}: no such file (write one with: pytest bench --benchmark-only "
                          f"--benchmark-json {path})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BitMTPError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise BitMTPError(f"{path}: not a pytest-benchmark JSON run (no 'benchmarks' list)")
    return data["benchmarks"], data.get("machine_info", {})


def speedup_series(benchmarks: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """policy -> [(D, speedup over AR)] from the end-to-end policy benchmarks."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for b in benchmarks:
        info = b.get("extra_info", {})
        if "test_policies_over_ar" not in b.get("fullname", "") or "D" not in info:
            continue
        for key, value in info.items():
            if key.endswith("_over_ar") and isinstance(value, (int, float)):
                series[key[: -len("_over_ar")]].append((int(info["D"]), float(value)))
    return {k: sorted(v) for k, v in series.items()}


def bandwidth_series(benchmarks: list[dict[str, Any]]) -> tuple[dict[str, list[tuple[int, float]]], dict[str, float]]:
    """``(line -> [(M, GB/s)], reference name -> GB/s)`` from the kernel benchmarks."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    refs: dict[str, list[float]] = defaultdict(list)
    for b in benchmarks:
        info = b.get("extra_info", {})
        shape = info.get("shape")
        if shape is None:
            continue
        name = b.get("fullname", "")
        if "test_bench_cpu_kernels.py" in name and "M" in info and "weights_GBps" in info:
            series[f"cpu {shape}"][int(info["M"])] = float(info["weights_GBps"])
            if "read_GBps" in info:
                refs["CPU streaming read"].append(float(info["read_GBps"]))
        for key, value in info.items():  # CUDA: <backend>_m<M>_GBps
            m = re.fullmatch(r"(\w+?)_m(\d+)_GBps", key)
            if m and isinstance(value, (int, float)):
                series[f"{m.group(1)} {shape}"][int(m.group(2))] = float(value)
        if "copy_GBps" in info and "test_bench_cuda.py" in name:
            refs["GPU copy (read + write)"].append(float(info["copy_GBps"]))
    lines = {k: sorted(v.items()) for k, v in series.items() if len(v) > 1}
    return lines, {k: statistics.median(v) for k, v in refs.items()}


#: the serve benchmark's latency figures: ``<server>_<clients>_<metric>_ms`` (clients 1, 4, 8, 16 or "8+4k": eight
#: streams with a 4k-token prompt arriving mid-run)
LATENCY_METRICS = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95")
_LATENCY_KEY = re.compile(r"^(bitmtp|llama)_(\d+|8\+4k)_(ttft_p50|ttft_p95|itl_p50|itl_p95)_ms$")


def latency_series(benchmarks: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[Any, float]]]]:
    """metric -> "<server> <p50|p95>" -> [(clients, ms)] from ``test_serve_clients_vs_llama_server``."""
    out: dict[str, dict[str, list[tuple[Any, float]]]] = defaultdict(lambda: defaultdict(list))
    for b in benchmarks:
        if "test_serve_clients_vs_llama_server" not in b.get("fullname", ""):
            continue
        for key, value in b.get("extra_info", {}).items():
            m = _LATENCY_KEY.match(key)
            if m and isinstance(value, (int, float)):
                server, clients, metric = m.groups()
                kind, pct = metric.split("_")
                out[kind][f"{server} {pct}"].append((clients if clients == "8+4k" else int(clients), float(value)))
    return {k: {s: sorted(v, key=lambda p: (isinstance(p[0], str), p[0])) for s, v in series.items()}
            for k, series in out.items()}


def _latency_plot(plt, series: dict[str, dict[str, list[tuple[Any, float]]]], title: str, path: Path) -> Path:
    """Two panels (time to first token, inter-token latency) against concurrent clients, a line per server and
    percentile; the 8-client run with a 4k-token prompt arriving mid-run as a separate marker at 8."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, kind, label in zip(axes, ("ttft", "itl"), ("time to first token (ms)", "inter-token latency (ms)"),
                               strict=True):
        for name, pts in sorted(series.get(kind, {}).items()):
            line = [(c, v) for c, v in pts if not isinstance(c, str)]
            style = "-" if name.endswith("p50") else "--"
            drawn = ax.plot([c for c, _ in line], [v for _, v in line], style, marker="o", label=name)
            for c, v in pts:
                if isinstance(c, str):  # the run with a long prompt: drawn at its 8 clients
                    ax.plot([8], [v], marker="*", ms=12, color=drawn[0].get_color(), ls="none")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 4, 8, 16], ["1", "4", "8", "16"])
        ax.set_yscale("log")
        ax.set_xlabel("streaming clients (★: 8 and a 4k-token prompt)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _log2_plot(plt, series: dict, decorate, xlabel: str, ylabel: str, title: str, path: Path,
               legend_size: int | None = None) -> Path:
    """One line per series over a log2 x axis ticked at the measured points; ``decorate(ax)`` adds
    reference lines. Saved to ``path``."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in sorted(series.items()):
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    decorate(ax)
    xs = sorted({x for pts in series.values() for x, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=legend_size)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(run: Path, out: Path) -> list[Path]:
    """Write every plot the run has figures for into ``out``; return the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benchmarks, machine = load_benchmarks(run)
    title_tail = f"{machine.get('bitmtp_machine_kind', '?')}, {machine.get('bitmtp_bench_mode', '?')} mode"
    out.mkdir(parents=True, exist_ok=True)
    written = []

    speed = speedup_series(benchmarks)
    if speed:
        def ar_line(ax):
            ax.axhline(1.0, color="gray", lw=0.8, ls=":", label="AR")

        written.append(_log2_plot(plt, speed, ar_line, "block size D", "tokens/s over AR (same runtime)",
                                  f"Speedup vs block size (oracle drafter)\n{title_tail}",
                                  out / "speedup_vs_block.png"))
    else:
        print(f"bench.plots: {run}: no test_policies_over_ar figures: speedup_vs_block.png skipped")

    lines, refs = bandwidth_series(benchmarks)
    if lines:
        def copy_lines(ax):
            for label, gbps in refs.items():
                ax.axhline(gbps, ls="--", lw=1, color="gray")
                ax.annotate(f"{label} {gbps:.0f} GB/s", (0.01, gbps), xycoords=("axes fraction", "data"), fontsize=8,
                            va="bottom", color="gray")

        written.append(_log2_plot(plt, lines, copy_lines, "replay width M (tokens per call)",
                                  "packed weight bytes / kernel time (GB/s)",
                                  f"W2A8 kernel bandwidth vs width\n{title_tail}",
                                  out / "kernel_bandwidth_vs_width.png", legend_size=8))
    else:
        print(f"bench.plots: {run}: no kernel width figures: kernel_bandwidth_vs_width.png skipped")
    latency = latency_series(benchmarks)
    if latency:
        written.append(_latency_plot(plt, latency, f"bitmtp serve vs llama-server, SmolLM2 Q4_1\n{title_tail}",
                                     out / "serve_latency.png"))
    else:
        print(f"bench.plots: {run}: no serve latency figures: serve_latency.png skipped")
    if not written:
        raise BitMTPError(f"{run}: none of the plotted figures are in this run (run pytest bench --benchmark-only, "
                          f"not --benchmark-disable)")
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plots", description="Benchmark plots (PNG) from a JSON run.")
    p.add_argument("run", type=Path, help="pytest-benchmark JSON run (--benchmark-json output)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    try:
        for path in write_plots(args.run, args.out):
            print(f"wrote {path}")
    except BitMTPError as exc:
        print(f"bench.plots: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
