"""The native extension's thread team (csrc/cpu/pool.h): exact results from any calling thread, several
callers at once, a forked child, odd team sizes; and the property it exists for — back-to-back regions
called from a thread that is not the main one hand over to spinning workers instead of waking sleeping
ones (libgomp's pool slept at every region there once a second thread had a pool: 2.4x slower decode).

Rule: ``stream_read`` sums uint64 words, an exact integer result for any split over threads. (Whole
generations from several threads equal the same calls made alone: tests/runtime/test_concurrency.py.)
"""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest

from tests.support.cpu_native import ISAS

pytestmark = pytest.mark.skipif(not ISAS, reason="native CPU extension not built")


def _ext():
    import bitmtp._cpu_w2a8 as ext

    return ext


def _buffer(seed: int, words: int) -> tuple[np.ndarray, int]:
    arr = np.random.default_rng(seed).integers(0, 2**40, size=words, dtype=np.uint64)
    return arr, int(arr.sum(dtype=np.uint64))


def _sum(arr: np.ndarray, threads: int) -> int:
    return _ext().stream_read(arr.ctypes.data, arr.nbytes, threads)


@pytest.mark.parametrize("threads", [-3, 0, 1, 2, 3, 7])
@pytest.mark.parametrize("words", [1, 3, 1000, 100_003])
def test_any_team_size_sums_exactly(threads, words):
    arr, want = _buffer(words + abs(threads), words)
    assert _sum(arr, threads) == want


def test_features_report_the_team():
    f = _ext().cpu_features()
    assert f["openmp"] is False and f["threading"] == "bitmtp pool"
    arr, want = _buffer(1, 4096)
    before = f["pool_regions"]
    assert _sum(arr, 2) == want
    after = _ext().cpu_features()
    assert after["pool_regions"] == before + 1 and after["pool_workers"] >= 1


def test_many_callers_at_once_each_get_their_own_sum():
    bufs = [_buffer(s, 50_000 + s) for s in range(6)]
    errors: list[str] = []

    def caller(i: int) -> None:
        arr, want = bufs[i]
        for _ in range(40):
            got = _sum(arr, 2 + i % 3)
            if got != want:
                errors.append(f"caller {i}: {got} != {want}")
                return

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(bufs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller hung: the team deadlocked"
    assert not errors, errors


def test_regions_from_a_worker_thread_hand_over_without_sleeping():
    """Back-to-back regions from a non-main thread, after the main thread used the team: a worker
    still spinning picks each one up. With a throttled spin (libgomp's, once two threads had pools)
    every region woke a sleeping worker; here at most a minority may (a worker descheduled past its
    spin on a loaded machine)."""
    arr, want = _buffer(7, 2048)
    assert _sum(arr, 2) == want  # the main thread first, as a server loading its model does
    regions = 400
    got: dict[str, int] = {}

    def worker() -> None:
        assert _sum(arr, 2) == want
        w0 = _ext().cpu_features()["pool_wakeups"]
        ok = all(_sum(arr, 2) == want for _ in range(regions))
        got["wakeups"] = _ext().cpu_features()["pool_wakeups"] - w0
        got["ok"] = ok

    t = threading.Thread(target=worker)
    t.start()
    t.join(timeout=120)
    assert got.get("ok"), "wrong sums from the worker thread"
    assert got["wakeups"] < regions // 2, f"{got['wakeups']} of {regions} regions had to wake a sleeping worker"


def _child_sum(q) -> None:
    arr, want = _buffer(11, 100_000)
    q.put(_sum(arr, 2) == want)


def test_a_forked_child_starts_its_own_team():
    arr, want = _buffer(3, 10_000)
    assert _sum(arr, 2) == want  # the parent's team exists before the fork
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_sum, args=(q,))
    p.start()
    p.join(timeout=60)
    if p.is_alive():
        p.kill()
        pytest.fail("the forked child hung in the thread team (it inherited the parent's workers' state)")
    assert p.exitcode == 0 and q.get(timeout=5) is True

