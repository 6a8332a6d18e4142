"""The OpenAI-compatible server against the real SmolLM2: the official openai client and raw HTTP,
streamed and not, chat and completions; answers at temperature 0 equal ``bitmtp.generate``'s; concurrent
streams; errors answered OpenAI-style while the server keeps serving."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

import bitmtp
from tests.support.smollm2 import PROMPTS

MODEL = "smollm2"  # tests/serve/conftest.py serves the model under this name
NEW = 12


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _sse(lines) -> list[dict]:
    """The JSON events of a server-sent event stream, checking it ends with ``data: [DONE]``."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "an event after [DONE]"
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    assert done, "the stream did not end with data: [DONE]"
    return events


def _good_request(server) -> None:
    """A request after an error: the server still answers."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": _chat("Hi"), "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_models_and_health(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["sessions"] == 4
    assert health.json()["max_batch"] == 4
    assert health.headers["x-bitmtp-replica"] == health.json()["replica"]


def test_chat_equals_generate_openai_client(smollm2, openai_client):
    ref = bitmtp.generate(smollm2, _chat(PROMPTS[0]), batcher=False, max_new_tokens=NEW)
    resp = openai_client.chat.completions.create(model=MODEL, messages=_chat(PROMPTS[0]), max_tokens=NEW,
                                                 temperature=0)
    choice = resp.choices[0]
    assert choice.message.content == ref.text and choice.message.role == "assistant"
    assert choice.finish_reason == {"eos": "stop", "max_new_tokens": "length"}[ref.stop_reason]
    assert resp.usage.prompt_tokens == ref.prompt_tokens and resp.usage.completion_tokens == len(ref.token_ids)
    ext = resp.model_extra["bitmtp"]  # the decoding stats ride along in the extension field
    assert ext["stats"]["policy"] == "auto" and ext["stop_reason"] == ref.stop_reason and ext["replica"]


def test_chat_stream_equals_generate_with_usage(smollm2, openai_client):
    ref = bitmtp.generate(smollm2, _chat(PROMPTS[1]), batcher=False, max_new_tokens=NEW)
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=_chat(PROMPTS[1]), max_tokens=NEW,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length" if ref.stop_reason == "max_new_tokens" else "stop"]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]  # the usage chunk: no choices
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.prompt_tokens == ref.prompt_tokens


def test_completions_equal_generate_raw_http_and_client(smollm2, server, openai_client):
    prompt = "The three primary colors are"
    ref = bitmtp.generate(smollm2, prompt, batcher=False, max_new_tokens=NEW)
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": NEW, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == ref.text
    assert body["bitmtp"]["stats"]["iterations"] >= 1
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": NEW, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = _sse(s.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events) == ref.text
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "bitmtp" in events[-1]
    # token ids as the prompt, through the client
    ids = smollm2.encode(prompt)
    resp = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW, temperature=0)
    assert resp.choices[0].text == ref.text


def test_chat_raw_http_stream(smollm2, server):
    ref = bitmtp.generate(smollm2, _chat(PROMPTS[2]), batcher=False, max_new_tokens=NEW)
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": _chat(PROMPTS[2]), "max_tokens": NEW, "stream": True}) as s:
        events = _sse(s.iter_lines())
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == ref.text
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL for e in events)
    assert len({e["id"] for e in events}) == 1


def test_eight_concurrent_streaming_clients_get_their_solo_answers(smollm2, server):
    openai = pytest.importorskip("openai")
    prompts = PROMPTS[:8]
    solo = {p: bitmtp.generate(smollm2, _chat(p), batcher=False, max_new_tokens=NEW).text for p in prompts}
    got: dict[str, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def client(p: str) -> None:
        try:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            start.wait()
            stream = c.chat.completions.create(model=MODEL, messages=_chat(p), max_tokens=NEW, stream=True)
            got[p] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == solo


BAD = [  # (body, status, param, code): each an error response, then the server still answers
    ('{"model": "smollm2", "messages": [', 400, None, "invalid_json"),
    ('[1, 2]', 400, None, None),
    ({"messages": "hello"}, 400, "messages", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages", None),
    ({"messages": _chat("x"), "temperature": -0.5}, 400, "temperature", None),
    ({"messages": _chat("x"), "temperature": "hot"}, 400, "temperature", None),
    ({"messages": _chat("x"), "top_p": 0}, 400, "top_p", None),
    ({"messages": _chat("x"), "max_tokens": "ten"}, 400, "max_tokens", None),
    ({"messages": _chat("x"), "max_tokens": 0}, 400, "max_tokens", None),
    ({"messages": _chat("x"), "max_tokens": 100_000}, 400, "max_tokens", "context_length_exceeded"),
    ({"messages": _chat("x " * 600)}, 400, "messages", "context_length_exceeded"),
    ({"messages": _chat("x"), "stream": "yes"}, 400, "stream", None),
    ({"messages": _chat("x"), "stop": 3}, 400, "stop", None),
    ({"messages": _chat("x"), "n": 2}, 400, "n", None),
    ({"messages": _chat("x"), "presence_penalty": 3}, 400, "presence_penalty", None),
    ({"messages": _chat("x"), "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ({"messages": _chat("x"), "seed": 1.5}, 400, "seed", None),
    ({"messages": _chat("x"), "top_logprobs": 2}, 400, "top_logprobs", None),
    ({"messages": _chat("x"), "bitmtp": True}, 400, "bitmtp", None),
    ({"messages": _chat("x"), "bitmtp": {"origin": True}}, 400, "bitmtp", None),
    ({"messages": _chat("x"), "bitmtp": {"origins": "yes"}}, 400, "bitmtp", None),
    ({"model": "gpt-4o", "messages": _chat("x")}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("body,status,param,code", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param, code):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/chat/completions", content=content, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code
    if param:
        assert err["message"].startswith(param + ":")
    _good_request(server)


def test_bad_completion_prompts(server):
    for prompt, message in ((["a", "b"], "batch"), ("", "empty"), ([1, -3], "outside"), (None, "expected")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert message in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "logprobs": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    _good_request(server)


def test_openai_client_raises_on_errors(openai_client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.chat.completions.create(model=MODEL, messages=_chat("x"), temperature=-1)
    assert exc.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="gpt-4o", messages=_chat("x"))


def _wait_idle(url: str) -> dict:
    """/health once no request holds a KV store (a disconnected stream's thread releases its store after
    its next piece)."""
    for _ in range(600):
        health = httpx.get(url + "/health").json()
        if health["busy"] == 0 and health["waiting"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"the server never went idle: {health}")


@pytest.mark.parametrize("max_batch", [0, 1])
def test_queue_full_is_429_and_a_dropped_stream_frees_its_kv_store(smollm2, max_batch):
    """One place (one session, or a batch of one), no queue: a second request is a 429; a client that leaves
    mid-stream stops its generation and frees its KV store."""
    from bitmtp.serve import create_app, run_in_thread

    app = create_app(smollm2, model_name=MODEL, sessions=1, queue_size=0, max_batch=max_batch)
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
    with run_in_thread(app) as srv:
        st = app.state.bitmtp
        n_prompt = len(smollm2.encode(prompt))
        room = 200  # tokens asked for: read to the end, the answer has them all
        full = httpx.post(srv.url + "/v1/completions", timeout=300, json={"prompt": prompt, "max_tokens": room})
        assert full.json()["usage"]["completion_tokens"] == room
        # tokens decoded so far: a batch of one (max_batch 1) or the one session's engine (its next row)
        decoded = (lambda: st.batch.tokens_out) if max_batch else (lambda: st.pool.sessions[0].engine.n - n_prompt)
        before = decoded() if max_batch else 0
        with httpx.Client(timeout=120) as holder, holder.stream(
                "POST", srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": room, "stream": True}) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")  # the one KV store is taken
            r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": _chat("Hi"), "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
        # the client went away mid-stream: its generation stopped early and the store is free again
        assert _wait_idle(srv.url)["busy"] == 0
        assert decoded() - before < room, "the dropped stream was decoded to the end"
        if max_batch:
            assert st.batch.rows_in_use == 0
        _good_request(srv)


def test_missing_fastapi_names_the_extra(monkeypatch, smollm2):
    import sys

    from bitmtp.errors import BitMTPError
    from bitmtp.serve import create_app

    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    with pytest.raises(BitMTPError, match=r"pip install 'bitmtp\[serve\]'"):
        create_app(smollm2)


# --- sampling: the OpenAI fields reach bitmtp.generate -----------------------------------------------------

def test_seeded_sampling_equals_generate_and_repeats(smollm2, openai_client):
    kw = dict(temperature=0.8, top_p=0.9, seed=1234)
    ref = bitmtp.generate(smollm2, _chat(PROMPTS[5]), batcher=False, max_new_tokens=NEW, **kw)
    resp = openai_client.chat.completions.create(model=MODEL, messages=_chat(PROMPTS[5]), max_tokens=NEW, **kw)
    assert resp.choices[0].message.content == ref.text and resp.model_extra["bitmtp"]["seed"] == 1234
    stream = openai_client.chat.completions.create(model=MODEL, messages=_chat(PROMPTS[5]), max_tokens=NEW,
                                                   stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text
    # extensions: top_k, min_p, repetition_penalty
    ext = dict(temperature=0.7, top_k=20, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
               frequency_penalty=0.3, seed=5)
    ref2 = bitmtp.generate(smollm2, _chat(PROMPTS[5]), batcher=False, max_new_tokens=NEW, **ext)
    resp2 = openai_client.chat.completions.create(
        model=MODEL, messages=_chat(PROMPTS[5]), max_tokens=NEW, temperature=0.7, seed=5, presence_penalty=0.5,
        frequency_penalty=0.3, extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2})
    assert resp2.choices[0].message.content == ref2.text


def test_an_unseeded_sample_reports_its_seed(openai_client):
    resp = openai_client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=NEW,
                                            temperature=1.0)
    seed = resp.model_extra["bitmtp"]["seed"]
    assert isinstance(seed, int)
    again = openai_client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=NEW,
                                             temperature=1.0, seed=seed)
    assert again.choices[0].text == resp.choices[0].text


def test_stop_strings_streamed_and_not(smollm2, server, openai_client):
    prompt, stop = "Count: 1, 2, 3,", [" 6", "nine"]
    ref = bitmtp.generate(smollm2, prompt, batcher=False, max_new_tokens=20, stop=stop)
    assert ref.stop_reason == "stop" and " 6" not in ref.text
    resp = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stop=stop)
    assert resp.choices[0].text == ref.text and resp.choices[0].finish_reason == "stop"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 20, "stop": stop, "stream": True}) as s:
        events = _sse(s.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events) == ref.text  # the stop text is never sent
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_of_the_chosen_tokens(smollm2, server, openai_client):
    kw = dict(temperature=0.8, seed=9)
    ref = bitmtp.generate(smollm2, _chat(PROMPTS[6]), batcher=False, max_new_tokens=NEW, logprobs=True, **kw)
    resp = openai_client.chat.completions.create(model=MODEL, messages=_chat(PROMPTS[6]), max_tokens=NEW,
                                                 logprobs=True, **kw)
    content = resp.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(ref.logprobs)
    assert "".join(c.token for c in content) == ref.text and all(c.top_logprobs == [] for c in content)
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=_chat(PROMPTS[6]), max_tokens=NEW,
                                                        logprobs=True, stream=True, **kw))
    streamed = [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx(ref.logprobs)
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": "The sky is", "max_tokens": NEW, "logprobs": 0})
    greedy = bitmtp.generate(smollm2, "The sky is", batcher=False, max_new_tokens=NEW, logprobs=True)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(greedy.logprobs) and "".join(lp["tokens"]) == greedy.text
    assert lp["text_offset"][0] == 0 and all(v <= 0 for v in lp["token_logprobs"])


def test_an_error_raised_by_generate_is_a_400_naming_the_field(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": _chat("x"), "stop": [f"s{i}" for i in range(17)]})  # generate takes 16
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    assert r.json()["error"]["message"].startswith("stop: ")
    _good_request(server)


def test_bad_app_options(smollm2):
    from bitmtp.errors import BitMTPError
    from bitmtp.serve import create_app

    with pytest.raises(BitMTPError, match=r"^sessions: must be an integer >= 1, got 0"):
        create_app(smollm2, sessions=0)
    with pytest.raises(BitMTPError, match=r"^queue_size: must be an integer >= 0, got -1"):
        create_app(smollm2, queue_size=-1)
    for bad in (-0.01, 11, float("nan"), float("inf"), True, "0.1", None):
        with pytest.raises(BitMTPError, match=r"^stream_interval: must be a number of seconds in \[0, 10\]"):
            create_app(smollm2, stream_interval=bad)


@pytest.mark.parametrize("interval", [0, 10])
def test_stream_interval_holds_pieces_back_but_never_text(smollm2, interval):
    """``stream_interval`` 0: one chunk per piece of text a step commits (the server's step counter); 10 s: the first's
    text at once, everything else in one chunk at the end. Either way the text is the whole answer's."""
    from bitmtp.serve import create_app, run_in_thread

    ref = bitmtp.generate(smollm2, _chat(PROMPTS[3]), batcher=False, max_new_tokens=NEW)
    with run_in_thread(create_app(smollm2, model_name=MODEL, stream_interval=interval)) as srv:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120,
                          json={"model": MODEL, "messages": _chat(PROMPTS[3]), "max_tokens": NEW, "stream": True}) as s:
            events = _sse(s.iter_lines())
        steps = httpx.get(srv.url + "/health", timeout=10).json()["steps"]
    pieces = [e["choices"][0]["delta"]["content"] for e in events[1:] if e["choices"][0]["delta"].get("content")]
    assert "".join(pieces) == ref.text
    assert steps >= 3  # several steps, so that holding back shows
    assert len(pieces) == (2 if interval else steps)


