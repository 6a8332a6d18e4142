"""The benchmark ratio gate (``python -m bench.compare``): a kernel slowed through the registry makes
it fail naming the benchmark and the ratio; an unslowed run passes; bad input is a clear error.

No wall-clock thresholds: the slowed op sleeps 50 ms per call on a kernel of microseconds, so its
bandwidth fraction falls by orders of magnitude, and the gate's margin here is the widest a baseline
may hold, 100% (an unslowed run would have to be 2× slower than the baseline run to fail; the slowed
one is ~100× slower).

The rest builds runs from ``bench/fixtures/quick-run.json`` — one real quick-mode run of the suite
(``pytest bench --benchmark-only --bench-mode quick --benchmark-json``), trimmed to the fields the
gate reads plus a few stats — and checks the gate against the shipped baselines, the
machine-independent floors and the exact oracle figures (``bench/goals.py``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bench import compare
from bench.kernels.op_ratio import OP, benchmark_name, op_vs_copy
from bench.machine import DEFAULT_LLC_BYTES, cpu_isa, last_level_cache_bytes, machine_kind, slug, streaming_bytes
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
    assert compare.main([str(run), "--update", "--baseline", str(path), "--margin", "1.0"]) == 0
    data = json.loads(path.read_text())
    (spec,) = data["modes"]["quick"]["benchmarks"][benchmark_name(_backend(), N, K, M)].values()
    assert spec["direction"] == "higher" and spec["margin"] == 1.0 and spec["value"] > 0
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
    # no baseline for this machine kind: said; the machine-independent checks decide (none apply to a::b) …
    assert compare.main([str(run), "--candidate-dir", str(tmp_path)]) == 0
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


def _cache_tree(root, entries) -> None:
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")


def test_last_level_cache_from_sysfs(tmp_path) -> None:
    """The largest highest-level data/unified cache, in bytes; instruction caches and junk are ignored."""
    intel = tmp_path / "intel"
    _cache_tree(intel, [(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "2048K"),
                        (3, "Unified", "491520K")])
    assert last_level_cache_bytes(intel) == 480 * 2**20
    amd = tmp_path / "amd"
    _cache_tree(amd, [(1, "Data", "32K"), (2, "Unified", "512K"), (3, "Unified", "32M"), (3, "Instruction", "64M")])
    assert last_level_cache_bytes(amd) == 32 * 2**20
    junk = tmp_path / "junk"
    _cache_tree(junk, [(2, "Unified", "1024K"), (3, "Unified", "lots")])
    assert last_level_cache_bytes(junk) == 2**20  # the unreadable L3 is skipped, not guessed
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_streaming_bytes_outgrow_the_cache() -> None:
    """Rotating weight copies total twice the last-level cache (at least 128 MiB, at most the cap), so a
    benchmark's weights stream from memory on a 480 MiB-L3 host as on a 32 MiB one."""
    assert streaming_bytes(llc=32 * 2**20) == 128 * 2**20
    assert streaming_bytes(llc=480 * 2**20) == 960 * 2**20
    assert streaming_bytes(llc=None) == max(128 * 2**20, 2 * DEFAULT_LLC_BYTES)
    assert streaming_bytes(minimum=512 * 2**20, llc=32 * 2**20) == 512 * 2**20
    assert streaming_bytes(llc=64 * 2**30) == 2 * 2**30
    assert streaming_bytes() >= 2 * (last_level_cache_bytes() or DEFAULT_LLC_BYTES) or streaming_bytes() == 2 * 2**30


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
    runs = [_write_run(tmp_path / f"r{i}.json", {name: {"op_bw_fraction": v}}) for i, v in enumerate((1.0, 1.3, 1.1))]
    path = tmp_path / "b.json"
    assert compare.main([*map(str, runs), "--update", "--baseline", str(path), "--spread-factor", "2"]) == 0
    spec = json.loads(path.read_text())["modes"]["quick"]["benchmarks"][name]["op_bw_fraction"]
    # 2 × (1.3 / 1.0 − 1) = 0.6, wider than the 0.45 bench.noise gives op_bw_fraction elsewhere
    assert spec["value"] == 1.1 and spec["margin"] == 0.6 and spec["spread"] == 0.3
    # a later update without options keeps the stored margin
    assert compare.main([str(runs[0]), "--update", "--baseline", str(path)]) == 0
    spec = json.loads(path.read_text())["modes"]["quick"]["benchmarks"][name]["op_bw_fraction"]
    assert spec["value"] == 1.0 and spec["margin"] == 0.6
    # noise that would want a margin above MAX_MARGIN is capped, and the file says which figure
    wild = [_write_run(tmp_path / f"w{i}.json", {name: {"op_bw_fraction": v}}) for i, v in enumerate((1.0, 2.0))]
    assert compare.main([*map(str, wild), "--update", "--baseline", str(path), "--spread-factor", "2"]) == 0
    section = json.loads(path.read_text())["modes"]["quick"]
    assert section["benchmarks"][name]["op_bw_fraction"]["margin"] == compare.MAX_MARGIN
    assert section["capped"] == [f"{name}: op_bw_fraction (spread 100%)"]


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


