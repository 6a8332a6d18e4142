"""The OpenAI-compatible FastAPI app: ``GET /v1/models``, ``POST /v1/completions`` and
``/v1/chat/completions`` (server-sent events with ``stream: true``), ``GET /health``.

The event loop only moves bytes and events; every piece of CPU work runs on a thread, so ``/health`` and
other clients' streams never wait for one request:

- the body is read with a time limit (``body_timeout``: a body cut short is a 408, not a connection held
  open forever), then decoded, checked and tokenized on a parse thread (``bitmtp.serve.body`` refuses what
  is not a valid request with a 400: bad UTF-8, lone surrogates, deep nesting, numbers out of range);
- it decodes with ``bitmtp.generate(..., stream=True)`` in a generation thread: with ``max_batch`` (the
  default) in the model's batch engine, together with the other requests decoding then (one forward pass a step;
  a lone request is a batch of one; with ``solo_when_idle`` it runs on the solo engine instead), or on a
  session of a :class:`~bitmtp.serve.pool.SessionPool` (its own KV store), streamed or not: the
  stream's pieces are the steps between which a generation stops when its client has gone (a streamed
  answer's pieces cross to the loop through an ``asyncio.Queue``; a whole answer is built from the
  stream's result). While a request is parsed, waits for a KV store or decodes a whole answer, the loop
  watches its connection (the ASGI ``http.disconnect`` message) and abandons it when the client leaves.

Every JSON body the server writes is JSON (``bitmtp.serve.body.dumps``: a logprob of -inf is ``null``).
Responses carry bitmtp's decoding stats in the extension field ``"bitmtp"`` and the replica that answered
in the ``x-bitmtp-replica`` header.
"""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations (the request type,
# imported inside create_app because FastAPI is an optional extra) as objects
import asyncio
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from bitmtp.errors import BitMTPError
from bitmtp.runtime.batch import MAX_BATCH
from bitmtp.serve.body import dumps, json_safe, parse_body
from bitmtp.serve.errors import APIError, from_bitmtp_error
from bitmtp.serve.params import Request, parse_request
from bitmtp.serve.pool import QueueFull, SessionPool

#: bitmtp's stop reasons → OpenAI's finish_reason
FINISH_REASON = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "capacity": "length"}
REPLICA_HEADER = "x-bitmtp-replica"
#: seconds a client has to send its whole request body (create_app's default ``body_timeout``)
BODY_TIMEOUT = 30.0
#: least seconds between two chunks of a streamed answer (create_app's default ``stream_interval``): text a
#: step commits sooner is sent with the next chunk. Every chunk wakes the event loop and the client while
#: the next step's kernels hold both cores; measured on 2 vCPUs (SmolLM2, ~8 ms steps, one streaming client
#: in a process of its own), decode speed over generate()'s in the main thread: one chunk per step 0.949,
#: a chunk per 30 ms 0.993. 30 ms is below what a reader sees; the first chunk is never held back.
STREAM_INTERVAL = 0.03
#: threads that decode, check and tokenize request bodies: two, so that one prompt of megabytes (seconds
#: of tokenizing) does not hold up every other request's few microseconds
PARSE_THREADS = 2
#: the status of a request whose client left before its answer: nginx's "client closed request". Nobody
#: receives it; it is what the access log shows
CLIENT_CLOSED = 499

#: requests a server decodes together by default (create_app's ``max_batch``): on 2 CPU cores a width-8 step
#: costs ~2.4-2.7 width-1 steps (SmolLM2), so 8 clients get ~3x the tokens/s of one
DEFAULT_MAX_BATCH = 8

#: the chat page served at ``/``
CHAT_PAGE = Path(__file__).with_name("static") / "chat.html"

T = TypeVar("T")
log = logging.getLogger("bitmtp")