def test_a_bug_is_an_openai_500_and_the_server_keeps_serving(server, monkeypatch):
    import bitmtp.serve.app as app_module

    def boom(*args, **kwargs):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(app_module, "parse_request", boom)
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": _chat("x")}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert "ZeroDivisionError: planted" in r.json()["error"]["message"]
    monkeypatch.undo()
    _good_request(server)


#: a prompt whose greedy answer repeats text of the prompt: prompt lookup's guesses are accepted (policy auto)
REPEAT = _chat("Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the "
               "lazy dog.")


def _spans_of(events: list[dict]) -> tuple[str, list[dict]]:
    """A chat stream's text and its origin spans, checking each chunk's spans concatenate to its text."""
    text, spans = "", []
    for e in events:
        if not e["choices"] or not e["choices"][0]["delta"].get("content"):
            continue
        piece = e["choices"][0]["delta"]["content"]
        got = e["bitmtp"]["origins"]
        assert "".join(sp["text"] for sp in got) == piece  # aligned with the chunk's text
        text += piece
        spans += got
    return text, spans


@pytest.mark.parametrize("interval", [0, 10])
def test_origins_ride_along_on_request(smollm2, interval):
    """``"bitmtp": {"origins": true}``: every text chunk carries its tokens' origins and steps, aligned with its
    text (held-back text brings its spans along); they are ``generate``'s per-token origins; a whole answer
    carries the text's spans; without the option no chunk has them."""
    from bitmtp.serve import create_app, run_in_thread

    ref = bitmtp.generate(smollm2, REPEAT, batcher=False, max_new_tokens=24)
    assert "lookup" in ref.origins and len(ref.origins) == len(ref.steps) == len(ref.token_ids)
    body = {"model": MODEL, "messages": REPEAT, "max_tokens": 24, "stream": True, "bitmtp": {"origins": True}}
    with run_in_thread(create_app(smollm2, model_name=MODEL, stream_interval=interval)) as srv:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120, json=body) as s:
            events = _sse(s.iter_lines())
        whole = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={**body, "stream": False}).json()
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120,
                          json={**body, "bitmtp": None}) as s:
            plain = _sse(s.iter_lines())
    text, spans = _spans_of(events)
    assert text == ref.text
    # one span per token with text of its own (SmolLM2's answer here: every token; a token whose text is split
    # between the first chunk and the rest gives two). Which draft proposed a token is the policy's choice
    # (auto plans from what it learned in earlier generations): the tokens are fixed, their origins are not
    texts = [smollm2.tokenizer.decode([t], skip_special_tokens=True) for t in ref.token_ids]
    owners = sum(1 for t in texts if t)
    assert owners <= len(spans) <= owners + (1 if interval else 0)
    steps = [sp["step"] for sp in spans]
    assert steps[0] == 0 and steps == sorted(steps) and steps[-1] < len(ref.token_ids)
    assert {sp["origin"] for sp in spans} <= {"ar", "lookup", "mask", "heads", "runner_up"}
    assert "lookup" in {sp["origin"] for sp in spans}  # the answer repeats the prompt
    assert events[-1]["choices"][0]["finish_reason"] and "origins" not in events[-1]["bitmtp"]
    assert whole["choices"][0]["message"]["content"] == ref.text
    assert "".join(sp["text"] for sp in whole["bitmtp"]["origins"]) == ref.text
    assert len(whole["bitmtp"]["origins"]) == owners
    assert all("origins" not in e.get("bitmtp", {}) for e in plain)


