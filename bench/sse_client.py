"""A lean streaming chat client, run as its own process by the serving benchmarks: one OpenAI-style streamed
chat completion, timed from sending the request to the last chunk.

Why a process of its own: a client in the benchmark's process parses every chunk under the server's GIL
(httpx + json per chunk measured ~2 % of serve's decode speed on 2 vCPUs); real clients live elsewhere,
and llama-server's client never shared its process. Both servers get this same client.

Usage: ``python -m bench.sse_client URL BODY_JSON [--timings]`` → prints ``[end-to-end tok/s, server decode
tok/s or null, completion tokens]`` (the server's figure: bitmtp's ``bitmtp.tokens_per_second`` or llama-server's
``timings.predicted_per_second``); with ``--timings`` also the seconds to the first text and the gaps between
the chunks carrying text (``[..., ttft, [gap, ...]]``).
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from urllib.parse import urlsplit

_FIGURES = (b'"completion_tokens"', b'"bitmtp"', b'"timings"')


def stream(url: str, body: dict, timings: bool = False) -> tuple:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    tokens, decode = 0, None
    text_at: list[float] = []  # when each chunk carrying text arrived
    for line in resp:
        if timings and line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
            text_at.append(time.perf_counter())
        # only the chunks carrying figures are parsed (the last ones): the client stays light
        if line.startswith(b"data: {") and any(k in line for k in _FIGURES):
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            decode = (chunk.get("bitmtp") or {}).get("tokens_per_second") or decode
            decode = (chunk.get("timings") or {}).get("predicted_per_second") or decode
    wall = time.perf_counter() - t0
    conn.close()
    if timings:
        ttft = text_at[0] - t0 if text_at else wall
        return tokens / wall, decode, tokens, ttft, [b - a for a, b in zip(text_at, text_at[1:], strict=False)]
    return tokens / wall, decode, tokens


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or (len(sys.argv) == 4 and sys.argv[3] != "--timings"):
        raise SystemExit(__doc__)
    print(json.dumps(stream(sys.argv[1], json.loads(sys.argv[2]), timings=len(sys.argv) == 4)))