# --- the gate on real run structure: margins, floors, exact oracle figures, kinds without a baseline ---

FIXTURE = compare.BASELINE_DIR.parent / "fixtures" / "quick-run.json"
#: a machine kind no baseline exists for (the Intel Xeon host with AMX where the old gate checked nothing)
XEON = "x86_64-intel-r-xeon-r-platinum-8480-2c-avx512vnni-amx"
SHIPPED = sorted(p.stem for p in compare.BASELINE_DIR.glob("*.json"))


def _fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def _gated(data: dict) -> list[tuple[str, str, str]]:
    """``(benchmark fullname, figure, direction)`` of every gated figure of a run."""
    return [(b["fullname"], fig, d) for b in data["benchmarks"] for fig, d in b["extra_info"].get("gates", {}).items()]


def _section(kind: str) -> dict:
    return compare.load_baseline(compare.baseline_path(kind))["modes"]["quick"]["benchmarks"]


def _baseline_values(kind: str) -> dict[tuple[str, str], float]:
    return {(name, fig): spec["value"] for name, figs in _section(kind).items() for fig, spec in figs.items()}


def _run_with(path: Path, kind: str, values: dict[tuple[str, str], float], drop_params: bool = False) -> Path:
    """The fixture run stamped with machine ``kind``, its gated figures replaced by ``values``
    (``drop_params``: without the D / new_tokens context the exact oracle check needs)."""
    data = _fixture()
    data["machine_info"]["bitmtp_machine_kind"] = kind
    for b in data["benchmarks"]:
        for fig in b["extra_info"].get("gates", {}):
            if (b["fullname"], fig) in values:
                b["extra_info"][fig] = values[b["fullname"], fig]
        if drop_params:
            b["extra_info"].pop("new_tokens", None)
    path.write_text(json.dumps(data))
    return path


def _good_values() -> dict[tuple[str, str], float]:
    """Every gated figure at the avx512vnni baseline's value (measured on a known machine; meets every floor)."""
    return _baseline_values("x86_64-amd-epyc-2c-avx512vnni")


def _gate(run: Path, tmp_path: Path, capsys, *extra: str) -> tuple[int, str]:
    rc = compare.main([str(run), "--candidate-dir", str(tmp_path / "cand"), *extra])
    return rc, capsys.readouterr().out


def test_fixture_is_a_real_quick_run_with_every_baselined_figure() -> None:
    data = _fixture()
    run = compare.load_run(FIXTURE)
    assert run.mode == "quick" and run.kind == data["machine_info"]["bitmtp_machine_kind"]
    assert all("stats" in b and "fullname" in b for b in data["benchmarks"])
    gated = {(n, f) for n, f, _ in _gated(data)}
    for kind in SHIPPED:
        assert set(_baseline_values(kind)) <= gated, f"{kind}: baseline figures the quick suite no longer records"


@pytest.mark.parametrize("kind", SHIPPED)
def test_run_at_the_baseline_passes(tmp_path: Path, capsys, kind: str) -> None:
    values = _baseline_values(kind)
    rc, out = _gate(_run_with(tmp_path / "run.json", kind, values), tmp_path, capsys)
    assert rc == 0, out
    assert "bench gate passed" in out and "| floor |" in out and "| exact |" in out
    assert not (tmp_path / "cand").exists()  # a kind with a baseline writes no candidate


