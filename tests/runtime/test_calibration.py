"""The measured step-cost table (``bitmtp/runtime/calibration.py``) on a tiny ternary model.

Rules stated per test: the key is stable and changes with what the costs depend on (threads); a
measurement gives positive finite seconds, relative(1, c) == 1 and a cost non-decreasing in width;
it leaves ``engine.n == 0`` and a KV store that decodes the same tokens as before; the cache is read
back without re-measuring; every kind of untrustworthy cache file is reported (naming the file) and
rebuilt into a valid one; an unwritable cache still yields a table; concurrent loads leave one file.
Every test points ``BITMTP_CACHE_DIR`` at its own ``tmp_path``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time

import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError
from bitmtp.runtime import calibration as cal
from bitmtp.runtime.calibration import CalibrationError, CostTable
from tests.support.hf_models import VARIED, tiny_model

# the solo engine's loop: generate's default would decode ar / auto as a batch of one (bitmtp.api.batches_alone)
pytestmark = pytest.mark.usefixtures("solo_engine")

pytest.importorskip("transformers")

M_MAX = 8
CAPACITY = 256


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", **VARIED["llama"]), capacity=CAPACITY, m_max=M_MAX, quantize="ternary")


@pytest.fixture
def engine(model):
    return model.engine


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Each test its own cache folder and an empty in-process memo."""
    monkeypatch.setenv(cal.CACHE_ENV, str(tmp_path))
    cal.clear_memo()
    yield tmp_path
    cal.clear_memo()


@pytest.fixture
def fake_measure(monkeypatch, engine):
    """Replace the measurement by a synthetic valid table for ``engine``'s key; counts its calls."""
    calls = []

    def measure(eng, *, widths=None, contexts=None, repeats=3, progress=False):
        calls.append(eng)
        time.sleep(0.05)  # long enough for a concurrent loader to arrive while it runs
        return synthetic(cal.calibration_key(eng), widths=tuple(range(1, eng.kv.m_max + 1)))

    monkeypatch.setattr(cal, "measure_cost_table", measure)
    return calls


def synthetic(key: dict, widths=(1, 2, 4, 8), contexts=(128, 240), seed: int = 0) -> CostTable:
    """A random table that is monotone in width and context (as a measurement stores it)."""
    g = torch.Generator().manual_seed(seed)
    base = 1e-3 * (1 + torch.rand(1, generator=g).item())
    rows = []
    for ci, _ in enumerate(contexts):
        row, s = [], base * (1 + 0.5 * ci)
        for _ in widths:
            s += 1e-4 * (1 + torch.rand(1, generator=g).item())
            row.append(s)
        rows.append(tuple(row))
    return CostTable(tuple(widths), tuple(contexts), tuple(rows), key)


def prompt(seed: int = 7) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 95, (23,), generator=g).tolist()


# --------------------------------------------------------------------------------------------------
# key


def test_key_stable_and_changes_with_threads(engine):
    k1 = cal.calibration_key(engine)
    assert cal.calibration_key(engine) == k1
    assert json.loads(json.dumps(k1)) == k1  # JSON-able as is (the cache compares stored keys)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(before + 1)
        k2 = cal.calibration_key(engine)
    finally:
        torch.set_num_threads(before)
    assert k2 != k1 and k2["threads"] == before + 1
    assert cal.cache_path(k2) != cal.cache_path(k1)
    assert cal.calibration_key(engine) == k1
    for field in ("model", "runtime", "kernels", "cpu", "torch", "bitmtp", "m_max", "schema", "dtype", "device"):
        assert field in k1, field
    assert k1["m_max"] == M_MAX and k1["runtime"] == "torch"


def test_fingerprint_computed_once_per_decoder(engine, monkeypatch):
    calls = []

    def counting(decoder):
        calls.append(decoder)
        return "f" * 16

    monkeypatch.setattr(cal, "base_fingerprint", counting)
    monkeypatch.delattr(engine.decoder, cal._FP_ATTR, raising=False)
    assert cal.calibration_key(engine)["model"] == "f" * 16
    cal.calibration_key(engine)
    assert len(calls) == 1