def require_serve() -> None:
    """Raise a BitMTPError naming the extra to install when FastAPI or uvicorn is missing."""
    missing = []
    for module in ("fastapi", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise BitMTPError(f"serve: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; "
                          "pip install 'bitmtp[serve]'")


class _ClientGone(Exception):
    """The client closed its connection before its answer: the request is abandoned."""


class _State:
    """What the routes share: the model, its session pool, the parse and generation threads, counters."""

    def __init__(self, model_or_loader: Any, model_name: str | None, sessions: int, queue_size: int,
                 replica_id: str | Callable[[], str] | None, body_timeout: float | None,
                 stream_interval: float = STREAM_INTERVAL, max_batch: int = 0, solo_when_idle: bool = False,
                 calibrate: bool = True):
        self.source = model_or_loader
        self.calibrate = calibrate
        self.model: Any = None
        self.model_name = model_name
        #: requests decoded together in one batch (0: each alone on one of ``sessions`` KV stores); the places
        #: that decode at once are the batch's or the sessions
        self.max_batch = max_batch
        self.solo_when_idle = solo_when_idle
        self.sessions, self.queue_size = (max_batch or sessions), queue_size
        self.body_timeout = body_timeout
        self.stream_interval = stream_interval
        self._replica_id = replica_id
        self.replica = ""
        self.pool: SessionPool | None = None
        #: the batch engine requests decode on (``max_batch``; None: sessions)
        self.batch: Any = None
        #: with a batch: the KV store of a request that arrives while nothing decodes (it runs alone, policy
        #: auto: drafting where it pays), and whether such a request decodes now (changed on the loop's thread)
        self.solo: Any = None
        self.solo_busy = False
        #: requests decoded alone / in the batch so far
        self.solo_requests = 0
        self.batched_requests = 0
        self.executor: ThreadPoolExecutor | None = None
        self.parse_executor: ThreadPoolExecutor | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        #: set at shutdown: generations in flight stop after their next piece (the process can exit)
        self.stopping = threading.Event()
        # the counters below change on the parse and generation threads too
        self._lock = threading.Lock()
        #: requests being decoded, checked and tokenized now (bounded: one more is a 429)
        self.parsing = 0
        #: decoding steps run, over all requests (each piece of text a generation commits: the steps
        #: between which a generation can stop), and requests abandoned because their client left
        self.steps = 0
        self.cancelled = 0

    def count(self, name: str, delta: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + delta)

    async def start(self) -> None:
        from bitmtp.api import BitMTPModel

        loop = asyncio.get_running_loop()
        rid = self._replica_id
        self.replica = (rid() if callable(rid) else rid) or f"{socket.gethostname()}:{os.getpid()}"
        model = self.source
        if not isinstance(model, BitMTPModel):
            model = await loop.run_in_executor(None, model)  # a loader: load off the event loop
            if not isinstance(model, BitMTPModel):
                raise BitMTPError(f"model_or_loader: the loader returned {type(model).__name__}, not a model from "
                                  "bitmtp.load()")
        if model.tokenizer is None:
            raise BitMTPError(f"model_or_loader: {model.source} has no tokenizer; the server takes text prompts")
        if self.model_name is None:
            self.model_name = Path(str(model.source)).stem or "bitmtp"
        pool = SessionPool(model, self.sessions, self.queue_size, batch=bool(self.max_batch))
        if self.max_batch:
            self.batch = model.batcher(self.max_batch)
            self.solo = model.session() if self.solo_when_idle else None
        solo_store = self.solo if self.max_batch else pool.sessions[0]
        if self.calibrate and solo_store is not None:  # before the pool is set: /health says 503 until then
            await loop.run_in_executor(None, _calibrate, solo_store)
        self.pool = pool
        # one thread per session: a generation never waits for a thread, only for a session
        self.executor = ThreadPoolExecutor(max_workers=self.sessions, thread_name_prefix="bitmtp-serve")
        self.parse_executor = ThreadPoolExecutor(max_workers=PARSE_THREADS, thread_name_prefix="bitmtp-parse")
        self.model = model

    def stop(self) -> None:
        self.stopping.set()
        for executor in (self.executor, self.parse_executor):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)

    def ready(self) -> SessionPool:
        if self.pool is None:
            raise APIError(503, "the model is not loaded yet: the app loads it at startup (its ASGI lifespan, which "
                                "the server must run); retry in a few seconds (GET /health says when it is ready)",
                           code="model_loading")
        return self.pool