REGRESSIBLE = [(kind, name, fig) for kind in SHIPPED for name, figs in _section(kind).items()
               for fig, spec in figs.items() if spec["direction"] != "exact"]


@pytest.mark.parametrize("kind,name,fig", REGRESSIBLE,
                         ids=[f"{k.rsplit('-', 1)[1]}-{n.split('::')[1]}-{f}" for k, n, f in REGRESSIBLE])
def test_a_2_5x_regression_of_any_ratio_fails_against_its_baseline(tmp_path: Path, capsys, kind, name, fig) -> None:
    values = _baseline_values(kind)
    spec = _section(kind)[name][fig]
    values[name, fig] = spec["value"] / 2.5 if spec["direction"] == "higher" else spec["value"] * 2.5
    rc, out = _gate(_run_with(tmp_path / "run.json", kind, values), tmp_path, capsys)
    assert rc == 1
    word = "dropped" if spec["direction"] == "higher" else "rose"
    # the baseline comparison itself catches it (not only a floor)
    assert f"  {name}: ratio {fig} {word} from" in out.split("bench gate FAILED")[1]


def _committed(data: dict) -> list[tuple[str, str, str, str, int, int]]:
    """``(benchmark, figure, policy, count, D, new_tokens)`` of every oracle committed-token figure of a
    run (count: ``mean`` per iteration, or ``full``: what one full iteration commits)."""
    from bench.goals import ORACLE_FIGURES, test_of

    out = []
    for b in data["benchmarks"]:
        for fig, (policy, count) in ORACLE_FIGURES.get(test_of(b["fullname"]), {}).items():
            if fig in b["extra_info"]:
                out.append((b["fullname"], fig, policy, count, b["extra_info"]["D"], b["extra_info"]["new_tokens"]))
    return out


COMMITTED = _committed(_fixture())
_IDS = [f"{n.split('[')[1][:-1]}-{f}" for n, f, *_ in COMMITTED]


def _by_hand(policy: str, count: str, block: int, new: int, delta: int = 0) -> float:
    """The oracle's count, written out again here: iterations commit ``per`` tokens each (D + 1 with the
    bonus token, D for hybrid confidence commits) until the ``new − 1`` after the prefill's are done;
    ``delta`` tokens more or fewer."""
    per = block if policy == "hybrid" else block + 1
    left, commits = new - 1, []
    while left > 0:
        commits.append(min(per, left))
        left -= commits[-1]
    if count == "full":
        return float(max(commits) + delta)
    return (sum(commits) + delta) / len(commits)


def test_oracle_committed_formula_matches_the_real_run() -> None:
    """The gate's independent token counts equal what the runtime committed in the recorded run."""
    from bench.goals import exact_expectation

    data = _fixture()
    extra = {b["fullname"]: b["extra_info"] for b in data["benchmarks"]}
    assert len(COMMITTED) == 18  # speculative / hybrid / hybrid τ=1 at D = 2, 4, 8, mean and full iteration
    for name, fig, policy, count, block, new in COMMITTED:
        expected, why = exact_expectation(name, fig, extra[name])
        assert expected == pytest.approx(_by_hand(policy, count, block, new), rel=1e-12)
        assert extra[name][fig] == pytest.approx(expected, rel=1e-12), (name, fig, why)
        assert extra[name]["gates"][fig] == "exact"


@pytest.mark.parametrize("delta", (-1, 1))
@pytest.mark.parametrize("kind", [SHIPPED[-1], XEON])
@pytest.mark.parametrize("name,fig,policy,count,block,new", COMMITTED, ids=_IDS)
def test_a_committed_figure_off_by_one_token_fails(tmp_path, capsys, name, fig, policy, count, block, new, kind,
                                                   delta):
    values = _good_values()
    values[name, fig] = _by_hand(policy, count, block, new, delta)
    rc, out = _gate(_run_with(tmp_path / "run.json", kind, values), tmp_path, capsys)
    assert rc == 1
    failure = out.split("bench gate FAILED")[1]
    assert f"{name}: {fig} = " in failure and "expected exactly" in failure
    if kind == XEON:
        assert "computed: oracle drafter" in failure and not (tmp_path / "cand").exists()