def test_key_changes_with_the_native_build(engine, tmp_path, monkeypatch):
    """A rebuilt extension (same bitmtp version, other kernel speeds) makes the cached table stale: the key
    carries a hash of the extension file, recomputed when its size or mtime changes."""
    ext = tmp_path / "_cpu_w2a8.so"
    ext.write_bytes(b"kernels v1" * 100)
    first = cal._native_build(str(ext))
    assert first and cal._native_build(str(ext)) == first
    ext.write_bytes(b"kernels v2" * 100)
    os.utime(ext, ns=(1, 2))
    assert cal._native_build(str(ext)) not in (None, first)
    assert cal._native_build(str(tmp_path / "missing.so")) is None and cal._native_build(None) is None
    k1 = cal.calibration_key(engine)
    native = k1["kernels"]["isa"] is not None  # without the extension there is no build to hash
    assert bool(k1["kernels"]["build"]) == native
    monkeypatch.setattr(cal, "_native_build", lambda path: "another-build")
    k2 = cal.calibration_key(engine)
    assert (k2 != k1) == native and (cal.cache_path(k2) != cal.cache_path(k1)) == native


def test_key_differs_between_models(engine):
    other = bitmtp.load(tiny_model("llama", seed=11, initializer_range=0.3), capacity=CAPACITY, m_max=M_MAX,
                        quantize="ternary").engine
    assert cal.calibration_key(other)["model"] != cal.calibration_key(engine)["model"]


# --------------------------------------------------------------------------------------------------
# the table's interpolation


def test_table_interpolates_and_stays_monotone_in_width():
    # width 3 measured (noise) cheaper than width 2: the table must not make a wider step look cheaper
    t = CostTable((1, 2, 3, 4), (100, 300), ((1.0, 2.0, 1.5, 4.0), (2.0, 3.0, 4.0, 5.0)), {})
    assert t.step_seconds(1, 100) == 1.0 and t.step_seconds(4, 300) == 5.0
    assert t.step_seconds(3, 100) == 2.0  # running max over widths
    assert t.step_seconds(2, 200) == pytest.approx(2.5)  # halfway between contexts
    assert t.step_seconds(1, 0) == 1.0  # below the first context: clamped
    assert t.step_seconds(6, 300) == pytest.approx(7.0)  # linear beyond the last width
    assert t.step_seconds(1, 500) == pytest.approx(3.0)  # linear beyond the last context
    for c in (0, 50, 100, 150, 300, 1000):
        assert t.relative(1, c) == 1.0
        costs = [t.step_seconds(w, c) for w in range(1, 20)]
        assert all(b >= a for a, b in zip(costs, costs[1:], strict=False)), (c, costs)
    with pytest.raises(bitmtp.BitMTPError, match="width"):
        t.step_seconds(0, 100)


def test_extrapolation_beyond_contexts_is_monotone_in_width():
    # width 2 grows faster with context than width 3: the extrapolated row must still be sorted
    t = CostTable((1, 2, 3), (100, 200), ((1.0, 2.0, 3.0), (1.0, 2.9, 3.0)), {})
    costs = [t.step_seconds(w, 1000) for w in (1, 2, 3)]
    assert costs == sorted(costs)


def test_dict_round_trip():
    t = synthetic({"a": 1})
    assert CostTable.from_dict(json.loads(json.dumps(t.as_dict()))) == t


@pytest.mark.parametrize("bad, why", [
    (lambda d: d.update(schema=0), "schema"),
    (lambda d: d.pop("seconds"), "seconds"),
    (lambda d: d.update(widths=[2, 4, 8]), "widths"),
    (lambda d: d.update(widths=[1, 4, 2]), "widths"),
    (lambda d: d["seconds"][0].pop(), "seconds"),
    (lambda d: d["seconds"][1].__setitem__(2, float("nan")), "seconds"),
    (lambda d: d["seconds"][1].__setitem__(2, float("inf")), "seconds"),
    (lambda d: d["seconds"][0].__setitem__(0, -1e-3), "seconds"),
    (lambda d: d["seconds"][0].__setitem__(0, 0), "seconds"),
    (lambda d: d["seconds"][0].__setitem__(0, "1e-3"), "seconds"),
    (lambda d: d.update(seconds=[d["seconds"][0], [s / 10 for s in d["seconds"][0]]]), "less than half"),
    (lambda d: d.update(key=[1]), "key"),
    # finite but outside a step's physical range (1 ns .. 1 hour): 1e308 overflowed the extrapolation to inf,
    # then NaN, then a ZeroDivisionError in LiveCosts.relative; 5e-324 divides to inf
    (lambda d: d["seconds"][1].__setitem__(3, 1e308), r"seconds\[1\]\[3\].*between"),
    (lambda d: d["seconds"][0].__setitem__(0, 5e-324), r"seconds\[0\]\[0\].*between"),
    (lambda d: d["seconds"][0].__setitem__(0, 1e-10), "1 ns"),
    (lambda d: d["seconds"][1].__setitem__(3, 3601.0), "1 hour"),
    (lambda d: d.update(seconds=[[1.7e308] * 4, [1.7e308] * 4]), "between"),  # each finite, sums overflow
])
def test_from_dict_rejects(bad, why):
    d = synthetic({"a": 1}).as_dict()
    bad(d)
    with pytest.raises(CalibrationError, match=why):
        CostTable.from_dict(d)


