"""The benchmark ratio gate (``python -m bench.compare``): a kernel slowed through the registry makes
it fail naming the benchmark and the ratio; an unslowed run passes; bad input is a clear error.

No wall-clock thresholds: the slowed op sleeps 50 ms per call on a kernel of microseconds, so its
bandwidth fraction falls by orders of magnitude, and the gate's margin here is 80% (an unslowed run
would have to be 5× slower than the baseline run to fail; the slowed one is ~100× slower).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bench import compare
from bench.kernels.op_ratio import OP, benchmark_name, op_vs_copy
from bench.machine import cpu_isa, machine_kind, slug
from bitmtp.ops.registry import availability, override, select

N, K, M = 64, 512, 1
DELAY_S = 0.05


def _backend() -> str:
    """The reference backend: available everywhere, and single-threaded at this size, so a descheduled
    OpenMP thread on a shared machine cannot stall a call by a whole time slice."""
    assert availability("torch", "cpu")[0]
    return "torch"


def _write_run(path: Path, figures: dict[str, dict[str, float]], kind: str = "test-kind", mode: str = "quick") -> Path:
    """A run in pytest-benchmark's --benchmark-json layout, op_bw_fraction gated (higher is better)."""
    path.write_text(json.dumps({
        "machine_info": {"node": "test", "bitmtp_machine_kind": kind, "bitmtp_bench_mode": mode},
        "commit_info": {"id": "0" * 40},
        "benchmarks": [{"group": None, "name": name.split("::")[1], "fullname": name, "params": {}, "stats": {},
                        "extra_info": {**figs, "gates": {"op_bw_fraction": "higher"}}}
                       for name, figs in figures.items()],
        "datetime": "2026-01-01T00:00:00", "version": "5.3.1",
    }))
    return path


def _measure() -> dict[str, dict[str, float]]:
    backend = _backend()
    return {benchmark_name(backend, N, K, M): op_vs_copy(backend, N, K, M, rounds=5, inner=10)}


@pytest.fixture
def baseline(tmp_path: Path) -> Path:
    run = _write_run(tmp_path / "base_run.json", _measure())
    path = tmp_path / "baseline.json"
    assert compare.main([str(run), "--update", "--baseline", str(path), "--margin", "0.8"]) == 0
    data = json.loads(path.read_text())
    (spec,) = data["modes"]["quick"]["benchmarks"][benchmark_name(_backend(), N, K, M)].values()
    assert spec["direction"] == "higher" and spec["margin"] == 0.8 and spec["value"] > 0
    return path


def test_unslowed_run_passes(tmp_path: Path, baseline: Path, capsys) -> None:
    run = _write_run(tmp_path / "run.json", _measure())
    assert compare.main([str(run), "--baseline", str(baseline)]) == 0
    out = capsys.readouterr().out
    assert "| benchmark | figure |" in out and "bench gate passed" in out
    assert benchmark_name(_backend(), N, K, M) in out and "| ok |" in out