@pytest.mark.parametrize("block", (2, 4, 8))
def test_dropping_the_bonus_token_fails_with_and_without_run_parameters(tmp_path, capsys, block: int) -> None:
    """What a runtime that loses v_D records: speculative and hybrid τ=1 commit D per iteration. At D = 8
    with 24 new tokens the mean is unchanged (9+9+5 vs 8+8+7): the full-iteration count catches it."""
    name = f"bench/e2e/test_bench_policies.py::test_policies_over_ar[D{block}]"
    values = _good_values()
    for label in ("speculative", "hybrid_verify"):
        values[name, f"{label}_committed"] = _by_hand("hybrid", "mean", block, 24)
        values[name, f"{label}_committed_full"] = _by_hand("hybrid", "full", block, 24)
    for kind, drop in ((XEON, False), (SHIPPED[-1], False), (SHIPPED[-1], True)):
        rc, out = _gate(_run_with(tmp_path / "run.json", kind, values, drop_params=drop), tmp_path, capsys)
        assert rc == 1, (kind, drop)
        failure = out.split("bench gate FAILED")[1]
        assert f"{name}: speculative_committed_full = {block}, expected exactly {block + 1}" in failure
        # without new_tokens the gate cannot compute the counts; the baseline's exact entries still catch it
        assert ("(baseline, exact)" if drop else "(computed: oracle drafter") in failure


def _floored(data: dict) -> list[tuple[str, str, float, str]]:
    from bench.goals import bound_for

    extra = {b["fullname"]: b["extra_info"] for b in data["benchmarks"]}
    out = []
    for name, fig, _ in _gated(data):
        bound = bound_for(name, fig, extra[name])
        if bound is not None:
            out.append((name, fig, bound[0], bound[1]))
    return out


FLOORED = _floored(_fixture())


def test_every_kind_of_quick_figure_has_a_machine_independent_check() -> None:
    """Bandwidth fractions, speedups, policy-over-AR ratios, widths and committed tokens all have one;
    only the pure-torch reference's slowness (no goal: it defines results, it is not a fast path) has none."""
    checked = {(n, f) for n, f, *_ in FLOORED} | {(n, f) for n, f, *_ in COMMITTED}
    unchecked = {f for n, f, _ in _gated(_fixture()) if (n, f) not in checked}
    assert unchecked == {"ref_over_f32"}
    assert {f for _, f, _, d in FLOORED if d == "higher"} >= {"bw_fraction", "op_bw_fraction", "speedup_vs_f32",
                                                             "speculative_over_ar", "hybrid_over_ar", "speedup_ar"}


def test_unknown_kind_with_every_floor_met_passes_and_writes_a_candidate(tmp_path: Path, capsys) -> None:
    run = _run_with(tmp_path / "run.json", XEON, _good_values())
    rc, out = _gate(run, tmp_path, capsys)
    assert rc == 0, out
    candidate = tmp_path / "cand" / f"candidate-{XEON}.json"
    assert f"no baseline for machine kind '{XEON}'" in out and str(candidate) in out
    assert f"cp {candidate} {compare.baseline_path(XEON)}" in out and "--update --baseline" in out
    assert "--spread-factor" not in out  # a committed baseline keeps bench/noise.py's margins
    assert "| baseline |" not in out and out.count("| floor |") == len(FLOORED)
    data = compare.load_baseline(candidate)
    assert data["machine_kind"] == XEON
    section = data["modes"]["quick"]["benchmarks"]
    good = _good_values()
    for name, fig, direction in _gated(_fixture()):
        spec = section[name][fig]
        assert spec["direction"] == direction
        if (name, fig) in good:
            assert spec["value"] == pytest.approx(good[name, fig], rel=1e-6)
        assert spec["margin"] == (0.0 if direction == "exact" else pytest.approx(spec["margin"]))
        assert 0 <= spec["margin"] <= compare.MAX_MARGIN
    # adopted, the candidate gates the same run
    assert compare.main([str(run), "--baseline", str(candidate)]) == 0


@pytest.mark.parametrize("name,fig,bound,direction", FLOORED,
                         ids=[f"{n.split('::')[1]}-{f}" for n, f, *_ in FLOORED])