# --------------------------------------------------------------------------------------------------
# measuring on the engine


def test_measure_tiny_model(engine):
    engine.n = 17  # a sequence was running: measuring resets it
    syncs = engine.syncs
    t = cal.measure_cost_table(engine, repeats=2)
    assert t.widths[0] == 1 and t.widths[-1] == M_MAX
    assert len(t.contexts) >= 1 and t.contexts[-1] + M_MAX <= CAPACITY  # 1024 clipped to capacity - m_max
    assert len(t.seconds) == len(t.contexts) and all(len(r) == len(t.widths) for r in t.seconds)
    assert all(math.isfinite(s) and s > 0 for r in t.seconds for s in r)
    assert t.key == cal.calibration_key(engine)
    assert engine.n == 0 and engine.syncs == syncs
    for c in (*t.contexts, 0, 60, CAPACITY):
        assert t.relative(1, c) == 1.0
        costs = [t.step_seconds(w, c) for w in range(1, 2 * M_MAX)]
        assert all(b >= a for a, b in zip(costs, costs[1:], strict=False))
    assert CostTable.from_dict(json.loads(json.dumps(t.as_dict()))) == t  # a measurement validates
    text = cal.format_cost_table(t)
    assert "1.00" in text and str(t.contexts[-1]) in text and f"w{M_MAX}" in text


def test_measure_arguments(engine):
    t = cal.measure_cost_table(engine, widths=[3, 2], contexts=[5, 5, 10_000], repeats=1)
    assert t.widths == (1, 2, 3) and t.contexts == (5, CAPACITY - 3)
    with pytest.raises(bitmtp.BitMTPError, match="widths"):
        cal.measure_cost_table(engine, widths=[M_MAX + 1])
    with pytest.raises(bitmtp.BitMTPError, match="repeats"):
        cal.measure_cost_table(engine, repeats=0)
    with pytest.raises(bitmtp.BitMTPError, match="contexts"):
        cal.measure_cost_table(engine, contexts=[])


def test_busy_machine_is_reported(engine, monkeypatch, caplog):
    """Two of the three timed steps of each state stall 50 ms (another process took the core): the medians
    are off and the measurement says so."""
    seen: dict[int, int] = {}
    read = engine.read

    def stalling(*tensors):
        n = seen[tensors[0].numel()] = seen.get(tensors[0].numel(), 0) + 1
        if n in (2, 3):  # timed steps (the first is the warm-up)
            time.sleep(0.05)
        return read(*tensors)

    monkeypatch.setattr(engine, "read", stalling)
    with caplog.at_level(logging.WARNING, logger="bitmtp"):
        cal.measure_cost_table(engine, widths=[1, 2], contexts=[10], repeats=3)
    assert any("busy machine" in r.getMessage() for r in caplog.records)


def test_decode_after_measuring_is_unchanged(engine):
    p = prompt()
    before = engine.generate_ar(p, 24).tokens
    engine.n = 40  # mid-sequence state must not survive
    # contexts 0 and 5 write rows the prompt's KV occupied: the next prefill must overwrite them all
    cal.measure_cost_table(engine, contexts=[0, 5, 100], repeats=1)
    assert engine.n == 0
    after = engine.generate_ar(p, 24).tokens
    assert after == before
    assert len(set(before)) > 3  # the tiny model's output varies: the comparison means something


