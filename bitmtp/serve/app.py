"""The OpenAI-compatible FastAPI app: ``GET /v1/models``, ``POST /v1/completions`` and
``/v1/chat/completions`` (server-sent events with ``stream: true``), ``GET /health``.

Each request decodes with ``bitmtp.generate`` on a session of a :class:`~bitmtp.serve.pool.SessionPool`
(its own KV store) in a worker thread, so the event loop keeps answering while tokens are computed;
a streamed answer's pieces cross to the loop through an ``asyncio.Queue``. A client that goes away
mid-stream stops its generation after the next piece (the thread closes the stream, which releases
the KV store). Responses carry bitmtp's decoding stats in the extension field ``"bitmtp"`` and the
replica that answered in the ``x-bitmtp-replica`` header.
"""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations (the request type,
# imported inside create_app because FastAPI is an optional extra) as objects
import asyncio
import json
import math
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from bitmtp.errors import BitMTPError
from bitmtp.serve.errors import APIError, from_bitmtp_error
from bitmtp.serve.params import Request, parse_request
from bitmtp.serve.pool import QueueFull, SessionPool

#: bitmtp's stop reasons → OpenAI's finish_reason
FINISH_REASON = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "capacity": "length"}
REPLICA_HEADER = "x-bitmtp-replica"


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


