"""Bursts of chat clients against an OpenAI-style server, some hanging up at random: the load of issue "Many
sequences in one step" (64 clients x 2 requests, random disconnects; every completed answer correct, KV rows
back to zero, no 5xx, memory flat across bursts).

:func:`burst` starts ``clients`` threads at once; each sends ``requests_each`` chat completions one after the
other (streamed or whole, alternately), for a prompt drawn from ``prompts``, and with probability
``disconnect`` hangs up part-way: a streamed request after its first text chunk, a whole one a few
milliseconds after sending. Clients use ``http.client`` (no parsing beyond the lines they need), one
connection per request. Used by ``bench/e2e/test_bench_batch.py::test_serve_bursts`` and
``tests/serve/test_batching.py``.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["BurstResult", "burst", "rss_mib"]


@dataclass
class BurstResult:
    """What one burst's clients saw."""

    #: (prompt index, answer text, streamed) of every request that ran to its end
    completed: list[tuple[int, str, bool]] = field(default_factory=list)
    #: requests the client hung up on
    disconnected: int = 0
    #: HTTP status of every request whose status line arrived
    statuses: Counter = field(default_factory=Counter)
    #: seconds from sending to the first text chunk, per completed streamed request
    ttft: list[float] = field(default_factory=list)
    #: client-side failures other than the planned hang-ups (connection refused, reset, ...)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def server_errors(self) -> int:
        """Responses with a 5xx status."""
        return sum(n for status, n in self.statuses.items() if status >= 500)


def _one(url: str, body: dict, leave: bool, result: BurstResult, lock: threading.Lock, index: int,
         rng: random.Random) -> None:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        if leave and not body["stream"]:
            time.sleep(rng.uniform(0.0, 0.05))  # hangs up while the answer is being made
            with lock:
                result.disconnected += 1
            return
        resp = conn.getresponse()
        with lock:
            result.statuses[resp.status] += 1
        if resp.status != 200:
            resp.read()
            return
        if not body["stream"]:
            text = json.loads(resp.read())["choices"][0]["message"]["content"]
            with lock:
                result.completed.append((index, text, False))
            return
        text, first = "", None
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if piece:
                first = first if first is not None else time.perf_counter() - t0
                text += piece
                if leave:
                    with lock:
                        result.disconnected += 1
                    return  # hangs up after the first text
        with lock:
            result.completed.append((index, text, True))
            if first is not None:
                result.ttft.append(first)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        with lock:
            result.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def burst(url: str, prompts: list[str], *, clients: int = 64, requests_each: int = 2, max_tokens: int = 16,
          disconnect: float = 0.25, seed: int = 0, model: str = "smollm2") -> BurstResult:
    """Run one burst (module docstring) and return what the clients saw. Greedy requests, so every completed
    answer of prompt ``i`` must equal the same request made alone."""
    result, lock = BurstResult(), threading.Lock()
    rng = random.Random(seed)
    plans = [[(rng.randrange(len(prompts)), rng.random() < disconnect, (c + j) % 2 == 0, rng.randrange(2**31))
              for j in range(requests_each)] for c in range(clients)]

    def client(plan: list[tuple[int, bool, bool, int]]) -> None:
        for index, leave, stream, sub_seed in plan:
            body = {"model": model, "messages": [{"role": "user", "content": prompts[index]}],
                    "max_tokens": max_tokens, "stream": stream}
            _one(url, body, leave, result, lock, index, random.Random(sub_seed))

    threads = [threading.Thread(target=client, args=(plan,), daemon=True) for plan in plans]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - t0
    return result


def rss_mib() -> float:
    """This process's resident set size, MiB (``/proc/self/statm``)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