def test_measure_inside_a_generation_before_prefill(engine):
    """What the decode loop does: measure while its generation owns the store, then prefill."""
    p = prompt(3)
    ref = engine.generate_ar(p, 16).tokens
    engine._acquire()
    try:
        cal.measure_cost_table(engine, repeats=1)
        first = engine._prefill(p)
        out = [first] + [engine._ar_step(t) for t in [first]]
    finally:
        engine._release()
    assert out == ref[:2]


# --------------------------------------------------------------------------------------------------
# the cache


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(cal.CACHE_ENV, str(tmp_path / "x"))
    assert cal.cache_dir() == tmp_path / "x"
    monkeypatch.delenv(cal.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cal.cache_dir() == tmp_path / "xdg" / "bitmtp"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cal.cache_dir() == tmp_path / "home" / ".cache" / "bitmtp"


def test_cache_round_trip_real_measurement(engine, cache, monkeypatch):
    t1 = cal.load_cost_table(engine)
    path = cal.cache_path(cal.calibration_key(engine))
    assert path.parent == cache / "calibration" and path.is_file()
    assert CostTable.from_dict(json.loads(path.read_text())) == t1
    cal.clear_memo()  # the second load must come from the file, not re-measure

    def fail(*a, **k):
        raise AssertionError("re-measured although the cache file is valid")

    monkeypatch.setattr(cal, "measure_cost_table", fail)
    reads = []
    real = cal._read
    monkeypatch.setattr(cal, "_read", lambda *a: reads.append(a[0]) or real(*a))
    assert cal.load_cost_table(engine) == t1
    assert reads == [path]
    assert cal.load_cost_table(engine) == t1  # memoised: not even the file is read again
    assert reads == [path]


def test_rebuild_measures_again(engine, fake_measure):
    cal.load_cost_table(engine)
    cal.load_cost_table(engine, rebuild=True)
    assert len(fake_measure) == 2


def _corrupt(kind: str, text: str) -> str:
    d = json.loads(text)
    if kind == "not json":
        return "{calibration: yes"
    if kind == "truncated":
        return text[: len(text) // 2]
    if kind == "binary":
        return "\x00\xff" * 10
    if kind == "schema":
        d["schema"] = cal.SCHEMA_VERSION + 1
    elif kind == "key":
        d["key"]["threads"] += 1
    elif kind == "nan":
        d["seconds"][0][1] = float("nan")
    elif kind == "negative":
        d["seconds"][-1][-1] = -0.01
    elif kind == "zero":
        d["seconds"][0][0] = 0.0
    elif kind == "huge":  # the reported case: finite, absurd
        d["seconds"] = [[1e308] * len(r) for r in d["seconds"]]
    elif kind == "subnormal":
        d["seconds"][0][0] = 5e-324
    elif kind == "overflowing":  # each value finite, differences and extrapolations overflow
        d["seconds"][-1] = [1.7976e308] * len(d["seconds"][-1])
    elif kind == "missing widths":  # drops widths above 4: the table no longer covers m_max
        d["widths"] = d["widths"][:4]
        d["seconds"] = [r[:4] for r in d["seconds"]]
    elif kind == "missing field":
        del d["contexts"]
    elif kind == "list":
        d = [d]
    return json.dumps(d)


@pytest.mark.parametrize("kind", ["not json", "truncated", "binary", "schema", "key", "nan", "negative", "zero",
                                  "huge", "subnormal", "overflowing", "missing widths", "missing field", "list"])
def test_untrusted_cache_is_rebuilt(engine, fake_measure, caplog, kind):
    cal.load_cost_table(engine)
    path = cal.cache_path(cal.calibration_key(engine))
    path.write_text(_corrupt(kind, path.read_text()), encoding="utf-8")
    cal.clear_memo()
    with caplog.at_level(logging.WARNING, logger="bitmtp"):
        t = cal.load_cost_table(engine)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "bitmtp"]
    assert len(warned) == 1 and str(path) in warned[0].getMessage() and "rebuilding" in warned[0].getMessage()
    assert len(fake_measure) == 2
    stored = CostTable.from_dict(json.loads(path.read_text()))  # rewritten and valid again
    assert stored == t and stored.key == cal.calibration_key(engine) and stored.widths[-1] >= M_MAX


def test_unwritable_cache_warns_once_and_returns_the_table(engine, fake_measure, caplog, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv(cal.CACHE_ENV, str(blocker))
    with caplog.at_level(logging.WARNING, logger="bitmtp"):
        t1 = cal.load_cost_table(engine)
        t2 = cal.load_cost_table(engine)
    assert t1 is t2 and len(fake_measure) == 1  # memoised in the process, not re-measured
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "bitmtp"]
    assert len(warned) == 1 and str(blocker) in warned[0].getMessage()
    assert blocker.read_text() == "a file where the cache folder should be"


def test_explicit_cache_argument(engine, fake_measure, tmp_path):
    other = tmp_path / "explicit"
    cal.load_cost_table(engine, cache=other)
    assert cal.cache_path(cal.calibration_key(engine), other).is_file()
    assert not (tmp_path / "calibration").exists()


def test_concurrent_loads_leave_one_valid_file(engine, fake_measure, cache):
    results, errors = [], []
    sibling = engine.sibling()  # same decoder and settings: the same key

    def load(eng):
        try:
            results.append(cal.load_cost_table(eng))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(e,)) for e in (engine, sibling)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(fake_measure) == 1 and results[0] == results[1]
    files = sorted(p.name for p in (cache / "calibration").iterdir())
    assert files == [cal.cache_path(cal.calibration_key(engine)).name]  # no temporary file left over
    assert CostTable.from_dict(json.loads((cache / "calibration" / files[0]).read_text())) == results[0]


