"""Ratio regression gate over pytest-benchmark JSON runs.

Absolute times on a shared machine are noise (this project's CI host switches its memory bandwidth
between ~76 and ~44 GB/s for minutes at a time), so the gate compares *ratios* each benchmark
measured within its own run — kernel bandwidth over measured copy bandwidth, time at width M over
width 1, hybrid tokens/s over AR tokens/s — against a baseline stored per machine kind
(``bench/baselines/<kind>.json``, kind from :mod:`bench.machine`). A figure's margin is a factor:
it may move at most ``(1 + margin)×`` the wrong way (margins sized from measured run-to-run noise,
:mod:`bench.noise`, and never above :data:`MAX_MARGIN`, so a 2.5× regression always fails); figures
gated ``exact`` (oracle token counts) must equal the baseline.

Every run, with a baseline or without, is also held to machine-independent checks
(:mod:`bench.goals`): floors and ceilings from the goals (bandwidth fractions, speedups ≥ 1, widths)
and the oracle's committed-token figures, computed independently. A machine kind (or mode) with no
baseline is gated by those alone, and the run is written as a candidate baseline for that kind,
``bench/out/candidate-<kind>.json``, with the command that adopts it.

Input is what ``pytest bench --benchmark-only --benchmark-json RUN.json`` writes (or a run saved with
``--benchmark-save``/``--benchmark-autosave``, the files ``--benchmark-compare`` reads: same format).
Each benchmark's ``extra_info`` holds its figures and, under ``gates``, which of them are gated and
which way is better (``bench.conftest.record``). ``--benchmark-compare`` shows time columns; this
command shows what the gate decides on.

Usage::

    python -m bench.compare RUN.json                     # gate against bench/baselines/<kind>.json
    python -m bench.compare RUN.json --baseline FILE     # an explicit baseline
    python -m bench.compare RUN1.json RUN2.json --spread # run-to-run spread of every gated figure
    python -m bench.compare RUN1.json [RUN2.json …] --update   # write the baseline (margins: bench/noise.py)
    python -m bench.compare RUN.json --failed-ids F.txt  # a failing gate names its benchmarks' node ids in F.txt
    python -m bench.compare RUN.json --retry RERUN.json  # ... rerun those alone; their figures replace RUN's

Exit status: 0 the gate passes (with no baseline for this machine kind and mode: the
machine-independent checks pass, unless ``--require-baseline``), 1 a gated figure regressed beyond
its margin, fell under its floor (over its ceiling), differs from its exact value, or a baseline
figure was not measured; 2 bad input (the message says what).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.goals import EXACT, EXACT_TOL, bound_for, exact_expectation
from bench.noise import BASELINE_DIR, MAX_MARGIN, margin_for
from bitmtp.errors import BitMTPError

CANDIDATE_DIR = Path(__file__).resolve().parent / "out"
DEFAULT_MARGIN = 0.25
FOREIGN_LOAD_WARN = 0.25  # as bench.conftest.FOREIGN_LOAD_WARN
DIRECTIONS = ("higher", "lower", EXACT)
FAILED = ("REGRESSED", "MISSING", "UNDER FLOOR", "OVER CEILING", "WRONG")


@dataclass
class Run:
    """The gated figures of one pytest-benchmark JSON run."""

    path: Path
    kind: str | None
    mode: str
    datetime: str
    commit: str
    #: benchmark fullname -> figure -> (value, direction)
    figures: dict[str, dict[str, tuple[float, str]]] = field(default_factory=dict)
    #: mean cores other processes kept busy during the run (bench/conftest.py), if recorded
    foreign_load: float | None = None
    #: benchmark fullname -> its whole extra_info (parameters such as D, M, new_tokens)
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Row:
    """One check of one figure. ``check``: ``baseline`` (against the stored value within its margin),
    ``floor`` (a machine-independent floor or ceiling, :mod:`bench.goals`; ``baseline`` holds the
    bound) or ``exact`` (an independently computed exact value, held in ``baseline``)."""

    benchmark: str
    figure: str
    direction: str
    margin: float
    baseline: float | None
    now: float | None
    verdict: str
    check: str = "baseline"
    why: str = ""

    @property
    def delta(self) -> float | None:
        if self.baseline is None or self.now is None or self.baseline == 0:
            return None
        return self.now / self.baseline - 1.0

    @property
    def failed(self) -> bool:
        return self.verdict in FAILED

    def message(self) -> str:
        if self.verdict == "MISSING":
            return (f"{self.benchmark}: gated ratio {self.figure} was not measured in this run "
                    f"(baseline {self.baseline:.4g}; skipped or failed benchmark?)")
        if self.verdict in ("UNDER FLOOR", "OVER CEILING"):
            side = "under its floor" if self.verdict == "UNDER FLOOR" else "over its ceiling"
            return (f"{self.benchmark}: {self.figure} = {self.now:.4g} is {side} {self.baseline:.4g} "
                    f"(machine-independent: {self.why})")
        if self.direction == EXACT:
            source = f"computed: {self.why}" if self.check == "exact" else "baseline, exact"
            return (f"{self.benchmark}: {self.figure} = {self.now:.6g}, expected exactly {self.baseline:.6g} "
                    f"({source}); a committed-token count changed: a runtime bug, not noise")
        word = "dropped" if self.direction == "higher" else "rose"
        return (f"{self.benchmark}: ratio {self.figure} {word} from {self.baseline:.4g} to {self.now:.4g} "
                f"({self.delta:+.1%}; {self.direction} is better, margin {self.margin:.0%}: at most "
                f"{1 + self.margin:.2f}x {'lower' if self.direction == 'higher' else 'higher'})")


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise BitMTPError(f"{path}: no such file (write one with: pytest bench --benchmark-only "
                          f"--benchmark-json {path})")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BitMTPError(f"{path}: not JSON ({exc})") from exc


def load_run(path: str | Path) -> Run:
    """Read a pytest-benchmark JSON run; :class:`BitMTPError` says what is wrong with a bad one."""
    path = Path(path)
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list) \
            or not isinstance(data.get("machine_info"), dict):
        raise BitMTPError(f"{path}: not a pytest-benchmark JSON run (expected 'machine_info' and a 'benchmarks' "
                          f"list, as written by --benchmark-json)")
    mi = data["machine_info"]
    commit = data.get("commit_info") or {}
    run = Run(path, mi.get("bitmtp_machine_kind"), mi.get("bitmtp_bench_mode", "quick"), str(data.get("datetime", "")),
              str(commit.get("id", "")) if isinstance(commit, dict) else "",
              foreign_load=mi.get("bitmtp_foreign_load"))
    for i, b in enumerate(data["benchmarks"]):
        if not isinstance(b, dict) or not isinstance(b.get("extra_info", {}), dict) \
                or not (b.get("fullname") or b.get("name")):
            raise BitMTPError(f"{path}: benchmarks[{i}] is not a pytest-benchmark entry (no name or extra_info)")
        name = b.get("fullname") or b["name"]
        extra = b.get("extra_info", {})
        gates = extra.get("gates", {})
        if not isinstance(gates, dict):
            raise BitMTPError(f"{path}: {name}: extra_info.gates must map figure -> 'higher'/'lower'")
        figs = {}
        for fig, direction in gates.items():
            value = extra.get(fig)
            if direction not in DIRECTIONS or not isinstance(value, (int, float)) or isinstance(value, bool):
                raise BitMTPError(f"{path}: {name}: gated figure {fig!r} needs a number and a direction in "
                                  f"{DIRECTIONS}, got {value!r} / {direction!r}")
            figs[fig] = (float(value), direction)
        if figs:
            run.figures[name] = figs
        run.extra[name] = extra
    return run


def baseline_path(kind: str) -> Path:
    return BASELINE_DIR / f"{kind}.json"


def load_baseline(path: str | Path) -> dict[str, Any]:
    """Read a baseline file (see :func:`update_baseline` for its layout)."""
    path = Path(path)
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("modes"), dict):
        raise BitMTPError(f"{path}: not a bitmtp benchmark baseline (expected a 'modes' object; write one with "
                          f"python -m bench.compare RUN.json --update)")
    for mode, section in data["modes"].items():
        benches = section.get("benchmarks") if isinstance(section, dict) else None
        if not isinstance(benches, dict):
            raise BitMTPError(f"{path}: modes.{mode} has no 'benchmarks' object")
        for name, figs in benches.items():
            for fig, spec in figs.items():
                ok = isinstance(spec, dict) and isinstance(spec.get("value"), (int, float)) \
                    and spec.get("direction") in DIRECTIONS and isinstance(spec.get("margin"), (int, float)) \
                    and 0 <= spec["margin"]
                if not ok:
                    raise BitMTPError(f"{path}: modes.{mode}.{name}.{fig}: expected value, direction "
                                      f"({'/'.join(DIRECTIONS)}) and margin (a fraction, e.g. 0.25), got {spec!r}")
                if spec["margin"] > MAX_MARGIN:
                    raise BitMTPError(f"{path}: modes.{mode}.{name}.{fig}: margin {spec['margin']} lets a "
                                      f"{1 + spec['margin']:.1f}x regression pass (at most {MAX_MARGIN}); make the "
                                      f"benchmark less noisy, or rewrite the margins: python -m bench.noise --apply")
    return data


def with_retry(run: Run, retry: Run) -> Run:
    """``run`` with the figures of the benchmarks ``retry`` reran replacing its own (CI reruns only the benchmarks a
    failed gate named: a burst of outside load seldom hits the same benchmark twice). The rerun must be of the same
    machine kind and mode."""
    if (retry.kind, retry.mode) != (run.kind, run.mode):
        raise BitMTPError(f"--retry {retry.path}: machine kind / mode {retry.kind!r} / {retry.mode!r}, but the run "
                          f"{run.path} is {run.kind!r} / {run.mode!r}: rerun on the same machine in the same mode")
    if not retry.extra:
        raise BitMTPError(f"--retry {retry.path}: the rerun holds no benchmarks")
    figures = {name: figs for name, figs in run.figures.items() if name not in retry.extra}
    figures.update(retry.figures)
    extra = {**run.extra, **retry.extra}
    loads = [x for x in (run.foreign_load, retry.foreign_load) if x is not None]
    print(f"bench.compare: {len(retry.extra)} benchmark(s) from the rerun {retry.path} replace the run's")
    return Run(run.path, run.kind, run.mode, run.datetime, run.commit, figures, max(loads) if loads else None, extra)


def verdict(value: float, base: float, direction: str, margin: float) -> str:
    """``REGRESSED``, ``ok`` or ``better`` for ``value`` against ``base``. Margins are factors: higher
    is better regresses below ``base / (1 + margin)``, lower is better above ``base × (1 + margin)``;
    ``exact`` regresses off ``base`` by more than :data:`~bench.goals.EXACT_TOL` (relative)."""
    if direction == EXACT:
        return "REGRESSED" if abs(value - base) > EXACT_TOL * max(1.0, abs(base)) else "ok"
    if direction == "higher":
        return "REGRESSED" if value < base / (1 + margin) else "better" if value > base * (1 + margin) else "ok"
    return "REGRESSED" if value > base * (1 + margin) else "better" if value < base / (1 + margin) else "ok"


def compare(run: Run, section: dict[str, Any], margin: float | None = None) -> list[Row]:
    """One :class:`Row` per gated figure of the baseline ``section`` (and per new gated figure of the run).
    ``margin`` replaces every figure's stored margin when given."""
    rows = []
    for name, figs in section["benchmarks"].items():
        for fig, spec in figs.items():
            m = spec["margin"] if margin is None else margin
            base, direction = float(spec["value"]), spec["direction"]
            now = run.figures.get(name, {}).get(fig)
            if now is None:
                rows.append(Row(name, fig, direction, m, base, None, "MISSING"))
                continue
            m = 0.0 if direction == EXACT else m
            rows.append(Row(name, fig, direction, m, base, now[0], verdict(now[0], base, direction, m)))
    for name, figs in run.figures.items():
        for fig, (value, direction) in figs.items():
            if fig not in section["benchmarks"].get(name, {}):
                rows.append(Row(name, fig, direction, DEFAULT_MARGIN if margin is None else margin, None, value, "new"))
    return rows


