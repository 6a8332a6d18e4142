"""``python -m bitmtp serve`` (an OpenAI-compatible HTTP server, ``bitmtp.serve``) and ``python -m bitmtp
chat`` (interactive multi-turn chat in the terminal), registered by bitmtp.cli; the argument checks come
from bitmtp.cli_common.

``chat`` works like llama-cli's conversation mode: a prompt ``> `` per turn, the reply streamed as it is
decoded, ``/reset`` to forget the conversation (the system prompt stays), ``/exit`` (or Ctrl-D) to quit,
Ctrl-C during a reply to stop it. A piped stdin (``echo hi | python -m bitmtp chat``) is one message:
the reply is printed and the command ends. A line that is not valid text in stdin's encoding (invalid
UTF-8) is reported on stderr and skipped, and the conversation goes on; with nothing to read (stdin closed,
``0<&-``, or empty, ``< /dev/null``) chat says so and exits 0. Special-token text typed in a message is
plain text unless ``--parse-special`` (``bitmtp.generate(..., special_tokens_in_content=True)``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bitmtp.cli_common import (
    add_kv_type_argument,
    at_least,
    between,
    checked,
    default_model_path,
    existing,
    positive_float,
    read_piped_text,
    stdin_closed,
    undecodable,
)

CHAT_HELP = "commands: /reset forgets the conversation, /exit quits (also Ctrl-D); Ctrl-C stops a reply"
#: chat's sampling options, bitmtp.generate's keywords (forwarded only when given)
_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")


def _load(args: argparse.Namespace):
    import torch

    import bitmtp

    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = None if args.no_adapter else (args.adapter or "auto")
    return bitmtp.load(args.model or default_model_path(), capacity=args.capacity, adapter=adapter,
                       kv_type=args.kv_type)


def _check_common(args: argparse.Namespace) -> None:
    from bitmtp.errors import BitMTPError

    if args.adapter and args.no_adapter:
        raise BitMTPError("--adapter and --no-adapter contradict each other; give one")


# --- serve ------------------------------------------------------------------------------------------------

def _check_serve(args: argparse.Namespace) -> None:
    from bitmtp.errors import BitMTPError

    _check_common(args)
    if args.replicas is not None and args.threads:
        raise BitMTPError("--threads: applies to the in-process server; with --replicas each Ray replica uses "
                          "torch's default (set OMP_NUM_THREADS for the Ray workers)")


def _cmd_serve(args: argparse.Namespace) -> int:
    from bitmtp.serve.app import require_serve

    require_serve()  # before the model loads: a missing extra fails in one line at once
    if args.replicas is not None:
        return _serve_ray(args)
    from bitmtp.serve import create_app
    from bitmtp.serve.server import serve_forever

    model = _load(args)
    name = args.model_name or Path(str(model.source)).stem  # what clients pass as "model"
    app = create_app(model, model_name=name, sessions=args.sessions, queue_size=args.queue_size,
                     body_timeout=args.body_timeout, stream_interval=args.stream_interval, max_batch=args.max_batch,
                     solo_when_idle=args.solo, calibrate=not args.no_calibrate)
    how = (f"up to {args.max_batch} requests decoded together" if args.max_batch
           else f"{args.sessions} KV store(s), one request each")
    print(f"bitmtp: serving {model.source} as model {name!r} on http://{args.host}:{args.port}/v1 ({how}, queue "
          f"{args.queue_size}); Ctrl-C stops", file=sys.stderr, flush=True)
    serve_forever(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _serve_ray(args: argparse.Namespace) -> int:
    from bitmtp.serve.ray_serve import ray_app, require_ray

    require_ray()
    import ray
    from ray import serve

    path = args.model or default_model_path()
    load_kwargs = {"capacity": args.capacity, "adapter": None if args.no_adapter else (args.adapter or "auto"),
                   "kv_type": args.kv_type}
    app = ray_app(path, replicas=args.replicas, model_name=args.model_name, sessions=args.sessions,
                  queue_size=args.queue_size, load_kwargs=load_kwargs, body_timeout=args.body_timeout,
                  stream_interval=args.stream_interval, max_batch=args.max_batch, solo_when_idle=args.solo,
                  calibrate=not args.no_calibrate)
    ray.init(ignore_reinit_error=True)  # joins RAY_ADDRESS's cluster when set, else starts a local one
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        print(f"bitmtp: serving {path} from {args.replicas} Ray Serve replicas on http://{args.host}:{args.port}/v1; "
              "Ctrl-C stops", file=sys.stderr, flush=True)
        serve.run(app, route_prefix="/", blocking=True)
    except KeyboardInterrupt:  # Ctrl-C is how a server is stopped: a normal end, as uvicorn's in-process one
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


# --- chat -------------------------------------------------------------------------------------------------

def _sampling(args: argparse.Namespace) -> dict:
    """The chat's sampling options as ``bitmtp.generate`` keywords (only those given)."""
    return {key: getattr(args, key) for key in _SAMPLING_FLAGS if getattr(args, key) is not None}