# -- LiveCosts: the table corrected by observed step times ------------------------------------------------


def _linear_table(per_row: float) -> CostTable:
    widths = (1, 2, 4, 8)
    return CostTable(widths, (128,), (tuple(0.01 * (1 + per_row * (w - 1)) for w in widths),), {"k": 1})


def test_live_costs_start_from_the_table():
    live = cal.LiveCosts(_linear_table(0.5), 8)
    rel = live.relative(128)
    assert rel[0] == 0.0 and rel[1] == 1.0 and rel[2] == pytest.approx(1.5) and rel[8] == pytest.approx(4.5)


def test_live_costs_follow_what_steps_cost():
    """A table measured on a busy machine said wide steps are cheap; observed steps say otherwise."""
    live = cal.LiveCosts(_linear_table(0.1), 8)
    for _ in range(20):
        live.observe(1, 0.010)
        live.observe(2, 0.020)  # width 2 really costs 2 AR steps
    rel = live.relative(128)
    assert rel[2] == pytest.approx(2.0, rel=1e-6)
    # unseen widths: the table's seconds scaled by the median observed/table ratio of the seen ones
    # (width 1: 1.0, width 2: 0.020 / 0.011), never cheaper than a narrower width
    assert rel[3] >= rel[2] and all(rel[w] <= rel[w + 1] for w in range(1, 8))
    live.observe(5, 0.001)  # seen fewer than MIN_SEEN times: not trusted yet
    assert live.relative(128)[5] >= rel[2]


def test_live_costs_average_out_a_burst():
    live = cal.LiveCosts(_linear_table(0.2), 4)
    for _ in range(30):
        live.observe(1, 0.010)
    live.observe(1, 0.200)  # one step disturbed by another process
    for w in (2, 3, 4):
        for _ in range(5):
            live.observe(w, 0.010 * (1 + 0.2 * (w - 1)))
    assert live.relative(128)[4] == pytest.approx(1.6)  # the median ignores the burst


def test_live_costs_of_off_row_drafts():
    """Heads drafts take no rows: a step of k + 1 rows with D' − 1 drafts costs the rows' step plus the
    drafts; what it took beyond the rows, per draft and relative to a width-1 step, is the draft cost."""
    live = cal.LiveCosts(_linear_table(0.5), 8)  # width 1: 10 ms, width 3: 20 ms
    assert live.draft_cost(0.3) == 0.3  # nothing seen: the prior
    live.observe_drafts(3, 4, 0.020 + 4 * 0.002, 128)
    live.observe_drafts(3, 4, 0.020 + 4 * 0.002, 128)
    assert live.draft_cost(0.3) == 0.3  # fewer than MIN_SEEN observations
    live.observe_drafts(1, 2, 0.010 + 2 * 0.003, 128)
    live.observe_drafts(1, 1, 0.005, 128)  # faster than the rows alone (noise): counts as free, not negative
    assert live.draft_cost(0.3) == pytest.approx(0.2)  # median of 0.2, 0.2, 0.3, 0.0
    assert live.relative(128)[3] == pytest.approx(2.0)  # the rows' costs are not touched


