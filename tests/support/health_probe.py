"""A /health probe run as its own process (``python -c PROBE URL SECONDS``): prints ``ready``, then polls
``/health`` every 10 ms and, once a request has been parsed (``parsing`` went up and back to 0) or the time
is up, prints the JSON list of the response times seen while ``parsing`` was nonzero. Its own process: a
client inside the server's process would be stalled by the GIL too, and would measure itself."""

PROBE = r"""
import json, sys, time
import httpx
url, limit = sys.argv[1], time.monotonic() + float(sys.argv[2])
during, seen = [], False
with httpx.Client(timeout=120) as client:
    client.get(url + "/health")
    print("ready", flush=True)
    while time.monotonic() < limit:
        t = time.perf_counter()
        health = client.get(url + "/health").json()
        dt = time.perf_counter() - t
        if health["parsing"]:
            seen = True
            during.append(dt)
        elif seen:
            break
        time.sleep(0.01)
print(json.dumps(during), flush=True)
"""
