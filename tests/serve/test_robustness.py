"""The server never answers 5xx to a client's input and never stalls (issue 42): request bodies that are
not valid requests (deep nesting, bad encodings, lone surrogates, huge numbers, wrong types) are 400s;
what it writes is always JSON (a logprob of -inf is null); tokenizing a huge prompt does not hold up
``/health``; clients that leave, streamed or not, stop their generation; a body cut short is a 408.
A seeded fuzzer throws all of it, mixed, at a live server."""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

import bitmtp
from bitmtp.serve.body import MAX_DEPTH, dumps, parse_body
from bitmtp.serve.errors import APIError
from tests.support.health_probe import PROBE as _PROBE
from tests.support.paths import REPO_ROOT

MODEL = "smollm2"  # tests/serve/conftest.py serves the model under this name
#: a prompt SmolLM2 continues for hundreds of tokens without stopping
COUNT = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def _strict_json(text: str | bytes) -> Any:
    """``json.loads`` that refuses NaN / Infinity (Python's accepts them; JSON has neither)."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON: {text[:300]!r}")

    return json.loads(text, parse_constant=refuse)


def _check_error(r: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """An OpenAI-style error: a 4xx (``status`` if given) with ``{"error": {message, type, param, code}}``."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if status is not None:
        assert r.status_code == status, r.text[:500]
    err = _strict_json(r.content)["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err


def _post(url: str, content: bytes | str, path: str = "/v1/chat/completions",
          content_type: str | None = "application/json") -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(url + path, content=content, headers=headers, timeout=120)


def _good_request(url: str) -> None:
    """The server still answers a normal request."""
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def _health(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/health", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_health(url: str, ok, timeout: float = 120.0) -> dict[str, Any]:
    """/health once ``ok(health)`` holds (polled; ``timeout`` is only a guard against a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        health = _health(url)
        if ok(health):
            return health
        assert time.monotonic() < deadline, f"/health never got there: {health}"
        time.sleep(0.02)


def _idle(h: dict[str, Any]) -> bool:
    return h["busy"] == 0 and h["waiting"] == 0 and h["parsing"] == 0


# --- parse_body and dumps, without a server ----------------------------------------------------------------

PARSE_BODY_CASES = [  # (raw body, code, param)
    (b"[" * 50_000 + b"]" * 50_000, "nesting_too_deep", None),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nesting_too_deep", None),
    (b'{"messages":' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", "nesting_too_deep", "messages"),
    (b'{"messages":[{"role":"user","content":"hi \\ud800"}]}', "invalid_encoding", "messages"),
    (b'{"prompt":"\\udc00"}', "invalid_encoding", "prompt"),
    (b'{"\\ud800":1}', "invalid_encoding", None),
    (b'{"prompt":"caf\xe9"}', "invalid_encoding", None),  # latin-1, not UTF-8
    (b'{"prompt":"\xed\xa0\x80"}', "invalid_encoding", None),  # a surrogate encoded as UTF-8
    (b'{"prompt":"\xff"}', "invalid_encoding", None),
    (b'{"temperature":1e400}', "number_out_of_range", "temperature"),
    (b'{"temperature":-1e400}', "number_out_of_range", "temperature"),
    (b'{"max_tokens":' + b"9" * 5000 + b"}", "number_out_of_range", "max_tokens"),
    (b'{"seed":18446744073709551616}', "number_out_of_range", "seed"),  # 2**64
    (b'{"seed":-9223372036854775809}', "number_out_of_range", "seed"),  # -2**63 - 1
    (b'{"top_p":NaN}', "number_out_of_range", "top_p"),
    (b'{"top_p":Infinity}', "number_out_of_range", "top_p"),
    (b'{"stop":[-Infinity]}', "number_out_of_range", "stop"),
    (b'{"prompt":', "invalid_json", None),
    (b"", "invalid_json", None),
]


@pytest.mark.parametrize("raw,code,param", PARSE_BODY_CASES, ids=[f"{i}-{c[1]}" for i, c in
                                                                  enumerate(PARSE_BODY_CASES)])
def test_parse_body_refuses_what_is_not_a_request(raw, code, param):
    with pytest.raises(APIError) as exc:
        parse_body(raw)
    err = exc.value
    assert err.status == 400 and err.code == code and err.param == param, err.message
    assert len(err.message) < 600, "an error quotes at most a few dozen characters of what it refuses"


def test_parse_body_takes_what_is_valid():
    assert parse_body(b'\xef\xbb\xbf{"prompt": "x"}') == {"prompt": "x"}  # a UTF-8 BOM is ignored
    assert parse_body('{"p": "\\ud83d\\ude00 é"}'.encode()) == {"p": "\U0001f600 é"}  # a surrogate pair
    assert parse_body(b'{"seed": 18446744073709551615, "s": -9223372036854775808, "t": 1e-400}') == {
        "seed": 2**64 - 1, "s": -(2**63), "t": 0.0}
    deep = b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1)
    assert parse_body(deep) is not None


def test_dumps_writes_json_only():
    text = dumps({"lp": [float("-inf"), float("nan"), float("inf"), -1.5], "t": ("a", 1), "s": "\ud800"})
    assert _strict_json(text) == {"lp": [None, None, None, -1.5], "t": ["a", 1], "s": "\ud800"}
    text.encode("utf-8")  # a lone surrogate is escaped, so the text always encodes


# --- a live server: dedicated cases --------------------------------------------------------------------------

def test_deep_nesting_is_a_400(server):
    for raw, path in (("[" * 50_000 + "]" * 50_000, "/v1/chat/completions"),
                      ('{"prompt":' + '{"a":' * 50_000 + "1" + "}" * 50_001, "/v1/completions"),
                      ('{"messages":[{"role":"user","content":' + "[" * 100 + "]" * 100 + "}]}",
                       "/v1/chat/completions")):
        err = _check_error(_post(server.url, raw, path), 400)
        assert err["code"] == "nesting_too_deep" and "nested too deeply" in err["message"]
    _good_request(server.url)


def test_lone_surrogates_and_bad_utf8_are_a_400(server):
    chat = '{"messages":[{"role":"user","content":"Hi \\ud800 there"}],"max_tokens":2}'
    err = _check_error(_post(server.url, chat), 400)
    assert err["param"] == "messages" and err["code"] == "invalid_encoding" and "surrogate" in err["message"]
    assert err["message"].startswith("messages[0].content: ")
    prompt = '{"prompt":"Hi \\udfff","max_tokens":2}'
    err = _check_error(_post(server.url, prompt, "/v1/completions"), 400)
    assert err["param"] == "prompt" and err["code"] == "invalid_encoding"
    parts = '{"messages":[{"role":"user","content":[{"type":"text","text":"\\ud800"}]}]}'
    assert _check_error(_post(server.url, parts), 400)["message"].startswith("messages[0].content[0].text: ")
    for raw in (b'{"prompt":"Hi \xff\xfe","max_tokens":2}', b'{"prompt":"\xed\xa0\x80","max_tokens":2}',
                '{"prompt":"caf\u00e9","max_tokens":2}'.encode("latin-1")):
        err = _check_error(_post(server.url, raw, "/v1/completions"), 400)
        assert err["code"] == "invalid_encoding" and "UTF-8" in err["message"]
    # an astral character, escaped as a surrogate pair as JSON wants it, is text like any other
    ok = _post(server.url, '{"prompt":"Smile \\ud83d\\ude00","max_tokens":2}', "/v1/completions")
    assert ok.status_code == 200, ok.text
    _good_request(server.url)


def test_huge_numbers_are_a_400(server):
    cases = [  # (field: JSON text, param, code)
        ('"temperature": 1e400', "temperature", "number_out_of_range"),
        ('"top_p": -1e400', "top_p", "number_out_of_range"),
        ('"max_tokens": ' + "1" + "0" * 5000, "max_tokens", "number_out_of_range"),
        ('"max_tokens": 18446744073709551616', "max_tokens", "number_out_of_range"),
        ('"max_tokens": 9223372036854775807', "max_tokens", "context_length_exceeded"),
        ('"seed": ' + "9" * 400, "seed", "number_out_of_range"),
        ('"temperature": NaN', "temperature", "number_out_of_range"),
        ('"frequency_penalty": -Infinity', "frequency_penalty", "number_out_of_range"),
        ('"top_k": 1e308', "top_k", None),  # a finite double, but top_k takes integers
    ]
    for field, param, code in cases:
        raw = '{"prompt": "Hi", ' + field + "}"
        err = _check_error(_post(server.url, raw, "/v1/completions"), 400)
        assert err["param"] == param and err["code"] == code, (field, err)
    _good_request(server.url)


def _minus_infinity_logprobs(monkeypatch) -> None:
    """``bitmtp.generate`` (as the server calls it) reporting -inf for every logprob: what an underflowed
    temperature gave, whatever the sampler does now."""
    real = bitmtp.generate

    class Stream:
        def __init__(self, stream: Any):
            self.stream, self.result = stream, None

        def __iter__(self) -> Stream:
            return self

        def __next__(self) -> str:
            try:
                return next(self.stream)
            except StopIteration:
                out = self.stream.result
                self.result = dataclasses.replace(out, logprobs=[float("-inf")] * len(out.token_ids))
                raise

        def close(self) -> None:
            self.stream.close()

    def generate(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        return Stream(out) if kwargs.get("stream") else dataclasses.replace(out, logprobs=[float("-inf")])

    monkeypatch.setattr(bitmtp, "generate", generate)


def test_logprobs_of_minus_infinity_are_null_streamed_and_not(server, monkeypatch):
    _minus_infinity_logprobs(monkeypatch)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    content = _strict_json(r.content)["choices"][0]["logprobs"]["content"]
    assert content and all(c["logprob"] is None for c in content)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    lp = _strict_json(r.content)["choices"][0]["logprobs"]
    assert lp["token_logprobs"] and all(v is None for v in lp["token_logprobs"])
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=120) as s:
        assert s.status_code == 200
        events = [line[len("data: "):] for line in s.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [_strict_json(e) for e in events[:-1]]  # every event is JSON: no -Infinity
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][0]
    assert all(c["logprob"] is None for c in last["choices"][0]["logprobs"]["content"])
    monkeypatch.undo()
    # and the underflowed temperature itself, whatever the sampler makes of it: JSON, never a 5xx
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "prompt": "Hi", "max_tokens": 3, "logprobs": 0, "temperature": 1e-300, "stream": stream})
        assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
        for line in r.text.splitlines() if stream else [r.text]:
            if line.strip() and line != "data: [DONE]":
                _strict_json(line.removeprefix("data: "))




def _tokenizer_holds_the_gil(model: Any) -> bool:
    """Whether ``model.encode`` of a long text keeps other Python threads from running (a tokenizer that
    holds the GIL stalls the event loop from any thread; only one that releases it can be worked around
    by a thread)."""
    text = "hello world, this is a test. " * 20_000  # 580 kB: about half a second of tokenizing
    done = threading.Event()
    took: list[float] = []

    def work() -> None:
        t = time.perf_counter()
        model.encode(text)
        took.append(time.perf_counter() - t)
        done.set()

    thread = threading.Thread(target=work)
    last, gap = time.perf_counter(), 0.0
    thread.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    thread.join()
    return gap > 0.5 * took[0]


def test_health_answers_while_a_huge_prompt_is_tokenized(smollm2):
    """The prompt is tokenized on a parse thread: /health, measured from another process (a stalled event
    loop would stall it; a client in this process would be stalled by the GIL too), keeps answering. The
    acceptance figure (within 100 ms during a 9 MB prompt) is printed, not asserted: CI machines are noisy."""
    from bitmtp.serve import create_app, run_in_thread

    # first the cause, named: no thread keeps the event loop running while a tokenizer holds the GIL
    assert not _tokenizer_holds_the_gil(smollm2), (
        "the model's tokenizer holds the GIL while it encodes (tokenizers' Tokenizer.encode does, encode_batch "
        "releases it): see GGUFTokenizer.encode in bitmtp/formats/gguf_tokenizer.py")
    prompt = "hello world, this is a test. " * 70_000  # 2 MB: seconds of tokenizing
    with run_in_thread(create_app(smollm2, model_name=MODEL, sessions=1, queue_size=1)) as srv:
        probe = subprocess.Popen([sys.executable, "-c", _PROBE, srv.url, "120"], stdout=subprocess.PIPE, text=True,
                                 cwd=str(REPO_ROOT))
        try:
            assert probe.stdout.readline().strip() == "ready"
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=300)
            out, _ = probe.communicate(timeout=180)
        finally:
            probe.kill()
        err = _check_error(r, 400)  # far beyond the KV store: known once it is tokenized
        assert err["code"] == "context_length_exceeded"
        during = json.loads(out.strip().splitlines()[-1])
        print(f"/health during a {len(prompt) / 1e6:.1f} MB tokenization: {len(during)} answers, median "
              f"{statistics.median(during) * 1e3:.1f} ms, max {max(during) * 1e3:.1f} ms")
        assert len(during) >= 3, f"/health hardly answered while the prompt was tokenized: {during}"
        assert statistics.median(during) < 1.0, during
        assert _wait_health(srv.url, _idle)["parsing"] == 0


def _raw_request(body: bytes, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.mark.parametrize("places", [dict(sessions=2, max_batch=0), dict(max_batch=2)], ids=["sessions", "batch"])
def test_six_non_streamed_clients_that_leave_free_the_server(smollm2, places):
    """Two decode (on two KV stores, or one alone and one in the batch), four wait for a place; all six hang
    up: each stops within a step or two of its client leaving (the server's own step counter), not at
    max_tokens, and the server is idle again."""
    from bitmtp.serve import create_app, run_in_thread

    max_tokens = 400
    with run_in_thread(create_app(smollm2, model_name=MODEL, queue_size=8, **places)) as srv:
        start = _health(srv.url)
        request = _raw_request(json.dumps({"prompt": COUNT, "max_tokens": max_tokens}).encode())
        clients = [socket.create_connection((srv.host, srv.port)) for _ in range(6)]
        try:
            for c in clients:
                c.sendall(request)
            # both KV stores decoding (a few steps in), four requests waiting for one
            _wait_health(srv.url, lambda h: h["busy"] == 2 and h["waiting"] == 4 and h["steps"] >= start["steps"] + 4)
            before = _health(srv.url)
        finally:
            for c in clients:
                c.close()
        after = _wait_health(srv.url, _idle)
        assert after["cancelled"] - start["cancelled"] == 6, after
        run_on = after["steps"] - before["steps"]
        # within one step each (a step or two more for the time the hang-up takes to arrive); a generation
        # run to max_tokens would have taken on the order of a hundred more steps each
        assert run_on <= 2 * 8, f"the generations went on for {run_on} steps after their clients left"
        assert after["steps"] - start["steps"] < max_tokens // 4
        _good_request(srv.url)


def test_a_body_cut_short_gets_a_408_and_the_connection_closes(smollm2):
    from bitmtp.serve import create_app, run_in_thread

    def answer_to(head_and_part: bytes) -> bytes:
        """What the server sends to a client that sends ``head_and_part`` and then nothing more."""
        with socket.create_connection((srv.host, srv.port), timeout=60) as c:
            c.sendall(head_and_part)
            data = b""
            while chunk := c.recv(65536):  # until the server closes the connection
                data += chunk
        return data

    with run_in_thread(create_app(smollm2, model_name=MODEL, body_timeout=0.5)) as srv:
        short = _raw_request(b'{"prompt": "Hi", "max_tokens": 2}')[:-10]  # 10 bytes fewer than Content-Length
        chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")  # a chunked body never ended
        for request in (short, chunked):
            data = answer_to(request)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 "), data[:300]
            assert b"connection: close" in head.lower()
            err = _strict_json(body)["error"]
            assert err["code"] == "request_timeout" and "did not arrive within 0.5 s" in err["message"]
        # a client that hangs up halfway through its body: nothing to answer, and the server goes on
        with socket.create_connection((srv.host, srv.port)) as c:
            c.sendall(short)
        _good_request(srv.url)
        assert _wait_health(srv.url, _idle)["busy"] == 0


def test_bad_body_timeout(smollm2):
    from bitmtp.errors import BitMTPError
    from bitmtp.serve import create_app

    for bad in (0, -1, float("inf"), float("nan"), "30", True):
        with pytest.raises(BitMTPError, match=r"^body_timeout: must be a finite number of seconds > 0"):
            create_app(smollm2, body_timeout=bad)
    create_app(smollm2, body_timeout=None)  # no limit


# --- the fuzzer ------------------------------------------------------------------------------------------------

def _deep(n: int, kind: str = "[") -> str:
    return ("[" * n + "]" * n) if kind == "[" else ('{"a":' * n + "1" + "}" * n)


#: odd JSON values (as JSON text) for any field
ODD_VALUES = [
    "null", "true", "false", "0", "1", "-1", "0.5", "-0.0", "1e-300", "5e-324", "1e308", "-1e308", "2",
    "9223372036854775807", "-9223372036854775808", "18446744073709551615", "18446744073709551616",
    "1" + "0" * 400, "1e400", "-1e400", "NaN", "Infinity", "-Infinity", '""', '"x"', '"\\ud800"', '"a\\udfffb"',
    '"\\ud83d\\ude00"', '"\\u0000"', '"' + "y" * 100_000 + '"', "[]", "[1]", '["a"]', '["a", "b"]', "[[1, 2]]",
    "[-1]", "[9223372036854775807]", "{}", '{"a": 1}', '{"include_usage": true}', '{"include_usage": "yes"}',
    _deep(70), _deep(70, "{"), _deep(3000), '["s"' + ', "s"' * 20 + "]", '[{"type": "text", "text": "Hi"}]',
    '[{"type": "image_url"}]', '[{"type": "text", "text": "\\udc00"}]',
]
#: what max_tokens may be in the fuzzer: never a valid large number (a chat answer then runs to the end of
#: the KV store: seconds each)
ODD_MAX_TOKENS = ["0", "-1", "1", "2", "1.5", '"2"', "true", "[]", "{}", "100000", "9223372036854775807", "1e400",
                  "18446744073709551616", "NaN", '"\\ud800"', _deep(70)]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stream",
          "stream_options", "logprobs", "top_logprobs", "n", "best_of", "echo", "suffix", "logit_bias", "tools",
          "user", "\\ud800", "x" * 1000]
CONTENT_TYPES = [None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=xyz", "application/json; charset=latin-1", "image/png", ""]


def _fuzz_body(rng: random.Random) -> tuple[str, bytes]:
    """A path and a request body: a valid one with a few fields made odd, or a broken one."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    shape = rng.random()
    if shape < 0.15:  # broken as a whole
        raw = rng.choice([
            _deep(50_000).encode(), _deep(50_000, "{").encode(), _deep(MAX_DEPTH + 1).encode(), b"", b"null",
            b"42", b'"text"', b"[]", b'{"messages": [', b"\xff\xfe{}", '{"prompt": "Hi"}'.encode("utf-16"),
            b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "Hi"} trailing', b"\x00" * 100, rng.randbytes(200),
            b'{"prompt": "' + b"z" * 300_000 + b'"}', b'{"a": 1, "a": 2}',
        ])
        return path, raw
    if chat:
        fields = {"messages": json.dumps([{"role": "user", "content": "Hi"}]), "max_tokens": "2"}
    else:
        fields = {"prompt": '"The sky is"', "max_tokens": "2"}
    if rng.random() < 0.3:
        fields["stream"] = "true"
        if rng.random() < 0.5:
            fields["stream_options"] = '{"include_usage": true}'
    if rng.random() < 0.25:  # valid: sampling fields at their limits, logprobs
        for name, values in (("temperature", ["0", "1e-300", "5e-324", "0.7", "1e308"]), ("top_p", ["1e-300", "1"]),
                             ("top_k", ["-1", "0", "1", "9223372036854775807"]), ("min_p", ["0", "1"]),
                             ("repetition_penalty", ["1e-300", "1e300", "1.1"]), ("presence_penalty", ["-2", "2"]),
                             ("seed", ["0", "-9223372036854775808", "18446744073709551615"]),
                             ("stop", ['"\\n"', '["x", "\\ud83d\\ude00"]', "[]"]),
                             ("logprobs", ["true"] if chat else ["0"])):
            if rng.random() < 0.5:
                fields[name] = rng.choice(values)
        return path, ("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode()
    for _ in range(rng.choice([1, 1, 2, 3])):
        name = rng.choice(FIELDS)
        if name in ("max_tokens", "max_completion_tokens"):
            fields[name] = rng.choice(ODD_MAX_TOKENS)
        elif name == "messages" and rng.random() < 0.5:  # odd inside a message
            role, content = rng.choice(['"user"', '"wizard"', "5", "null", '"\\ud800"']), rng.choice(ODD_VALUES[:40])
            fields[name] = f'[{{"role": {role}, "content": {content}}}]'
        else:
            fields[name] = rng.choice(ODD_VALUES)
    text = ("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode()
    if rng.random() < 0.1:  # a raw byte that is not UTF-8 somewhere
        cut = rng.randrange(len(text))
        return path, text[:cut] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"]) + text[cut:]
    return path, text


def _check_success(r: httpx.Response, path: str) -> None:
    """A 200's content: an OpenAI completion, whole or streamed, in JSON."""
    chat = path.endswith("chat/completions")
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in r.text.split("\n") if line]
        assert lines and lines[-1] == "data: [DONE]", r.text[-300:]
        events = [_strict_json(line.removeprefix("data: ")) for line in lines[:-1]]
        assert all("error" not in e for e in events), events
        assert events and all(e["object"] == ("chat.completion.chunk" if chat else "text_completion") for e in events)
        assert any(c["finish_reason"] for e in events for c in e["choices"])
        return
    body = _strict_json(r.content)
    assert body["object"] == ("chat.completion" if chat else "text_completion"), body
    choice = body["choices"][0]
    assert isinstance(choice["message"]["content"] if chat else choice["text"], str)
    assert choice["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] >= 0


def test_request_body_fuzzer_never_gets_a_5xx(server):
    """Seeded: ~160 bodies, valid ones with odd fields and broken ones, at both endpoints, with odd content
    types. Every answer is a 2xx with a completion or a 4xx with an OpenAI error; never a 5xx."""
    rng = random.Random(42)
    seen: dict[int, int] = {}
    with httpx.Client(timeout=120) as client:
        for i in range(160):
            path, raw = _fuzz_body(rng)
            ctype = rng.choice(CONTENT_TYPES)
            r = client.post(server.url + path, content=raw, headers={"content-type": ctype} if ctype else {})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            where = f"case {i}: POST {path} {raw[:200]!r}… → {r.status_code} {r.text[:300]}"
            assert r.status_code < 500, where
            if r.status_code < 300:
                _check_success(r, path)
            else:
                _check_error(r)
    print(f"fuzzer: status codes {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) >= 10 and sum(n for s, n in seen.items() if s >= 400) >= 80, seen
    assert _wait_health(server.url, _idle)["busy"] == 0
    _good_request(server.url)