class _Clock:
    """A clock the test moves (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_live_costs_forget_old_step_times():
    """Times older than STEP_TIMES_KEPT_S no longer price a width: a width priced high by a few disturbed steps
    (which auto then stops choosing, so never re-times) costs the table's seconds at the current scale again."""
    from bitmtp.decoding.auto import STEP_TIMES_KEPT_S

    clock = _Clock()
    live = cal.LiveCosts(_linear_table(0.5), 8, clock=clock)  # width 1: 10 ms, width 2: 15 ms
    for _ in range(3):
        live.observe(2, 0.060)  # disturbed: 4x the table
        live.observe_drafts(1, 1, 0.020, 128)  # one draft: 1.0 width-1 steps
    for _ in range(9):
        live.observe(1, 0.010)
    assert live.relative(128)[2] == pytest.approx(6.0) and live.draft_cost(0.3) == pytest.approx(1.0)
    clock.now += STEP_TIMES_KEPT_S / 2  # still fresh
    assert live.relative(128)[2] == pytest.approx(6.0) and live.draft_cost(0.3) == pytest.approx(1.0)
    clock.now += STEP_TIMES_KEPT_S / 2 + 0.01
    for _ in range(3):
        live.observe(1, 0.020)  # the machine is busier now: width 1 at 2x the table
    rel = live.relative(128)
    assert rel[2] == pytest.approx(1.5)  # the table's ratio, at the current scale
    assert live.seconds(128)[1] == pytest.approx(0.030)
    assert live.draft_cost(0.3) == 0.3  # back to the prior
    assert list(live.seen[2]) == [] and len(live.seen[1]) == 3  # only the fresh times are kept


def test_auto_drafts_again_once_disturbed_times_expire():
    """The served chat page's flake, as a unit: two width-2 steps slowed 6x priced width 2 at ~5 AR steps, so
    auto decoded a prompt its answer repeats token by token for the rest of the session; once those times
    expire it verifies the lookup's guesses again."""
    from bitmtp.decoding.auto import STEP_TIMES_KEPT_S, AutoPlanner
    from bitmtp.decoding.lookup import LookupIndex
    from bitmtp.decoding.onepass import DecodeMemory, PassContext

    clock = _Clock()
    live = cal.LiveCosts(_linear_table(0.2), 8, clock=clock)
    for t in (0.060, 0.057, 0.022):
        live.observe(2, t)
    for _ in range(9):
        live.observe(1, 0.010)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7, 8, 9]  # a 5-gram the lookup continues
    planner = AutoPlanner(DecodeMemory())

    def plan():
        ctx = PassContext(LookupIndex(tokens, ngram_max=5), n=len(tokens), block=8, max_width=8, lookup=object(),
                          costs=live.relative(len(tokens)))
        return planner.plan(ctx)

    assert plan().guesses == []  # width 2 looks 5.7x a width-1 step: AR
    clock.now += STEP_TIMES_KEPT_S + 0.01
    live.observe(1, 0.010)
    assert plan().guesses[:3] == [10, 11, 12]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_live_costs_finite_at_the_edges_of_the_accepted_range(seed):
    """Any table from_dict accepts, at any context up to far beyond its last one, with any observations
    (none, only wide steps, a 0 s timer delta, an hour-long stall): the relative costs AutoPlanner divides by
    are finite, >= 1 and non-decreasing in width, and the planner plans without raising. Before the range
    check, a 1e308 table at context 1500 raised ZeroDivisionError here."""
    from bitmtp.decoding.auto import AutoPlanner
    from bitmtp.decoding.lookup import LookupIndex
    from bitmtp.decoding.onepass import DecodeMemory, PassContext

    g = torch.Generator().manual_seed(seed)
    lo, hi = cal.MIN_STEP_SECONDS, cal.MAX_STEP_SECONDS
    widths, contexts = (1, 2, 3, 5, 8), (7, 9, 300)  # awkward: two close contexts make a steep extrapolation
    edge = [lo, hi, lo * (1 + torch.rand(1, generator=g).item()), hi * torch.rand(1, generator=g).item()]
    rows = [[edge[int(torch.randint(0, 4, (1,), generator=g))] for _ in widths] for _ in contexts]
    for ci in range(len(rows)):  # make it monotone in context (from_dict's own rule) by a running maximum
        rows[ci] = [max(v, rows[ci - 1][wi]) if ci else v for wi, v in enumerate(rows[ci])]
    table = CostTable.from_dict({"schema": cal.SCHEMA_VERSION, "widths": list(widths), "contexts": list(contexts),
                                 "seconds": rows, "key": {}})
    live = cal.LiveCosts(table, 8)
    planner = AutoPlanner(DecodeMemory())
    for observations in ([], [(8, 0.01)] * 3, [(2, 0.0)] * 3, [(1, 1e9)] * 3 + [(4, lo)] * 3):
        for w, t in observations:
            live.observe(w, t)
        live.observe_drafts(2, 3, 0.0, 1500)
        for context in (0, 8, 1500, 10**6):
            rel = live.relative(context)
            assert all(math.isfinite(v) for v in rel) and rel[1] == 1.0, (context, rel)
            assert all(b >= a for a, b in zip(rel[1:], rel[2:], strict=False)), (context, rel)
            assert math.isfinite(live.draft_cost(0.3)) and live.draft_cost(0.3) >= 0.0
            tokens = torch.randint(3, 9, (13,), generator=g).tolist()
            ctx = PassContext(LookupIndex(tokens), n=len(tokens), block=8, max_width=8, lookup=object(),
                              costs=rel)
            assert planner.plan(ctx).width <= 8