def _calibrate(session: Any) -> None:
    """The step costs a request decoded alone with policy auto plans with, measured (or read from the cache)
    before the server reports ready: else the first such request of 64 tokens or more measures them itself
    (~5 s on 2 CPU cores: one client's first answer at 0.37x llama-server's speed, its next ones at 1.18x).
    A failed measurement is logged; requests then plan with the prior costs, corrected by the steps they see."""
    t0 = time.monotonic()
    try:
        session.calibrate()
    except BitMTPError as exc:
        log.warning("bitmtp serve: could not measure the step costs (%s); policy auto plans with prior costs", exc)
        return
    log.info("bitmtp serve: step costs ready in %.1f s", time.monotonic() - t0)


def _parse(raw: bytes, chat: bool, model: Any, model_name: str) -> Request:
    """A request body → a checked :class:`Request`, on a parse thread: JSON decoding, the checks and the
    tokenizer (seconds for a prompt of megabytes) stay off the event loop."""
    return parse_request(parse_body(raw), chat=chat, model=model, model_name=model_name)


def _run(state: _State, session: Any, req: Request, emit: Callable[[tuple], None],
         cancelled: threading.Event, solo: bool = False) -> None:
    """A generation thread: ``bitmtp.generate`` on ``session`` (in the batch engine when the server batches;
    ``solo``: alone on the server's solo KV store), reporting through ``emit``:
    ``("start", None)`` once the arguments are accepted, then (streamed) ``("piece", (text, spans))``…, and
    ``("done", (GenerateOutput, spans))`` or ``("error", exception)`` — ``spans``: the text's
    :class:`bitmtp.Span` list when the request asked for origins (a whole answer's on ``done``), else [];
    nothing more once ``cancelled`` is set (the
    client left) or the server stops. Always hands the session back."""
    import bitmtp

    stream = None
    try:
        try:
            if cancelled.is_set():  # the client left while this thread was being scheduled: no prefill
                return
            # a stream even for an answer sent whole: its pieces are the steps between which the generation
            # of a client that left stops (one bitmtp.generate call would run to max_tokens); its result is
            # the GenerateOutput the call without stream returns
            # a lone request on the solo session (or a session of a server that does not batch): the solo engine
            batched = state.max_batch and not solo
            batch = dict(batcher=True, max_batch=state.max_batch) if batched else dict(batcher=False)
            stream = bitmtp.generate(state.solo if solo else session, input_ids=req.input_ids, stream=True, **batch,
                                     config=req.config)
            emit(("start", None))
            # text not sent yet with its origin spans (asked for: bitmtp.origins), and when the last piece
            # went (the first goes at once)
            held, held_spans, sent_at = "", [], -math.inf
            for piece in stream:
                state.count("steps")
                if cancelled.is_set() or state.stopping.is_set():  # the client went away, or the server stops
                    return
                if req.origins:
                    held_spans += stream.spans
                if req.stream:
                    held += piece
                    now = time.monotonic()
                    if now - sent_at >= state.stream_interval:  # STREAM_INTERVAL says why pieces are held
                        emit(("piece", (held, held_spans)))
                        held, held_spans, sent_at = "", [], now
            if held:
                emit(("piece", (held, held_spans)))
            # a whole answer's spans: every piece's
            emit(("done", (stream.result, held_spans if not req.stream else [])))
        except Exception as exc:  # noqa: BLE001 - reported to the request (a BitMTPError is its 400)
            emit(("error", exc))
    finally:
        if stream is not None:
            stream.close()
        loop = state.loop
        try:
            loop.call_soon_threadsafe(state.pool.release, session)
            if solo:
                loop.call_soon_threadsafe(setattr, state, "solo_busy", False)
        except RuntimeError:  # the loop is closed: the server is gone, and its pool with it
            pass


