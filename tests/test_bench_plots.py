"""bench/plots.py on made-up runs: the serve latency figures become their series and a PNG; a run without any
plotted figure, a missing file and a file that is not a run are BitMTPErrors naming the file."""

from __future__ import annotations

import json

import pytest

from bench.plots import latency_series, write_plots
from bitmtp.errors import BitMTPError

pytest.importorskip("matplotlib")


def _serve_run(tmp_path):
    info = {}
    for server, scale in (("bitmtp", 1.0), ("llama", 0.5)):
        for clients in ("1", "4", "8", "16", "8+4k"):
            c = 12 if clients == "8+4k" else int(clients)
            info[f"{server}_{clients}_ttft_p50_ms"] = 40.0 * c * scale
            info[f"{server}_{clients}_ttft_p95_ms"] = 90.0 * c * scale
            info[f"{server}_{clients}_itl_p50_ms"] = 20.0 + c * scale
            info[f"{server}_{clients}_itl_p95_ms"] = 30.0 + c * scale
    info["serve_tps_8"] = 100.0  # not a latency figure: ignored
    run = {"machine_info": {"bitmtp_machine_kind": "test", "bitmtp_bench_mode": "full"},
           "benchmarks": [{"fullname": "bench/e2e/test_bench_batch.py::test_serve_clients_vs_llama_server",
                           "extra_info": info}]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    return path, run


def test_latency_figures_become_series_and_a_plot(tmp_path):
    path, run = _serve_run(tmp_path)
    series = latency_series(run["benchmarks"])
    assert set(series) == {"ttft", "itl"}
    assert set(series["ttft"]) == {"bitmtp p50", "bitmtp p95", "llama p50", "llama p95"}
    assert series["ttft"]["llama p50"] == [(1, 20.0), (4, 80.0), (8, 160.0), (16, 320.0), ("8+4k", 240.0)]
    written = write_plots(path, tmp_path / "out")
    assert [p.name for p in written] == ["serve_latency.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_without_figures_or_not_runs_are_refused(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"benchmarks": [{"fullname": "x", "extra_info": {}}]}))
    with pytest.raises(BitMTPError, match="none of the plotted figures"):
        write_plots(empty, tmp_path / "out")
    with pytest.raises(BitMTPError, match="no such file"):
        write_plots(tmp_path / "missing.json", tmp_path / "out")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(BitMTPError, match="not a pytest-benchmark JSON run"):
        write_plots(bad, tmp_path / "out")