def test_planner_survives_costs_outside_the_range():
    """Costs a caller hands the planner itself (not through LiveCosts) that are 0, inf or NaN make that
    width unaffordable: no ZeroDivisionError, and a plan of an affordable width."""
    from bitmtp.decoding.auto import AutoPlanner
    from bitmtp.decoding.lookup import LookupIndex
    from bitmtp.decoding.onepass import DecodeMemory, PassContext

    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    for bad in (0.0, math.inf, math.nan):
        for costs in ([0.0, bad] + [1.0] * 8, [0.0, 1.0] + [bad] * 8, [0.0] + [bad] * 9):
            ctx = PassContext(LookupIndex(tokens), n=len(tokens), block=8, max_width=8, lookup=object(),
                              costs=costs)
            plan = AutoPlanner(DecodeMemory()).plan(ctx)
            assert plan.width <= 8
            if costs[2] != 1.0:  # every guess width unaffordable: AR
                assert not plan.guesses


def _write_absurd_cache(engine) -> object:
    """The reported cache: costs huge but finite, contexts short so that a long prompt extrapolates."""
    key = cal.calibration_key(engine)
    path = cal.cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    widths = list(range(1, M_MAX + 1))
    path.write_text(json.dumps({"schema": cal.SCHEMA_VERSION, "widths": widths, "contexts": [8, 16],
                                "seconds": [[1e308] * M_MAX, [1.7e308] * M_MAX], "key": key}), encoding="utf-8")
    return path


def test_absurd_cache_on_a_long_prompt_is_rejected_and_decodes_like_ar(model, engine, fake_measure, caplog):
    """The reported case (a 1e308 cache, a prompt far beyond its contexts: ZeroDivisionError): the file is
    rejected on load with a warning naming it, the field and the fix; a short generation plans with the prior
    costs, a long one re-measures and rewrites it; both give AR's tokens."""
    from bitmtp.runtime.decode import CALIBRATE_MIN_NEW_TOKENS

    path = _write_absurd_cache(engine)
    g = torch.Generator().manual_seed(1500)
    ids = torch.randint(3, 95, (CAPACITY - CALIBRATE_MIN_NEW_TOKENS - 17,), generator=g).tolist()
    for new in (CALIBRATE_MIN_NEW_TOKENS - 1, CALIBRATE_MIN_NEW_TOKENS):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bitmtp"):
            out = bitmtp.generate(model, input_ids=ids, max_new_tokens=new, eos_token_id=[], block_size=4)
        ar = bitmtp.generate(model, input_ids=ids, max_new_tokens=new, policy="ar", eos_token_id=[])
        assert out.token_ids == ar.token_ids
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "bitmtp"]
        assert len(warned) == 1 and str(path) in warned[0] and "seconds[0][0]" in warned[0], warned
        if new < CALIBRATE_MIN_NEW_TOKENS:
            assert "--calibrate" in warned[0] and "delete" in warned[0] and fake_measure == []
    assert len(fake_measure) == 1  # the long one re-measured and rewrote the file
    assert CostTable.from_dict(json.loads(path.read_text())).seconds[0][0] < cal.MAX_STEP_SECONDS