def test_unknown_kind_with_a_ratio_past_its_floor_fails(tmp_path: Path, capsys, name, fig, bound, direction) -> None:
    values = _good_values()
    values[name, fig] = bound * (0.98 if direction == "higher" else 1.02)
    rc, out = _gate(_run_with(tmp_path / "run.json", XEON, values), tmp_path, capsys)
    assert rc == 1
    side = "under its floor" if direction == "higher" else "over its ceiling"
    assert f"  {name}: {fig} = " in out and side in out
    assert "no candidate baseline written" in out and not (tmp_path / "cand").exists()
    # exactly at the bound passes
    values[name, fig] = bound
    assert _gate(_run_with(tmp_path / "run.json", XEON, values), tmp_path, capsys)[0] == 0


@pytest.mark.parametrize("kind", [*SHIPPED, XEON])
def test_speculative_over_ar_d8_at_0_27_fails(tmp_path: Path, capsys, kind: str) -> None:
    name = "bench/e2e/test_bench_policies.py::test_policies_over_ar[D8]"
    values = _good_values() if kind == XEON else _baseline_values(kind)
    values[name, "speculative_over_ar"] = 0.27
    rc, out = _gate(_run_with(tmp_path / "run.json", kind, values), tmp_path, capsys)
    assert rc == 1
    failure = out.split("bench gate FAILED")[1]
    assert f"{name}: speculative_over_ar = 0.27 is under its floor 1" in failure
    if kind != XEON:
        assert f"{name}: ratio speculative_over_ar dropped from" in failure


@pytest.mark.parametrize("kind", SHIPPED)
def test_shipped_baselines_hold_noise_sized_margins_and_meet_their_floors(kind: str) -> None:
    from bench.goals import bound_for, oracle_committed
    from bench.noise import margin_for

    extra = {b["fullname"]: b["extra_info"] for b in _fixture()["benchmarks"]}
    for name, figs in _section(kind).items():
        for fig, spec in figs.items():
            assert spec["margin"] == margin_for(name, fig, spec["direction"])[0], (name, fig)
            assert spec["margin"] <= compare.MAX_MARGIN  # (1 + margin) < 2.5: a 2.5x regression fails
            bound = bound_for(name, fig, extra[name])
            if bound is not None:
                assert (spec["value"] >= bound[0]) if bound[1] == "higher" else (spec["value"] <= bound[0]), (name, fig)
            if fig.endswith("_committed"):
                policy = fig.removesuffix("_committed")
                assert spec["direction"] == "exact"
                assert spec["value"] == pytest.approx(oracle_committed(policy, extra[name]["D"],
                                                                       extra[name]["new_tokens"]), abs=1e-6)


def test_margins_come_from_the_recorded_noise() -> None:
    from bench import noise

    # the q6 run recovered from its median reproduces BENCHMARKS.md's spread table
    d8 = "bench/e2e/test_bench_policies.py::test_policies_over_ar[D8]"
    assert round(noise.spread(noise.OBSERVATIONS[d8, "speculative_over_ar"]), 2) == 0.54
    assert round(noise.spread(noise.OBSERVATIONS[d8, "hybrid_over_ar"]), 2) == 0.47
    bw = "bench/kernels/test_bench_cpu_kernels.py::test_cpu_m1_bandwidth_fraction[2560x6912]"
    assert round(noise.spread(noise.OBSERVATIONS[bw, "bw_fraction"]), 2) == 0.71
    # spread within an epoch only: a code change between epochs is not noise
    assert noise.spread([{"a": 1.0, "b": 1.1}, {"c": 2.0, "d": 2.1}]) == pytest.approx(0.1)
    assert [noise.margin_from_spread(s) for s in (0.0, 0.11, 0.128, 0.3, 0.54)] == [0.5, 0.5, 0.5, 0.6, 1.0]
    assert noise.margin_for("bench/x.py::test_new", "speedup_ar", "higher")[1] is None
    assert noise.margin_for("bench/x.py::test_new", "committed", "exact") == (0.0, 0.0)