def _error_of(exc: BaseException, *, chat: bool) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, BitMTPError):
        return from_bitmtp_error(exc, chat=chat)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc} (a bug in bitmtp)", code="internal_error")


def _token_texts(model: Any, ids: list[int]) -> list[str]:
    return [model.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def _logprobs_field(model: Any, out: Any, *, chat: bool) -> dict[str, Any] | None:
    """The chosen tokens' log-probabilities in OpenAI's shape (chat: ``content``; completions:
    ``tokens`` / ``token_logprobs`` / ``text_offset``)."""
    values = getattr(out, "logprobs", None)
    if values is None:
        return None
    ids = out.token_ids[: len(values)]
    texts = _token_texts(model, ids)
    if chat:
        return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
                            for s, lp in zip(texts, values, strict=False)]}
    offsets, pos = [], 0
    for s in texts:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": texts, "token_logprobs": list(values), "top_logprobs": None, "text_offset": offsets}


def _usage(out: Any) -> dict[str, Any]:
    # OpenAI's prompt_tokens_details.cached_tokens: the prompt's prefix whose KV rows were reused (Engine.resume)
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids),
            "total_tokens": out.prompt_tokens + len(out.token_ids),
            "prompt_tokens_details": {"cached_tokens": out.stats.prompt_cached}}


def _origins(spans: list) -> list[dict[str, Any]]:
    """``bitmtp.origins``: the text cut by the tokens that produced it (:class:`bitmtp.Span` as JSON)."""
    return [sp.as_dict() for sp in spans]


def _extension(state: _State, out: Any, spans: list | None = None) -> dict[str, Any]:
    """The ``"bitmtp"`` field: which replica answered, why it stopped, the sampling seed (given or drawn:
    send it back to reproduce the text), timings and the decoding stats; with ``spans`` (a whole answer
    that asked for them) the text's origins too."""
    extra = {"origins": _origins(spans)} if spans is not None else {}
    return json_safe({**extra, "replica": state.replica, "stop_reason": out.stop_reason,
                      "seed": getattr(out, "seed", None),
                       "prefill_seconds": out.prefill_seconds, "decode_seconds": out.decode_seconds,
                       "tokens_per_second": out.tokens_per_second, "stats": out.stats.as_dict()})


async def _wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return once the client has closed its connection: after the body, all an ASGI server sends on
    ``receive`` is ``http.disconnect``."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a receive channel that fails is a connection that is gone
        return