def _json_safe(value: Any) -> Any:
    """NaN / infinity (stats of a generation without iterations) as null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


class _State:
    """What the routes share: the model, its session pool and the generation threads."""

    def __init__(self, model_or_loader: Any, model_name: str | None, sessions: int, queue_size: int,
                 replica_id: str | Callable[[], str] | None):
        self.source = model_or_loader
        self.model: Any = None
        self.model_name = model_name
        self.sessions, self.queue_size = sessions, queue_size
        self._replica_id = replica_id
        self.replica = ""
        self.pool: SessionPool | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        #: set at shutdown: streams in flight stop after their next piece (the process can exit)
        self.stopping = threading.Event()

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
        self.pool = SessionPool(model, self.sessions, self.queue_size)
        # one thread per session: a generation never waits for a thread, only for a session
        self.executor = ThreadPoolExecutor(max_workers=self.sessions, thread_name_prefix="bitmtp-serve")
        self.model = model

    def stop(self) -> None:
        self.stopping.set()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def ready(self) -> SessionPool:
        if self.pool is None:
            raise APIError(503, "the model is not loaded yet: the app loads it at startup (its ASGI lifespan, which "
                                "the server must run); retry in a few seconds (GET /health says when it is ready)",
                           code="model_loading")
        return self.pool


def _run(state: _State, session: Any, req: Request, emit: Callable[[tuple], None],
         cancelled: threading.Event) -> None:
    """A generation thread: ``bitmtp.generate`` on ``session``, reporting through ``emit``:
    ``("start", None)`` once the arguments are accepted, then (streamed) ``("piece", text)``…, and
    ``("done", GenerateOutput)`` or ``("error", exception)``. Always hands the session back."""
    import bitmtp

    stream = None
    try:
        try:
            if not req.stream:
                out = bitmtp.generate(session, input_ids=req.input_ids, **req.kwargs)
                emit(("done", out))
                return
            stream = bitmtp.generate(session, input_ids=req.input_ids, stream=True, **req.kwargs)
            emit(("start", None))
            for piece in stream:
                if cancelled.is_set() or state.stopping.is_set():  # the client went away, or the server stops
                    return
                emit(("piece", piece))
            emit(("done", stream.result))
        except Exception as exc:  # noqa: BLE001 - reported to the request (a BitMTPError is its 400)
            emit(("error", exc))
    finally:
        if stream is not None:
            stream.close()
        loop = state.loop
        try:
            loop.call_soon_threadsafe(state.pool.release, session)
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


def _usage(out: Any) -> dict[str, int]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids),
            "total_tokens": out.prompt_tokens + len(out.token_ids)}


def _extension(state: _State, out: Any) -> dict[str, Any]:
    """The ``"bitmtp"`` field: which replica answered, why it stopped, the sampling seed (given or drawn:
    send it back to reproduce the text), timings and the decoding stats."""
    return _json_safe({"replica": state.replica, "stop_reason": out.stop_reason, "seed": getattr(out, "seed", None),
                       "prefill_seconds": out.prefill_seconds, "decode_seconds": out.decode_seconds,
                       "tokens_per_second": out.tokens_per_second, "stats": out.stats.as_dict()})


def create_app(model_or_loader: Any, *, model_name: str | None = None, sessions: int = 1, queue_size: int = 16,
               replica_id: str | Callable[[], str] | None = None) -> Any:
    """An OpenAI-compatible FastAPI app serving one model.

    Args:
        model_or_loader: a model from :func:`bitmtp.load`, or a function without arguments that loads one
            (called once at startup, in a thread: what a Ray Serve replica runs).
        model_name: the name clients give as ``model`` (default: the model file's stem). Another name is a 404.
        sessions: KV stores decoding at once (``model.session()`` views sharing the weights); requests
            never share one.
        queue_size: requests that may wait for a KV store; one more gets 429.
        replica_id: the name this app reports in the ``x-bitmtp-replica`` header and the ``"bitmtp"``
            extension field, or a function giving it at startup (default ``host:pid``).

    Returns:
        a ``fastapi.FastAPI`` app; run it with uvicorn (``python -m bitmtp serve``) or
        :func:`bitmtp.serve.run_in_thread`.

    Raises:
        BitMTPError: FastAPI or uvicorn is not installed (``pip install 'bitmtp[serve]'``), or a bad
        ``sessions`` / ``queue_size``.
    """
    require_serve()
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    for name, value, lo in (("sessions", sessions, 1), ("queue_size", queue_size, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise BitMTPError(f"{name}: must be an integer >= {lo}, got {value!r}")
    state = _State(model_or_loader, model_name, sessions, queue_size, replica_id)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        await state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="bitmtp", description="OpenAI-compatible API over bitmtp.generate", lifespan=lifespan)
    app.state.bitmtp = state

    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers={REPLICA_HEADER: state.replica})

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: HTTPRequest, exc: HTTPException) -> JSONResponse:
        # unknown paths and methods: OpenAI-style too, so clients parse every error the same way
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       type="invalid_request_error", code="not_found" if exc.status_code == 404
                                       else None))

    @app.exception_handler(Exception)
    async def _bug(request: HTTPRequest, exc: Exception) -> JSONResponse:
        # anything else is a bug in bitmtp: still an OpenAI-style body, and the server keeps serving
        return error_response(_error_of(exc, chat=False))

    @app.middleware("http")
    async def _replica_header(request: HTTPRequest, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers[REPLICA_HEADER] = state.replica
        return response

    @app.get("/health")
    async def health() -> JSONResponse:
        pool = state.pool
        if pool is None:
            return JSONResponse({"status": "loading", "replica": state.replica}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_name, "replica": state.replica,
                             "sessions": len(pool.sessions), "busy": pool.busy, "waiting": pool.waiting,
                             "queue_size": pool.queue_size})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        state.ready()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "bitmtp"}]}

    async def body_of(request: HTTPRequest) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None

    async def complete(request: HTTPRequest, chat: bool) -> Any:
        pool = state.ready()
        body = await body_of(request)
        req = parse_request(body, chat=chat, model=state.model, model_name=state.model_name)
        try:
            session = await pool.acquire()
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

        state.executor.submit(_run, state, session, req, emit, cancelled)
        try:
            kind, payload = await events.get()
        except BaseException:  # cancelled before the answer started: stop the generation too
            cancelled.set()
            raise
        if kind == "error":
            raise _error_of(payload, chat=chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if not req.stream:
            return JSONResponse(_full_response(state, req, payload, rid, created))
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


def _full_response(state: _State, req: Request, out: Any, rid: str, created: int) -> dict[str, Any]:
    finish = FINISH_REASON.get(out.stop_reason, "stop")
    logprobs = _logprobs_field(state.model, out, chat=req.chat) if req.logprobs else None
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": created,
            "model": state.model_name, "choices": [choice], "usage": _usage(out), "bitmtp": _extension(state, out)}


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
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def piece(text: str) -> dict[str, Any]:
        return {"delta": {"content": text}} if req.chat else {"text": text}

    try:
        if req.chat:
            yield chunk({"delta": {"role": "assistant", "content": ""}})
        while True:
            kind, payload = await events.get()
            if kind == "piece":
                yield chunk(piece(payload))
            elif kind == "done":
                out = payload
                last = {"delta": {}} if req.chat else {"text": ""}
                last["finish_reason"] = FINISH_REASON.get(out.stop_reason, "stop")
                if req.logprobs:  # the whole answer's, on its last chunk (clients concatenate them)
                    last["logprobs"] = _logprobs_field(state.model, out, chat=req.chat)
                yield chunk(last, bitmtp=_extension(state, out))
                if req.include_usage:
                    yield chunk(None, usage=_usage(out))
                break
            else:  # an error after the response started: an error event, then the end
                yield f"data: {json.dumps(_error_of(payload, chat=req.chat).body(), ensure_ascii=False)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        cancelled.set()  # a client that went away: the thread stops after its next piece