def test_slowed_kernel_fails_the_gate_naming_benchmark_and_ratio(tmp_path: Path, baseline: Path, capsys) -> None:
    backend = _backend()
    fast = select(OP, torch.device("cpu"), backend)
    calls = []

    def slowed(*args, **kwargs):
        calls.append(1)
        time.sleep(DELAY_S)
        return fast(*args, **kwargs)

    with override(backend, OP, slowed):
        figures = _measure()
    assert calls, "the override was not used: the benchmark does not dispatch through the registry"
    assert select(OP, torch.device("cpu"), backend) == fast  # restored
    run = _write_run(tmp_path / "run.json", figures)
    assert compare.main([str(run), "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    name = benchmark_name(backend, N, K, M)
    failure = out.split("bench gate FAILED")[1]
    assert name in failure and "op_bw_fraction" in failure and "dropped" in failure
    assert "| REGRESSED |" in out


def test_missing_figure_fails_and_new_figure_is_noted(tmp_path: Path, baseline: Path, capsys) -> None:
    other = "bench/kernels/test_bench_ops.py::test_op_bw_fraction[other]"
    run = _write_run(tmp_path / "run.json", {other: {"op_bw_fraction": 1.0}})
    assert compare.main([str(run), "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    assert "was not measured" in out and benchmark_name(_backend(), N, K, M) in out
    assert f"note: {other}: op_bw_fraction is gated but not in the baseline" in out


def test_lower_is_better_direction(tmp_path: Path) -> None:
    base = {"modes": {"quick": {"benchmarks": {"b::t": {"r": {"value": 1.0, "direction": "lower", "margin": 0.25}}}}}}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(base))
    section = compare.load_baseline(path)["modes"]["quick"]
    run = compare.Run(tmp_path, "k", "quick", "", "", {"b::t": {"r": (1.3, "lower")}})
    (row,) = compare.compare(run, section)
    assert row.verdict == "REGRESSED" and "rose from 1 to 1.3" in row.message()
    run.figures["b::t"]["r"] = (1.2, "lower")
    assert compare.compare(run, section)[0].verdict == "ok"
    run.figures["b::t"]["r"] = (0.7, "lower")
    assert compare.compare(run, section)[0].verdict == "better"


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert compare.main([str(tmp_path / "nope.json")]) == 2
    assert "nope.json: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    assert compare.main([str(bad)]) == 2
    assert "not a pytest-benchmark JSON run" in capsys.readouterr().err
    bad.write_text("{not json")
    assert compare.main([str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err
    run = _write_run(tmp_path / "run.json", {"a::b": {"op_bw_fraction": 1.0}}, kind="no-such-machine-kind")
    # no baseline for this machine kind: said, and the gate passes (CI on a new kind of machine) …
    assert compare.main([str(run)]) == 0
    assert "no baseline for machine kind 'no-such-machine-kind'" in capsys.readouterr().out
    # … unless a baseline is required, or an explicit one is missing
    assert compare.main([str(run), "--require-baseline"]) == 2
    assert "no-such-machine-kind" in capsys.readouterr().err
    assert compare.main([str(run), "--baseline", str(tmp_path / "missing.json")]) == 2
    not_baseline = tmp_path / "nb.json"
    not_baseline.write_text(json.dumps({"benchmarks": {}}))
    assert compare.main([str(run), "--baseline", str(not_baseline)]) == 2
    assert "not a bitmtp benchmark baseline" in capsys.readouterr().err


def test_machine_kind_format() -> None:
    kind = machine_kind(arch="x86_64", cpu="AMD EPYC 7B13 64-Core Processor", cores=2, isa="avx2", gpu=None)
    assert kind == "x86_64-amd-epyc-7b13-64-core-processor-2c-avx2"
    assert machine_kind(arch="aarch64", cpu="Neoverse", cores=8, isa=None,
                        gpu="NVIDIA H200") == "aarch64-neoverse-8c-nvidia-h200"
    assert slug(machine_kind()) == machine_kind()


def test_cpu_isa_from_flags(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq\n")
    assert cpu_isa(info) == "avx2"  # AVX-512 without VNNI runs the AVX2 kernels
    info.write_text("flags\t: avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni\n")
    assert cpu_isa(info) == "avx512vnni"
    info.write_text("flags\t: sse2 sse4_2\n")
    assert cpu_isa(info) is None


def test_committed_baseline_for_this_machine_kind_is_valid() -> None:
    """Every committed baseline parses and gates figures the suite records (names are fullnames)."""
    files = sorted(compare.BASELINE_DIR.glob("*.json"))
    assert files, "no committed baselines in bench/baselines"
    for path in files:
        data = compare.load_baseline(path)
        assert data["machine_kind"] == path.stem
        for section in data["modes"].values():
            for name in section["benchmarks"]:
                assert name.startswith("bench/") and "::test_" in name, name
                assert Path(compare.BASELINE_DIR.parent.parent, name.split("::")[0]).is_file(), name


def test_update_takes_the_median_and_widens_margins_by_the_spread(tmp_path: Path) -> None:
    name = "bench/x.py::test_y"
    runs = [_write_run(tmp_path / f"r{i}.json", {name: {"op_bw_fraction": v}}) for i, v in enumerate((1.0, 1.2, 1.1))]
    path = tmp_path / "b.json"
    assert compare.main([*map(str, runs), "--update", "--baseline", str(path), "--spread-factor", "2"]) == 0
    spec = json.loads(path.read_text())["modes"]["quick"]["benchmarks"][name]["op_bw_fraction"]
    assert spec["value"] == 1.1 and spec["margin"] == 0.4  # 2 × (1.2 / 1.0 − 1), rounded up to 5%
    # a later update without options keeps the stored margin
    assert compare.main([str(runs[0]), "--update", "--baseline", str(path)]) == 0
    spec = json.loads(path.read_text())["modes"]["quick"]["benchmarks"][name]["op_bw_fraction"]
    assert spec["value"] == 1.0 and spec["margin"] == 0.4


def test_record_rejects_a_gate_without_a_finite_figure() -> None:
    from bench.conftest import record

    class Fake:
        name = "test_fake"
        extra_info: dict = {}

    with pytest.raises(ValueError, match="needs a finite number"):
        record(Fake(), gates={"ratio": "higher"}, ratio=float("nan"))
    with pytest.raises(ValueError, match="direction"):
        record(Fake(), gates={"ratio": "up"}, ratio=1.0)
    record(Fake(), gates={"ratio": "lower"}, ratio=2.0)
    assert Fake.extra_info == {"ratio": 2.0, "gates": {"ratio": "lower"}}
