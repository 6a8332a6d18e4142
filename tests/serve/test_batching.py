"""``bitmtp serve`` batching concurrent requests (continuous batching) against the real SmolLM2.

Rules: concurrent requests decode in shared steps (fewer steps than tokens) and each answer equals what the
request gets from ``bitmtp.generate`` alone — with its own sampling parameters, seed, stop strings and
max_tokens; clients that leave free their KV rows; ``/metrics`` is Prometheus text with the documented names.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import bitmtp
from tests.support.smollm2 import PROMPTS

MODEL = "smollm2"


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def batching(smollm2):
    """A server that batches every request (no solo request), 4 at a time, 16 waiting."""
    from bitmtp.serve import create_app, run_in_thread

    app = create_app(smollm2, model_name=MODEL, max_batch=4, queue_size=16, solo_when_idle=False)
    with run_in_thread(app) as srv:
        yield srv, app.state.bitmtp


def _idle(state, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while state.batch.running or state.batch.waiting or state.batch.rows_in_use:
        assert time.monotonic() < deadline, (state.batch.running, state.batch.waiting, state.batch.rows_in_use)
        time.sleep(0.05)


def test_concurrent_requests_share_steps_and_get_their_solo_answers(smollm2, batching):
    srv, state = batching
    requests = [
        dict(messages=_chat(PROMPTS[0]), max_tokens=20),
        dict(messages=_chat(PROMPTS[1]), max_tokens=9, temperature=0.8, top_p=0.9, seed=7),
        dict(messages=_chat("Count from 1 to 20."), max_tokens=40, stop=["7,", "7\n"]),
        dict(messages=_chat(PROMPTS[2]), max_tokens=16, temperature=1.0, seed=3, presence_penalty=0.5),
        dict(messages=_chat(PROMPTS[3]), max_tokens=12, stream=True),
        dict(messages=_chat(PROMPTS[4]), max_tokens=25, logprobs=True),
    ]
    answers: dict[int, str] = {}
    errors: list[BaseException] = []
    steps0 = state.batch.steps

    def client(i: int) -> None:
        try:
            body = {"model": MODEL, **requests[i]}
            if body.get("stream"):
                text = ""
                with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            import json

                            chunk = json.loads(line[6:])
                            if chunk["choices"]:
                                text += chunk["choices"][0]["delta"].get("content") or ""
                answers[i] = text
            else:
                r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
                assert r.status_code == 200, r.text
                answers[i] = r.json()["choices"][0]["message"]["content"]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, req in enumerate(requests):
        kw = dict(max_new_tokens=req["max_tokens"], temperature=req.get("temperature", 0.0),
                  top_p=req.get("top_p", 1.0), seed=req.get("seed"), stop=req.get("stop"),
                  presence_penalty=req.get("presence_penalty", 0.0))
        assert answers[i] == bitmtp.generate(smollm2, req["messages"], batcher=False, **kw).text, i
    tokens = state.batch.tokens_out
    assert state.batch.steps - steps0 < sum(r["max_tokens"] for r in requests) - 10  # rows shared steps
    assert tokens > 0
    _idle(state)


def test_clients_that_leave_free_their_rows(smollm2, batching):
    """Bursts of streamed and whole-answer clients, a third hanging up part-way (``bench.bursts``): no 5xx,
    every completed answer equals the request made alone, and the batch's KV rows in use go back to zero after
    each burst (two bursts: nothing leaks). The 64 x 2 bursts with memory flat: bench test_serve_bursts."""
    from bench.bursts import burst

    srv, state = batching
    solo = {i: bitmtp.generate(smollm2, _chat(p), batcher=False, max_new_tokens=10).text for i, p in enumerate(PROMPTS)}
    for b in range(2):
        res = burst(srv.url, PROMPTS, clients=10, requests_each=2, max_tokens=10, disconnect=0.35, seed=b,
                    model=MODEL)
        _idle(state)
        assert not res.errors and res.server_errors == 0, (res.errors, res.statuses)
        assert set(res.statuses) <= {200, 429}, res.statuses
        assert res.disconnected and res.completed, (res.disconnected, len(res.completed))
        assert [(i, text) for i, text, _ in res.completed if text != solo[i]] == []
        assert state.batch.rows_in_use == 0


def test_metrics_are_prometheus_text_with_the_documented_names(batching):
    from bitmtp.serve.app import METRICS

    srv, state = batching
    httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": _chat("Hi"), "max_tokens": 3},
               timeout=120).raise_for_status()
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()
            values[name] = float(value)
    assert set(values) == {name for name, _, _ in METRICS}
    for name, kind, _ in METRICS:
        assert f"# TYPE {name} {kind}" in r.text
    assert values["bitmtp_batch_max"] == 4 and values["bitmtp_tokens_generated_total"] >= 3
    assert values["bitmtp_requests_batched_total"] >= 1 and values["bitmtp_requests_solo_total"] == 0
    assert values["bitmtp_kv_rows_in_use"] == 0 and values["bitmtp_requests_running"] == 0
    from tests.support.paths import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "serving.md").read_text()
    assert all(f"`{name}`" in doc for name, _, _ in METRICS)  # every metric is documented


@pytest.mark.parametrize("solo_when_idle", [False, True])
def test_a_lone_request_drafts_with_auto(smollm2, solo_when_idle):
    """A request arriving while nothing decodes: by default a batch of one, with solo_when_idle alone on the solo
    engine — policy auto either way, so its tokens can come from drafts (origins other than AR); the answer is the
    same."""
    from bitmtp.serve import create_app, run_in_thread

    app = create_app(smollm2, model_name=MODEL, max_batch=4, solo_when_idle=solo_when_idle)
    prompt = "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat"
    ref = bitmtp.generate(smollm2, _chat(prompt), batcher=False, max_new_tokens=24, policy="ar")
    with run_in_thread(app) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": _chat(prompt), "max_tokens": 24,
                             "bitmtp": {"origins": True}})
        assert r.status_code == 200, r.text
        st = app.state.bitmtp
        assert (st.solo_requests, st.batched_requests) == ((1, 0) if solo_when_idle else (0, 1))
        assert (st.solo is not None) == solo_when_idle  # no solo KV store unless asked for
        origins = {o["origin"] for o in r.json()["bitmtp"]["origins"]}
        assert origins - {"ar"}, origins  # drafts confirmed: auto ran
        assert r.json()["choices"][0]["message"]["content"] == ref.text


def test_bad_batch_options(smollm2):
    from bitmtp.errors import BitMTPError
    from bitmtp.serve import create_app

    with pytest.raises(BitMTPError, match=r"^max_batch: at most 16 requests"):
        create_app(smollm2, max_batch=17)
    with pytest.raises(BitMTPError, match=r"^max_batch: must be an integer >= 0, got -1"):
        create_app(smollm2, max_batch=-1)
    with pytest.raises(BitMTPError, match=r"^solo_when_idle: must be True or False"):
        create_app(smollm2, solo_when_idle="no")
    with pytest.raises(BitMTPError, match=r"^calibrate: must be True or False, got 1"):
        create_app(smollm2, calibrate=1)


@pytest.fixture
def counted_calibration(monkeypatch, tmp_path):
    """Step-cost measurements counted (each one quick: the prior table) in an empty cache, nothing memoised;
    the memo is emptied again afterwards, so later tests plan with the table measured for them."""
    from bitmtp.runtime import calibration

    measured: list[int] = []

    def measure(engine, **kwargs):
        measured.append(id(engine))
        return calibration.prior_cost_table(engine)

    monkeypatch.setenv("BITMTP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "measure_cost_table", measure)
    calibration.clear_memo()
    yield measured
    calibration.clear_memo()


@pytest.mark.parametrize("calibrate", [True, False])
def test_the_server_measures_step_costs_before_its_first_request(smollm2, counted_calibration, calibrate):
    """With solo_when_idle a server calibrates at startup on the KV store lone requests decode on, so that the
    first auto request of 64 tokens or more does not pay ~5 s for it (one client's first answer ran at 0.37x
    llama-server's speed); calibrate=False leaves the measurement to that request."""
    from bitmtp.serve import create_app, run_in_thread

    app = create_app(smollm2, model_name=MODEL, max_batch=2, calibrate=calibrate, solo_when_idle=True)
    with run_in_thread(app) as srv:
        state = app.state.bitmtp
        assert counted_calibration == ([id(state.solo.engine)] if calibrate else [])
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": "def fib(n):", "max_tokens": 64})
        assert r.status_code == 200, r.text
        assert state.solo_requests == 1
        assert counted_calibration == [id(state.solo.engine)]  # measured once, by the server or by the request


def test_a_batching_server_starts_without_measuring_step_costs(smollm2, counted_calibration):
    """By default every request joins the batch (a lone one as a batch of one, whose planner prices rows by the
    steps it ran): no solo KV store, nothing measured at startup or by the first request."""
    from bitmtp.serve import create_app, run_in_thread

    app = create_app(smollm2, model_name=MODEL, max_batch=2)
    with run_in_thread(app) as srv:
        state = app.state.bitmtp
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": "def fib(n):", "max_tokens": 64})
        assert r.status_code == 200, r.text
        assert state.solo is None and state.batched_requests == 1 and counted_calibration == []