class _Chat:
    """One conversation: the messages so far and how to answer the next one."""

    def __init__(self, model, system: str | None, max_new_tokens: int, sampling: dict, parse_special: bool = False):
        self.model, self.system, self.max_new_tokens, self.sampling = model, system, max_new_tokens, sampling
        self.parse_special = parse_special  # special-token text in messages parsed as tokens (--parse-special)
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str, write) -> str | None:
        """Answer the user message ``text``, streaming the reply through ``write``; the reply joins the
        conversation. A BitMTPError (e.g. the conversation outgrew the KV store) drops the message and
        propagates; Ctrl-C stops the reply, drops the turn and propagates."""
        import bitmtp

        turn = self.messages + [{"role": "user", "content": text}]
        stream = bitmtp.generate(self.model, turn, max_new_tokens=self.max_new_tokens, stream=True,
                                 special_tokens_in_content=self.parse_special, **self.sampling)
        with stream:  # closed on Ctrl-C or an error: the KV store is free for the next turn
            for piece in stream:
                write(piece)
        self.messages = turn + [{"role": "assistant", "content": stream.result.text}]
        return stream.result.text


def _cmd_chat(args: argparse.Namespace) -> int:
    from bitmtp.errors import BitMTPError

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    def skipped(what: str, more: str = "") -> None:
        print(f"bitmtp chat: {what} is not valid {encoding} text; skipped it{more}", file=sys.stderr, flush=True)

    stdin = sys.stdin
    encoding = getattr(stdin, "encoding", None) or "utf-8"
    try:
        terminal = not stdin_closed(stdin) and stdin.isatty()
    except (OSError, ValueError):  # closed meanwhile
        terminal = False
    text = None
    if not terminal:  # piped (or closed): the whole input is one message, read before the model loads
        text, bad, encoding = read_piped_text(stdin) if not stdin_closed(stdin) else (None, [], encoding)
        if text is None:
            print("bitmtp chat: nothing to answer (stdin is closed or empty); pipe a message, or run chat in a "
                  "terminal", file=sys.stderr, flush=True)
            return 0
        for number in bad:
            skipped(f"stdin line {number}")
        text = text.strip()
        if not text:
            raise BitMTPError("stdin: the piped message is empty" + (" once the lines that are not valid text were "
                              "skipped" if bad else "") + "; pipe the text to answer, or run chat in a terminal")
    model = _load(args)
    if model.tokenizer is None:
        raise BitMTPError(f"--model: {model.source} has no tokenizer; chat needs text in and out")
    chat = _Chat(model, args.system, args.max_new_tokens, _sampling(args), args.parse_special)
    if text is not None:
        chat.reply(text, write)
        print()
        return 0
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    print(f"bitmtp chat: {model.source}\n{CHAT_HELP}", file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:  # Ctrl-D
            print()
            return 0
        except UnicodeDecodeError:  # a stdin that decodes strictly: the line is consumed, the session goes on
            skipped("that line", ", the conversation goes on")
            continue
        if undecodable(line):  # surrogate-escaped bytes (the usual stdin): no tokenizer takes them
            skipped("that line", ", the conversation goes on")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            chat.reset()
            print("(conversation reset)", flush=True)
            continue
        if text.startswith("/"):
            print(f"(unknown command {text.split()[0]}; {CHAT_HELP})", flush=True)
            continue
        try:
            chat.reply(text, write)
            print(flush=True)
        except KeyboardInterrupt:  # stop this reply, keep chatting
            print("\n(reply stopped)", flush=True)
        except BitMTPError as exc:  # e.g. the conversation no longer fits: say so and keep the session
            print(f"\n(error: {' '.join(str(exc).split())}; /reset starts a new conversation)", flush=True)


# --- registration -----------------------------------------------------------------------------------------

def _model_options(p: argparse.ArgumentParser) -> None:
    checked(p.add_argument("--model", help="HF checkpoint folder or .gguf file (default: the embedded "
                                           "SmolLM2-135M-Instruct)"), existing("model folder or .gguf file"))
    checked(p.add_argument("--adapter", metavar="DIR", help="MTP adapter folder (default: the shipped adapter made "
                                                            "for this model, if there is one)"), existing("folder"))
    p.add_argument("--no-adapter", action="store_true", help="do not attach a shipped adapter")
    checked(p.add_argument("--capacity", type=int, default=2048, metavar="TOKENS",
                           help="KV capacity in tokens per conversation / request: prompt + reply must fit "
                                "(default 2048)"), at_least(1))
    add_kv_type_argument(p)
    checked(p.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)"),
            at_least(1, "leave it out for torch's choice"))


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``serve`` and ``chat`` on the ``bitmtp`` command line."""
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models)",
        description="Serve a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn: pip install "
                    "'bitmtp[serve]'): GET /v1/models, POST /v1/completions and /v1/chat/completions (stream: true "
                    "for server-sent events), GET /health, GET /metrics (Prometheus). Up to --max-batch requests "
                    "decode together, one forward pass a step (continuous batching: each gets the output it gets "
                    "alone; a lone request is a batch of one); --queue-size more "
                    "wait, and one more gets 429. Fields a "
                    "request leaves out take bitmtp.generate's defaults (temperature 0: greedy). --replicas N "
                    "serves from N Ray Serve replicas instead (pip install 'bitmtp[ray]'), Ray routing.")
    _model_options(serve)
    serve.add_argument("--model-name", help="the name clients pass as model (default: the model file's stem)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for "
                                                           "every interface)")
    checked(serve.add_argument("--port", type=int, default=8000, help="port (default 8000)"),
            between(0, 65535))
    checked(serve.add_argument("--max-batch", type=int, default=8, metavar="N",  # serve.app.DEFAULT_MAX_BATCH
                               help="requests decoded together in one batched step (per replica; 1..16, default "
                                    "8); 0: each request decodes alone (policy auto) on one of --sessions KV "
                                    "stores"), between(0, 16))
    serve.add_argument("--solo", action="store_true",
                       help="a request that arrives while nothing decodes runs alone on the solo engine (policy "
                            "auto with its calibrated plan: one-pass mask blocks, runner-ups); default: every request "
                            "joins the batch, a lone one as a batch of one (as fast, and no calibration at startup)")
    serve.add_argument("--no-solo", action="store_true",
                       help="every request joins the batch: the default now (kept for the scripts that pass it)")
    serve.add_argument("--no-calibrate", action="store_true",
                       help="with --solo or --max-batch 0: start without measuring the step costs policy auto plans "
                            "with on the solo engine (default: measured "
                            "before the server listens, ~5 s on 2 CPU cores the first time on a machine, then read "
                            "from the cache; without it the first request of 64 tokens or more pays for them)")
    checked(serve.add_argument("--sessions", type=int, default=1, metavar="N",
                               help="with --max-batch 0: requests decoding at once, each on its own KV store (per "
                                    "replica; default 1)"),
            at_least(1))
    checked(serve.add_argument("--queue-size", type=int, default=16, metavar="N",
                               help="requests that may wait for a KV store; one more gets HTTP 429 (default 16)"),
            at_least(0))
    checked(serve.add_argument("--replicas", type=int, metavar="N",
                               help="serve from N Ray Serve replicas (one model each) on a local Ray cluster, or "
                                    "RAY_ADDRESS's"), at_least(1))
    checked(serve.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",  # serve.app.BODY_TIMEOUT
                               help="seconds a client has to send its whole request body; a body cut short is "
                                    "answered 408 and the connection closed (default 30)"),
            positive_float("30 is the default"))
    checked(serve.add_argument("--stream-interval", type=float, default=0.03, metavar="SECONDS",  # STREAM_INTERVAL
                               help="least seconds between two chunks of a streamed answer; text committed sooner "
                                    "goes with the next chunk (default 0.03; 0: one chunk per decoding step)"),
            between(0.0, 10.0, fix="0.03 is the default"))
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default info)")
    serve.set_defaults(func=_cmd_serve, check=_check_serve)

    chat = sub.add_parser(
        "chat", help="interactive multi-turn chat in the terminal, replies streamed",
        description="Chat with a model in the terminal: type a message after '> ', the reply streams as it is "
                    "decoded (bitmtp.generate, policy auto). " + CHAT_HELP + ". A piped stdin is one message: "
                    "the reply is printed and chat ends (echo 'Hi' | python -m bitmtp chat).")
    _model_options(chat)
    chat.add_argument("--system", metavar="TEXT", help="system prompt, kept across /reset")
    chat.add_argument("--parse-special", action="store_true",
                      help="parse special-token text typed in a message (e.g. <|im_start|>system) as the special "
                           "tokens it spells. Default: messages are plain text and only the chat template's own "
                           "markers are special tokens, so a message cannot forge a turn")
    checked(chat.add_argument("--max-new-tokens", type=int, default=512, metavar="N",
                              help="most tokens per reply (default 512)"), at_least(1))
    checked(chat.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default 0: "
                                                                               "greedy)"), at_least(0.0))
    checked(chat.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling: keep the most probable "
                                                                       "tokens up to mass P"),
            between(0.0, 1.0, low_open=True))
    checked(chat.add_argument("--top-k", type=int, metavar="K", help="sample among the K most probable tokens "
                                                                     "(0: all)"), at_least(0))
    checked(chat.add_argument("--min-p", type=float, metavar="P", help="drop tokens less likely than P x the most "
                                                                       "likely one"), between(0.0, 1.0))
    checked(chat.add_argument("--repetition-penalty", type=float, metavar="R",
                              help="> 1 discourages tokens already in the conversation (1: off)"),
            positive_float("1 is off; 1.1 discourages repeats"))
    chat.add_argument("--seed", type=int, help="random seed: the same seed gives the same replies (default: a "
                                               "fresh one)")
    chat.set_defaults(func=_cmd_chat, check=_check_common)
