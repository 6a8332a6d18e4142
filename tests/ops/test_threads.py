"""bitmtp.ops.threads: torch's own CPU ops inside a step run on the calling thread (no OpenMP region whose
spinning workers would take the cores the extension's team needs); the extension keeps its thread count.

Observed directly: libgomp starts a worker pool for each thread that first opens a parallel region, so a
fresh thread that runs a vocabulary-wide softmax adds OS threads to the process unless the op ran inline."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from bitmtp.ops import threads as step_threads_mod
from bitmtp.ops.threads import kernel_threads, step_threads, torch_ops_inline

pytestmark = pytest.mark.skipif(step_threads_mod._omp() is None or not os.path.isdir("/proc/self/task"),
                                reason="torch here does not run its ops on a findable OpenMP runtime")


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _in_fresh_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def _softmax_new_threads(inline: bool) -> int:
    x = torch.randn(64, 49152)

    def body():
        before = _tasks()
        if inline:
            with torch_ops_inline():
                torch.softmax(x, -1).max(-1)
        else:
            torch.softmax(x, -1).max(-1)
        return _tasks() - before

    return _in_fresh_thread(body)


def test_ops_inside_the_block_open_no_openmp_region(two_threads):
    assert _softmax_new_threads(inline=False) >= 1  # the observable works: a region starts a pool
    assert _softmax_new_threads(inline=True) == 0


def test_the_block_changes_this_thread_only_and_restores_it(two_threads):
    seen_elsewhere = []
    inside = threading.Event()
    release = threading.Event()

    def other():
        inside.wait()
        seen_elsewhere.append(torch.get_num_threads())
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with torch_ops_inline():
        assert torch.get_num_threads() == 1  # torch's ops here: inline
        assert kernel_threads() == 2  # the extension's kernels: the count from before the block
        with torch_ops_inline():  # nested: free, same counts
            assert kernel_threads() == 2 and torch.get_num_threads() == 1
        inside.set()
        release.wait(10)
        assert torch.get_num_threads() == 1
    t.join()
    assert seen_elsewhere == [2]
    assert torch.get_num_threads() == 2 and kernel_threads() == 2


def test_the_block_restores_after_an_exception(two_threads):
    with pytest.raises(RuntimeError, match="boom"), torch_ops_inline():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2 and kernel_threads() == 2


def test_steps_inline_only_on_the_native_cpu_backend(monkeypatch, two_threads):
    from bitmtp.ops.registry import availability

    with step_threads(torch.device("meta")):
        assert torch.get_num_threads() == 2
    monkeypatch.setenv("BITMTP_BACKEND", "torch")  # the pure-torch path needs torch's threads
    with step_threads(torch.device("cpu")):
        assert torch.get_num_threads() == 2
    if not availability("cpu", "cpu")[0]:
        return
    monkeypatch.setenv("BITMTP_BACKEND", "cpu")
    with step_threads(torch.device("cpu")):
        assert torch.get_num_threads() == 1 and kernel_threads() == 2