async def _unless_gone(aw: Awaitable[T], gone: asyncio.Future) -> T:
    """``await aw``, or :class:`_ClientGone` (``aw`` cancelled) as soon as ``gone`` is done first."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    raise _ClientGone


class _ReplicaHeader:
    """ASGI middleware: ``x-bitmtp-replica`` on every response. Plain ASGI rather than Starlette's
    BaseHTTPMiddleware, which wraps ``receive`` and would hide a client's disconnect from the routes."""

    def __init__(self, app: Any, state: _State):
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = REPLICA_HEADER.encode("ascii")

        async def send_with_header(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == name for k, _ in headers):
                    headers.append((name, self.state.replica.encode("latin-1", "replace")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)


def create_app(model_or_loader: Any, *, model_name: str | None = None, sessions: int = 1, queue_size: int = 16,
               replica_id: str | Callable[[], str] | None = None, body_timeout: float | None = BODY_TIMEOUT,
               stream_interval: float = STREAM_INTERVAL, max_batch: int = DEFAULT_MAX_BATCH,
               solo_when_idle: bool = False, calibrate: bool = True) -> Any:
    """An OpenAI-compatible FastAPI app serving one model.

    Args:
        model_or_loader: a model from :func:`bitmtp.load`, or a function without arguments that loads one
            (called once at startup, in a thread: what a Ray Serve replica runs).
        model_name: the name clients give as ``model`` (default: the model file's stem). Another name is a 404.
        max_batch: requests decoded together (continuous batching, default 8; ``bitmtp.runtime.batch``): one
            forward pass a step for all of them, each request with its own sampling parameters, seed, stop
            strings and max_tokens, joining and leaving between steps; its output is the one it gets alone
            (policy auto: AR's output, lookup / mask-draft guesses where a row pays). 0: each request decodes
            alone (policy auto, drafting where it pays) on one of ``sessions`` KV stores.
        solo_when_idle: with a batch, True runs a request that arrives while nothing decodes alone on the solo
            engine (policy auto with its calibrated plan: one-pass mask blocks, runner-ups) on a KV store of its
            own; the requests that arrive meanwhile batch beside it, sharing the cores (8 clients arriving at
            once: ~13 % fewer tokens/s than one batch of 8). False (the default): every request joins the batch —
            a lone one is a batch of one, drafting by lookup and mask rows where they pay, as fast as the solo
            engine (one streaming client: 1.04x end to end, 2026-12-07), and the server starts without
            measuring step costs.
        calibrate: where requests decode on the solo engine (``solo_when_idle``, or ``max_batch=0``), measure the
            step costs a request decoded alone with policy auto plans with at startup
            (:meth:`bitmtp.BitMTPModel.calibrate`; ~5 s on 2 CPU cores, read from the cache after the first time
            on a machine), before the app reports ready, so that no request pays for it. False: the first such
            request of 64 tokens or more measures them.
        sessions: with ``max_batch=0``, KV stores decoding at once (``model.session()`` views sharing the
            weights); requests never share one.
        queue_size: requests that may wait for a place in the batch (or a KV store); one more gets 429.
        replica_id: the name this app reports in the ``x-bitmtp-replica`` header and the ``"bitmtp"``
            extension field, or a function giving it at startup (default ``host:pid``).
        body_timeout: seconds a client has to send its whole request body; a body cut short (fewer bytes
            than its Content-Length, or a chunked body never ended) is then answered 408 and the connection
            closed. None: no limit.
        stream_interval: least seconds between two chunks of a streamed answer (default 0.03): the text of
            steps that end sooner goes with the next chunk, so that a fast model does not spend its cores
            waking the server's loop and the client for every step. The first chunk is sent at once; 0
            sends every step's text as it comes.

    Returns:
        a ``fastapi.FastAPI`` app; run it with uvicorn (``python -m bitmtp serve``) or
        :func:`bitmtp.serve.run_in_thread`.

    Raises:
        BitMTPError: FastAPI or uvicorn is not installed (``pip install 'bitmtp[serve]'``), or a bad
        ``sessions`` / ``queue_size`` / ``body_timeout`` / ``stream_interval``.
    """
    require_serve()
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    for name, value, lo in (("sessions", sessions, 1), ("queue_size", queue_size, 0), ("max_batch", max_batch, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise BitMTPError(f"{name}: must be an integer >= {lo}, got {value!r}")
    if max_batch > MAX_BATCH:
        raise BitMTPError(f"max_batch: at most {MAX_BATCH} requests decode in one step, got {max_batch}")
    if body_timeout is not None and (isinstance(body_timeout, bool) or not isinstance(body_timeout, (int, float))
                                     or not math.isfinite(body_timeout) or body_timeout <= 0):
        raise BitMTPError(f"body_timeout: must be a finite number of seconds > 0 (or None: no limit), got "
                          f"{body_timeout!r}")
    if (isinstance(stream_interval, bool) or not isinstance(stream_interval, (int, float))
            or not math.isfinite(stream_interval) or not 0 <= stream_interval <= 10):
        raise BitMTPError(f"stream_interval: must be a number of seconds in [0, 10] (0: every step's text at once), "
                          f"got {stream_interval!r}")
    for name, value in (("solo_when_idle", solo_when_idle), ("calibrate", calibrate)):
        if not isinstance(value, bool):
            raise BitMTPError(f"{name}: must be True or False, got {value!r}")
    state = _State(model_or_loader, model_name, sessions, queue_size, replica_id, body_timeout,
                   float(stream_interval), max_batch, solo_when_idle, calibrate)

    class SafeJSONResponse(JSONResponse):
        """JSON that is always JSON: NaN / infinity as null (see bitmtp.serve.body.dumps)."""

        def render(self, content: Any) -> bytes:
            return dumps(content).encode("utf-8")

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        await state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="bitmtp", description="OpenAI-compatible API over bitmtp.generate", lifespan=lifespan,
                  default_response_class=SafeJSONResponse)
    app.state.bitmtp = state
    app.add_middleware(_ReplicaHeader, state=state)

    def error_response(err: APIError) -> SafeJSONResponse:
        return SafeJSONResponse(err.body(), status_code=err.status,
                                headers={**err.headers, REPLICA_HEADER: state.replica})

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, exc: APIError) -> SafeJSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: HTTPRequest, exc: HTTPException) -> SafeJSONResponse:
        # unknown paths and methods: OpenAI-style too, so clients parse every error the same way
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       type="invalid_request_error", code="not_found" if exc.status_code == 404
                                       else None, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _bug(request: HTTPRequest, exc: Exception) -> SafeJSONResponse:
        # anything else is a bug in bitmtp: still an OpenAI-style body, and the server keeps serving
        return error_response(_error_of(exc, chat=False))

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        """The chat page (``bitmtp/serve/static/chat.html``: one file, no CDN, works offline); it streams from
        this server's ``/v1/chat/completions`` and tints each token by where it came from."""
        return Response(CHAT_PAGE.read_bytes(), media_type="text/html; charset=utf-8",
                        headers={"cache-control": "no-cache"})

    @app.get("/health")
    async def health() -> SafeJSONResponse:
        pool = state.pool
        if pool is None:
            return SafeJSONResponse({"status": "loading", "replica": state.replica}, status_code=503)
        return SafeJSONResponse({"status": "ok", "model": state.model_name, "replica": state.replica,
                                 "sessions": len(pool.sessions), "busy": pool.busy, "waiting": pool.waiting,
                                 "queue_size": pool.queue_size, "parsing": state.parsing, "steps": state.steps,
                                 "cancelled": state.cancelled, "max_batch": state.max_batch,
                                 "solo_requests": state.solo_requests, "batched_requests": state.batched_requests})

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """Prometheus text exposition (``docs/serving.md`` names every metric)."""
        return Response(_metrics(state), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        state.ready()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "bitmtp"}]}

    async def read_body(request: HTTPRequest) -> bytes:
        """The whole body, within ``body_timeout`` seconds: 408 (and the connection closed: what is left of
        the body will not be read) for a client that promised more than it sends."""
        try:
            return await asyncio.wait_for(request.body(), state.body_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {state.body_timeout:g} s (fewer bytes than "
                                "its Content-Length, or a chunked body never ended); send the whole body at once",
                           code="request_timeout", headers={"connection": "close"}) from None
        except ClientDisconnect:
            raise _ClientGone from None

    def parse_off_loop(raw: bytes, chat: bool) -> Awaitable[Request]:
        """:func:`_parse` on a parse thread; at most ``sessions + queue_size`` requests (or
        :data:`PARSE_THREADS`) are parsed or wait for a parse thread at once, one more is a 429."""
        limit = max(state.sessions + state.queue_size, PARSE_THREADS)
        with state._lock:
            if state.parsing >= limit:
                raise APIError(429, f"queue: {state.parsing} requests are being read and tokenized already; retry "
                                    "later (or serve with a larger --max-batch / a longer --queue-size)",
                               code="queue_full")
            state.parsing += 1
        future: Future = state.parse_executor.submit(_parse, raw, chat, state.model, state.model_name)
        # counted until the thread is done with it, even when its client left and nobody awaits it any more
        future.add_done_callback(lambda _: state.count("parsing", -1))
        return asyncio.wrap_future(future)

    async def complete(request: HTTPRequest, chat: bool) -> Any:
        pool = state.ready()
        try:
            raw = await read_body(request)
            gone = asyncio.ensure_future(_wait_disconnect(request.receive))
            try:
                return await answer(request, raw, chat, pool, gone)
            finally:
                gone.cancel()  # a streamed answer: StreamingResponse listens for the disconnect from here on
        except _ClientGone:
            state.count("cancelled")
            return Response(status_code=CLIENT_CLOSED)

    async def answer(request: HTTPRequest, raw: bytes, chat: bool, pool: SessionPool, gone: asyncio.Future) -> Any:
        """The response to a request whose body is ``raw``; :class:`_ClientGone` once ``gone`` is done (the
        client left) while it is parsed, waits for a KV store or is decoded whole."""
        req = await _unless_gone(parse_off_loop(raw, chat), gone)
        try:
            session = await _unless_gone(pool.acquire(), gone)
        except QueueFull as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def emit(event: tuple) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed (server shutdown)
                pass

        # a request that arrives while nothing decodes runs alone (policy auto drafts where it pays: prompt
        # lookup, the adapter's mask drafts); one that arrives while others decode joins the batch
        solo = (state.solo is not None and not state.solo_busy
                and state.batch.running + state.batch.waiting == 0)
        if solo:
            state.solo_busy = True
            state.solo_requests += 1
        elif state.max_batch:
            state.batched_requests += 1
        try:
            state.executor.submit(_run, state, session, req, emit, cancelled, solo)
        except BaseException:  # the executor is shut down (server stopping): the solo store is free again
            if solo:
                state.solo_busy = False
            raise
        try:
            kind, payload = await _unless_gone(events.get(), gone)
            if kind == "start" and not req.stream:  # a whole answer: wait for its end, watching the client
                kind, payload = await _unless_gone(events.get(), gone)
        except BaseException:  # the client left (or the request was cancelled): stop the generation at its next step
            cancelled.set()
            raise
        if kind == "error":
            raise _error_of(payload, chat=chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if not req.stream:
            return SafeJSONResponse(_full_response(state, req, *payload, rid, created))
        body = _sse(state, req, events, cancelled, rid, created)
        # a body never started (the client left before the first byte) runs no `finally`: stop the thread when
        # the generator object is dropped instead
        weakref.finalize(body, cancelled.set)
        return StreamingResponse(body, media_type="text/event-stream", headers={"cache-control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Any:
        return await complete(request, chat=True)

    return app


#: the metrics ``GET /metrics`` exposes: (name, type, help)
METRICS = (
    ("bitmtp_requests_running", "gauge", "requests decoding now (in the batch, or on a session)"),
    ("bitmtp_requests_waiting", "gauge", "requests admitted and waiting for a place"),
    ("bitmtp_requests_parsing", "gauge", "request bodies being decoded, checked and tokenized"),
    ("bitmtp_requests_cancelled_total", "counter", "requests abandoned because their client left"),
    ("bitmtp_batch_max", "gauge", "most requests decoded together (0: one per session)"),
    ("bitmtp_batch_rows", "gauge", "rows of the latest batched decode step (one per decoding request)"),
    ("bitmtp_kv_rows_in_use", "gauge", "KV rows reserved by the batch's requests"),
    ("bitmtp_steps_total", "counter", "batched decode steps run (one forward pass each)"),
    ("bitmtp_forwards_total", "counter", "forward passes run by the batch (decode steps and prefill chunks)"),
    ("bitmtp_tokens_generated_total", "counter", "tokens committed by the batch (rate() gives tokens/s)"),
    ("bitmtp_accepted_tokens_per_step", "gauge", "tokens committed per request per batched step (> 1: accepted "
                                                 "guesses)"),
    ("bitmtp_requests_solo_total", "counter", "requests decoded alone (they arrived while nothing decoded)"),
    ("bitmtp_requests_batched_total", "counter", "requests decoded in the batch"),
)


def _metrics(state: _State) -> str:
    pool, batch = state.pool, state.batch
    values = {
        "bitmtp_requests_running": pool.busy if pool is not None else 0,
        "bitmtp_requests_waiting": pool.waiting if pool is not None else 0,
        "bitmtp_requests_parsing": state.parsing,
        "bitmtp_requests_cancelled_total": state.cancelled,
        "bitmtp_batch_max": state.max_batch,
        "bitmtp_batch_rows": batch.last_width if batch is not None else 0,
        "bitmtp_kv_rows_in_use": batch.rows_in_use if batch is not None else 0,
        "bitmtp_steps_total": batch.steps if batch is not None else 0,
        "bitmtp_forwards_total": batch.forwards if batch is not None else 0,
        "bitmtp_tokens_generated_total": batch.tokens_out if batch is not None else 0,
        "bitmtp_accepted_tokens_per_step": batch.tokens_per_commit if batch is not None else 1,
        "bitmtp_requests_solo_total": state.solo_requests,
        "bitmtp_requests_batched_total": state.batched_requests,
    }
    lines = []
    for name, kind, text in METRICS:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {values[name]}"]
    return "\n".join(lines) + "\n"


def _full_response(state: _State, req: Request, out: Any, spans: list, rid: str, created: int) -> dict[str, Any]:
    finish = FINISH_REASON.get(out.stop_reason, "stop")
    logprobs = _logprobs_field(state.model, out, chat=req.chat) if req.logprobs else None
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": created,
            "model": state.model_name, "choices": [choice], "usage": _usage(out),
            "bitmtp": _extension(state, out, spans if req.origins else None)}


async def _sse(state: _State, req: Request, events: asyncio.Queue, cancelled: threading.Event, rid: str,
               created: int) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer: ``data: {chunk}`` per text piece, a last chunk with
    the finish reason (and the ``"bitmtp"`` stats), a usage chunk when asked, then ``data: [DONE]``."""
    obj = "chat.completion.chunk" if req.chat else "text_completion"

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                "choices": [] if choice is None else [{"index": 0, "logprobs": None, "finish_reason": None,
                                                       **choice}], **extra}
        if req.include_usage and "usage" not in body:
            body["usage"] = None
        return f"data: {dumps(body)}\n\n"

    def piece(text: str) -> dict[str, Any]:
        return {"delta": {"content": text}} if req.chat else {"text": text}

    finished = False
    try:
        if req.chat:
            yield chunk({"delta": {"role": "assistant", "content": ""}})
        while True:
            kind, payload = await events.get()
            if kind == "piece":
                text, spans = payload
                if req.origins:  # aligned with the chunk's text: the spans' texts concatenate to it
                    yield chunk(piece(text), bitmtp={"origins": _origins(spans)})
                else:
                    yield chunk(piece(text))
            elif kind == "done":
                out, _ = payload
                last = {"delta": {}} if req.chat else {"text": ""}
                last["finish_reason"] = FINISH_REASON.get(out.stop_reason, "stop")
                if req.logprobs:  # the whole answer's, on its last chunk (clients concatenate them)
                    last["logprobs"] = _logprobs_field(state.model, out, chat=req.chat)
                yield chunk(last, bitmtp=_extension(state, out))
                if req.include_usage:
                    yield chunk(None, usage=_usage(out))
                break
            else:  # an error after the response started: an error event, then the end
                yield f"data: {dumps(_error_of(payload, chat=req.chat).body())}\n\n"
                break
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        cancelled.set()  # a client that went away: the thread stops after its next piece
        if not finished:
            state.count("cancelled")