def test_chat_page_is_served(server):
    r = httpx.get(server.url + "/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and "<script" in r.text


def test_a_repeated_prompt_reuses_its_kv_rows_and_says_so(smollm2, server):
    """The second of two lone requests with one prompt reuses the first's KV rows (the prompt-prefix cache of the
    batch engine, ``BatchSchedule``): the same answer, ``usage.prompt_tokens_details.cached_tokens`` = all its
    prompt but the last token; a request sharing only the chat template's start reuses that much."""
    # the server's batch engine is the model's (model.batcher(4)), shared with the earlier tests' servers and
    # generate calls: forget the prompts they left in its cache (one of them may start like PROMPTS[3])
    smollm2.batcher(4).schedule.kept.clear()
    body = {"model": MODEL, "messages": _chat(PROMPTS[2]), "max_tokens": NEW}
    first = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    again = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    prompt = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt - 1}
    other = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={**body, "messages": _chat(PROMPTS[3])}).json()
    shared = len(smollm2.encode(_chat("")))  # at most the template's turn start is shared
    assert 0 < other["usage"]["prompt_tokens_details"]["cached_tokens"] < shared
    ref = bitmtp.generate(smollm2, _chat(PROMPTS[3]), batcher=False, max_new_tokens=NEW)
    assert other["choices"][0]["message"]["content"] == ref.text