def machine_independent(run: Run) -> list[Row]:
    """The checks that hold on every machine (:mod:`bench.goals`): one ``floor`` row per gated figure
    that has a floor or ceiling, one ``exact`` row per figure whose exact value the gate computes."""
    rows = []
    for name, figs in run.figures.items():
        extra = run.extra.get(name, {})
        for fig, (value, _direction) in figs.items():
            bound = bound_for(name, fig, extra)
            if bound is not None:
                b, d, why = bound
                bad = value < b if d == "higher" else value > b
                word = "UNDER FLOOR" if d == "higher" else "OVER CEILING"
                rows.append(Row(name, fig, d, 0.0, b, value, word if bad else "ok", "floor", why))
            exact = exact_expectation(name, fig, extra)
            if exact is not None:
                e, why = exact
                rows.append(Row(name, fig, EXACT, 0.0, e, value, "WRONG" if verdict(value, e, EXACT, 0.0) != "ok"
                                else "ok", "exact", why))
    return rows


def format_table(rows: list[Row]) -> str:
    """The ratio-delta table (Markdown)."""
    out = ["| benchmark | figure | check | better | baseline / bound | now | delta % | margin | verdict |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = "" if r.baseline is None else f"{r.baseline:.4g}"
        now = "" if r.now is None else f"{r.now:.4g}"
        delta = "" if r.delta is None else f"{r.delta * 100:+.1f}"
        margin = "" if r.check != "baseline" or r.direction == EXACT else f"{r.margin:.0%}"
        out.append(f"| {r.benchmark} | {r.figure} | {r.check} | {r.direction} | {base} | {now} | {delta} | {margin} "
                   f"| {r.verdict} |")
    return "\n".join(out)


def spread(runs: list[Run]) -> list[tuple[str, str, float, float, float]]:
    """``(benchmark, figure, min, max, max/min - 1)`` per gated figure measured in every run."""
    out = []
    first = runs[0]
    for name, figs in first.figures.items():
        for fig in figs:
            vals = [r.figures.get(name, {}).get(fig, (None,))[0] for r in runs]
            if any(v is None for v in vals):
                continue
            lo, hi = min(vals), max(vals)
            out.append((name, fig, lo, hi, (hi / lo - 1) if lo > 0 else float("inf")))
    return out


def update_baseline(runs: list[Run], path: Path, margin: float | None = None,
                    spread_factor: float | None = None) -> dict[str, Any]:
    """Write (or update) the baseline at ``path`` from ``runs`` (one machine kind, one mode): each gated
    figure's value is the median over the runs. Its margin is ``margin`` if given, else the margin
    already stored for it, else the one :func:`bench.noise.margin_for` sizes from the noise measured on
    known kinds — widened, with ``spread_factor`` and several runs, to ``spread_factor`` × the
    figure's observed spread (max/min − 1), rounded up to 5%; never above :data:`MAX_MARGIN`
    (``spread`` records the observed spread; ``capped`` the figures whose noise wanted more).
    ``exact`` figures get margin 0, and runs that disagree on one are an error. Other modes in the
    file are kept."""
    kinds = {r.kind for r in runs}
    modes = {r.mode for r in runs}
    if len(modes) != 1:
        raise BitMTPError(f"--update: runs of different modes ({', '.join(sorted(modes))}); one mode per update")
    if len(kinds) != 1:
        raise BitMTPError(f"--update: runs of different machine kinds ({', '.join(sorted(map(str, kinds)))})")
    mode = modes.pop()
    kind = kinds.pop()
    data = load_baseline(path) if path.exists() else {"machine_kind": kind, "modes": {}}
    old = data["modes"].get(mode, {}).get("benchmarks", {})
    benches: dict[str, dict[str, Any]] = {}
    capped = []
    for name in runs[0].figures:
        for fig, (_, direction) in runs[0].figures[name].items():
            vals = [r.figures[name][fig][0] for r in runs if fig in r.figures.get(name, {})]
            spec: dict[str, Any] = {"value": round(statistics.median(vals), 6), "direction": direction}
            if direction == EXACT:
                if max(vals) - min(vals) > 1e-9 * max(1.0, abs(max(vals))):
                    raise BitMTPError(f"--update: {name}: exact figure {fig} differs between the runs ({vals}): "
                                      f"a token count that changes from run to run is a bug to fix, not a baseline")
                m = 0.0
            elif margin is not None:
                m = margin
            elif "margin" in old.get(name, {}).get(fig, {}):
                m = old[name][fig]["margin"]
            else:
                m = margin_for(name, fig, direction)[0]
            if direction != EXACT and len(vals) > 1 and min(vals) > 0:
                s = max(vals) / min(vals) - 1
                spec["spread"] = round(s, 4)
                if spread_factor:
                    wide = math.ceil(round(spread_factor * s * 20, 9)) / 20
                    if wide > MAX_MARGIN:
                        capped.append(f"{name}: {fig} (spread {s:.0%})")
                    m = min(MAX_MARGIN, max(m, wide))
            spec["margin"] = m
            benches.setdefault(name, {})[fig] = spec
    data["machine_kind"] = kind
    data["modes"][mode] = {
        "updated": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "source": {"runs": len(runs), "commit": runs[0].commit, "datetime": [r.datetime for r in runs]},
        "margins": "a figure may move (1 + margin)x the wrong way; see bench/noise.py for how margins are sized",
        "benchmarks": benches,
    }
    if capped:
        data["modes"][mode]["capped"] = capped
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return data


def candidate_path(kind: str, directory: Path = CANDIDATE_DIR) -> Path:
    """Where a run on a machine kind without a baseline leaves its candidate baseline."""
    return directory / f"candidate-{kind}.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="pytest-benchmark JSON run(s) (--benchmark-json output)")
    p.add_argument("--baseline", type=Path, help="baseline file (default: bench/baselines/<run's machine kind>.json)")
    p.add_argument("--margin", type=float, help="replace every figure's margin (a fraction: 0.25 = 25%%)")
    p.add_argument("--update", action="store_true", help="write/update the baseline from the run(s) instead")
    p.add_argument("--spread", action="store_true", help="print the run-to-run spread of the gated figures")
    p.add_argument("--spread-factor", type=float,
                   help="with --update and several runs: widen each margin to this × the figure's observed spread "
                        "(local experiments: a committed baseline keeps bench/noise.py's margins)")
    p.add_argument("--require-baseline", action="store_true", help="fail (exit 2) when no baseline exists")
    p.add_argument("--candidate-dir", type=Path, default=CANDIDATE_DIR,
                   help="where a run without a baseline writes candidate-<kind>.json (default: bench/out)")
    p.add_argument("--failed-ids", type=Path,
                   help="when the gate fails, write the failing benchmarks' pytest node ids here, one a line (to rerun "
                        "only them: pytest $(cat FILE) ... --benchmark-json RETRY.json)")
    p.add_argument("--retry", type=Path,
                   help="a rerun of some of the run's benchmarks (pytest-benchmark JSON): its benchmarks' figures "
                        "replace the run's before the gate checks them")
    args = p.parse_args(argv)
    try:
        return _main(args)
    except BitMTPError as exc:
        print(f"bench.compare: error: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    if args.margin is not None and not 0 <= args.margin <= MAX_MARGIN:
        raise BitMTPError(f"--margin {args.margin}: expected a fraction from 0 to {MAX_MARGIN} such as 0.25 (a "
                          f"figure may move (1 + margin)x the wrong way)")
    runs = [load_run(p) for p in args.runs]
    if args.spread:
        for r in runs:
            print(f"{r.path}: foreign load {r.foreign_load if r.foreign_load is not None else 'not recorded'}")
        print("| benchmark | figure | min | max | spread % |\n|---|---|---|---|---|")
        for name, fig, lo, hi, s in spread(runs):
            print(f"| {name} | {fig} | {lo:.4g} | {hi:.4g} | {s * 100:.1f} |")
        return 0
    kind = runs[0].kind
    if args.baseline is None and kind is None:
        raise BitMTPError(f"{runs[0].path}: the run names no machine kind (not written by bench/conftest.py?); "
                          f"pass --baseline")
    path = args.baseline or baseline_path(kind)
    if args.update:
        for r in runs:
            if r.foreign_load is not None and r.foreign_load > FOREIGN_LOAD_WARN:
                print(f"warning: {r.path}: other processes kept {r.foreign_load:.2f} cores busy during the run")
        if not any(r.figures for r in runs):
            raise BitMTPError("--update: the run(s) hold no gated figures (was it run with --benchmark-disable?)")
        data = update_baseline(runs, path, args.margin, args.spread_factor)
        n = sum(len(f) for f in data["modes"][runs[0].mode]["benchmarks"].values())
        print(f"wrote {path}: {n} gated figures, mode {runs[0].mode}, machine kind {data['machine_kind']}")
        return 0
    if len(runs) > 1:
        raise BitMTPError("compare takes one run (several only with --update or --spread)")
    run = runs[0]
    if args.retry is not None:
        run = with_retry(run, load_run(args.retry))
    if not run.figures:
        raise BitMTPError(f"{run.path}: no gated figures in this run (run with --benchmark-only, not "
                          f"--benchmark-disable)")
    section = None
    if path.exists():
        baseline = load_baseline(path)
        section = baseline["modes"].get(run.mode)
        if section is None:
            msg = f"{path}: no {run.mode!r}-mode baseline (modes: {', '.join(baseline['modes']) or 'none'})"
            if args.require_baseline:
                raise BitMTPError(msg)
            print(f"bench.compare: {msg}")
        elif kind is not None and baseline.get("machine_kind") not in (None, kind):
            print(f"bench.compare: note: baseline is for machine kind {baseline['machine_kind']!r}, this run {kind!r}")
    elif args.baseline is not None or args.require_baseline:
        raise BitMTPError(f"{path}: no baseline for machine kind {kind!r}; record one with "
                          f"python -m bench.compare {run.path} --update")
    else:
        print(f"bench.compare: no baseline for machine kind {kind!r} ({path} does not exist)")
    rows = compare(run, section, args.margin) if section is not None else []
    rows += machine_independent(run)
    against = f"against {path} and" if section is not None else "against"
    print(f"ratio gate: {run.path} (mode {run.mode}, machine kind {kind}) {against} the machine-independent "
          f"floors and exact figures (bench/goals.py)")
    if run.foreign_load is not None and run.foreign_load > FOREIGN_LOAD_WARN:
        print(f"warning: other processes kept {run.foreign_load:.2f} cores busy during this run: its ratios may be "
              f"disturbed (rerun on a quiet machine before believing a regression)")
    print(format_table(rows))
    failed = [r for r in rows if r.failed]
    for r in rows:
        if r.verdict == "new":
            print(f"note: {r.benchmark}: {r.figure} is gated but not in the baseline (--update adds it)")
    if failed:
        print(f"\nbench gate FAILED: {len(failed)} of {len(rows)} checks:")
        for r in failed:
            print(f"  {r.message()}")
        if args.failed_ids is not None:
            ids = list(dict.fromkeys(r.benchmark for r in failed))
            args.failed_ids.write_text("".join(f"{i}\n" for i in ids))
            print(f"the {len(ids)} failing benchmarks' node ids: {args.failed_ids}")
        if section is None:
            print(f"no candidate baseline written for machine kind {kind!r}: this run fails the machine-independent "
                  f"checks")
        return 1
    if section is None:
        candidate = candidate_path(kind or "unknown", args.candidate_dir)
        candidate.unlink(missing_ok=True)
        update_baseline([run], candidate, args.margin)
        print(f"\nno baseline for this machine kind and mode: only the {len(rows)} machine-independent checks ran "
              f"(passed). Candidate baseline from this run: {candidate}\n"
              f"adopt it: run the quick suite 2-3 times on a quiet machine of this kind and record\n"
              f"  python -m bench.compare q1.json q2.json q3.json --update --baseline {path}\n"
              f"(margins from bench/noise.py, as tests/test_bench_gate.py requires of a committed baseline)\n"
              f"or take this one run as it is:\n  cp {candidate} {path}\nthen commit {path}")
        return 0
    print(f"\nbench gate passed: {len(rows)} checks within their margins, floors and exact values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