def test_a_baseline_margin_that_lets_a_2x_regression_pass_is_rejected(tmp_path: Path, capsys) -> None:
    base = {"modes": {"quick": {"benchmarks": {"b::t": {"r": {"value": 1.0, "direction": "higher", "margin": 1.2}}}}}}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(base))
    run = _write_run(tmp_path / "run.json", {"b::t": {"op_bw_fraction": 1.0}})
    assert compare.main([str(run), "--baseline", str(path)]) == 2
    err = capsys.readouterr().err
    assert "modes.quick.b::t.r: margin 1.2 lets a 2.2x regression pass" in err and "bench.noise --apply" in err
    assert compare.main([str(run), "--baseline", str(path), "--margin", "1.5"]) == 2
    assert "--margin 1.5" in capsys.readouterr().err


def test_exact_direction_and_runs_that_disagree_on_an_exact_figure(tmp_path: Path) -> None:
    base = {"modes": {"quick": {"benchmarks": {"b::t": {"c": {"value": 2.875, "direction": "exact", "margin": 0}}}}}}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(base))
    section = compare.load_baseline(path)["modes"]["quick"]
    run = compare.Run(tmp_path, "k", "quick", "", "", {"b::t": {"c": (2.875000001, "exact")}})
    assert compare.compare(run, section)[0].verdict == "ok"
    for off in (23 / 8 + 1 / 8, 23 / 8 - 1 / 8, 3.0):  # a token more or less, or a wrong iteration count
        run.figures["b::t"]["c"] = (off, "exact")
        assert compare.compare(run, section, margin=1.0)[0].verdict == "REGRESSED"  # --margin never loosens it
    runs = [compare.Run(tmp_path, "k", "quick", "", "", {"b::t": {"c": (v, "exact")}}) for v in (2.875, 1.9166)]
    with pytest.raises(compare.BitMTPError, match="exact figure c differs between the runs"):
        compare.update_baseline(runs, tmp_path / "new.json")


def test_a_failed_gate_names_its_benchmarks_and_a_rerun_of_them_replaces_their_figures(tmp_path: Path,
                                                                                        capsys) -> None:
    """CI reruns only the benchmarks a failed gate named (``--failed-ids``) and gates the run with their rerun
    (``--retry``): a rerun that recovers passes, one that does not still fails, a rerun from elsewhere is refused."""
    slow, fine = "bench/a.py::test_a[x]", "bench/b.py::test_b"
    base = _write_run(tmp_path / "base.json", {slow: {"op_bw_fraction": 1.0}, fine: {"op_bw_fraction": 1.0}})
    baseline = tmp_path / "baseline.json"
    assert compare.main([str(base), "--update", "--baseline", str(baseline), "--margin", "0.25"]) == 0
    run = _write_run(tmp_path / "run.json", {slow: {"op_bw_fraction": 0.5}, fine: {"op_bw_fraction": 1.1}})
    ids = tmp_path / "failed.txt"
    assert compare.main([str(run), "--baseline", str(baseline), "--failed-ids", str(ids)]) == 1
    assert ids.read_text() == f"{slow}\n"
    capsys.readouterr()
    good = _write_run(tmp_path / "good.json", {slow: {"op_bw_fraction": 0.95}})
    assert compare.main([str(run), "--baseline", str(baseline), "--retry", str(good)]) == 0
    out = capsys.readouterr().out
    assert "1 benchmark(s) from the rerun" in out and "| 0.95 |" in out and "| 1.1 |" in out
    bad = _write_run(tmp_path / "bad.json", {slow: {"op_bw_fraction": 0.6}})
    assert compare.main([str(run), "--baseline", str(baseline), "--retry", str(bad)]) == 1
    # the rerun replaces whole benchmarks: one that no longer records its figure is MISSING, not the old value
    empty = _write_run(tmp_path / "empty.json", {slow: {}})
    data = json.loads(empty.read_text())
    data["benchmarks"][0]["extra_info"] = {}
    empty.write_text(json.dumps(data))
    assert compare.main([str(run), "--baseline", str(baseline), "--retry", str(empty)]) == 1
    assert "was not measured" in capsys.readouterr().out
    other = _write_run(tmp_path / "other.json", {slow: {"op_bw_fraction": 0.95}}, kind="other-kind")
    assert compare.main([str(run), "--baseline", str(baseline), "--retry", str(other)]) == 2
    assert "--retry" in capsys.readouterr().err