def test_measurements_are_stored_inside_the_accepted_range(engine, monkeypatch):
    """A measured table always loads back: its seconds are clamped into the range from_dict accepts."""
    monkeypatch.setattr(cal.time, "perf_counter", lambda: 0.0)  # a timer too coarse to see a step: 0 s each
    t = cal.measure_cost_table(engine, widths=(1, 3), contexts=(5,), repeats=1)
    assert all(s == cal.MIN_STEP_SECONDS for row in t.seconds for s in row)
    assert CostTable.from_dict(json.loads(json.dumps(t.as_dict()))) == t


def test_short_generations_plan_with_the_prior_and_do_not_measure(model, engine, fake_measure, cache):
    """A generation of fewer than CALIBRATE_MIN_NEW_TOKENS new tokens never measures (a one-token CLI
    call must not spend seconds calibrating): auto plans with the prior table, output still AR's; a
    longer one measures once and caches."""
    from bitmtp.runtime.decode import CALIBRATE_MIN_NEW_TOKENS

    assert cal.load_cost_table(engine, measure=False) is None and not list(cache.iterdir())
    ids = prompt()
    ar = bitmtp.generate(model, input_ids=ids, max_new_tokens=CALIBRATE_MIN_NEW_TOKENS - 1, policy="ar",
                         eos_token_id=[])
    out = bitmtp.generate(model, input_ids=ids, max_new_tokens=CALIBRATE_MIN_NEW_TOKENS - 1, eos_token_id=[],
                          block_size=4)
    assert out.token_ids == ar.token_ids and fake_measure == [] and not list(cache.iterdir())
    assert model.engine.memory.live_costs.table.key.get("prior")
    bitmtp.generate(model, input_ids=ids, max_new_tokens=CALIBRATE_MIN_NEW_TOKENS, eos_token_id=[], block_size=4)
    assert len(fake_measure) == 1 and list(cache.iterdir())
    assert cal.load_cost_table(engine, measure=False) is not None


def test_prior_table_covers_m_max_and_is_linear():
    class _E:
        class kv:
            m_max = 31

    t = cal.prior_cost_table(_E)
    assert t.widths[-1] == 31 and t.relative(1, 500) == 1.0
    assert t.relative(5, 128) == pytest.approx(2.0) and t.relative(31, 4000) == pytest.approx(8.5)


def test_model_calibrate_measures_once_then_a_long_generation_does_not(model, engine, fake_measure, cache):
    """``model.calibrate()`` (what ``bitmtp serve`` runs at startup) measures now and caches: the first long auto
    generation then measures nothing; ``rebuild=True`` measures again; a stream this thread holds open on the
    model is refused with the fix named (the measurement writes its KV rows)."""
    from bitmtp.runtime.decode import CALIBRATE_MIN_NEW_TOKENS

    table = model.calibrate()
    assert isinstance(table, CostTable) and fake_measure == [engine] and list(cache.iterdir())
    assert model.calibrate() is table and len(fake_measure) == 1  # memoised
    bitmtp.generate(model, input_ids=prompt(), max_new_tokens=CALIBRATE_MIN_NEW_TOKENS, eos_token_id=[],
                    block_size=4)
    assert len(fake_measure) == 1 and not engine.busy
    assert model.calibrate(rebuild=True) is not table and len(fake_measure) == 2
    generation = engine.decode(prompt(), max_new_tokens=4)
    next(generation)
    with pytest.raises(BitMTPError, match="a stream on this model is still open in this thread"):
        model.calibrate()
    generation.close()
    assert not engine.busy and len(fake_measure) == 2
