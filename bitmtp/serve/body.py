"""Request bodies in, response bodies out: the JSON the server accepts and the JSON it writes.

:func:`parse_body` turns the raw bytes of a request into JSON values, or a 400 naming what is wrong:
not UTF-8, not JSON, nested deeper than :data:`MAX_DEPTH`, a lone UTF-16 surrogate in a string (a
``"\\ud800"`` escape: Python keeps it, the tokenizer and the UTF-8 encoder do not), a number out of
range (``1e400`` overflows a double, ``10**5000`` as an integer literal, ``NaN`` / ``Infinity``, which
are not JSON). Every value the request parser sees is then a finite double, a 64-bit integer, a valid
Unicode string, a list or a dict, at most :data:`MAX_DEPTH` levels deep.

:func:`dumps` is the one way the server writes JSON: non-finite floats (a logprob of ``-inf``, the stats
of a generation without iterations) become ``null`` and ``allow_nan=False`` guarantees the text is JSON.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from bitmtp.serve.errors import APIError

#: deepest nesting a request may have. An OpenAI request is at most 5 levels deep (body → messages → a
#: message → content parts → a part); json.loads itself fails with RecursionError near 1,000 levels, which
#: this turns into a 400 long before (and the request parser, which walks the values, never recurses deep)
MAX_DEPTH = 64
#: integers a request may hold: 64 bits (signed or unsigned: a seed may be a uint64). Python's ints are
#: unbounded and json.loads raises ValueError, not JSONDecodeError, on one of over 4,300 digits
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
#: how much of an offending value an error message quotes
QUOTE = 40

_SURROGATE = re.compile("[\ud800-\udfff]")


class _OutOfRange:
    """A number json.loads read that no field takes (kept as this marker so the error can name its field)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _parse_int(text: str) -> int | _OutOfRange:
    # the digit count first: int() of a huge literal is quadratic, and refused past 4,300 digits anyway
    if len(text) > 21:
        return _OutOfRange(text)
    value = int(text)
    return value if INT_MIN <= value <= INT_MAX else _OutOfRange(text)


def _parse_float(text: str) -> float | _OutOfRange:
    value = float(text)  # 1e400 → inf: overflows a double; 1e-400 → 0.0, a number all the same
    return value if math.isfinite(value) else _OutOfRange(text)


def _parse_constant(text: str) -> _OutOfRange:
    return _OutOfRange(text)  # NaN, Infinity, -Infinity: Python's json reads them, JSON has none


def quote(text: str) -> str:
    """``text`` shortened to :data:`QUOTE` characters for an error message (a value may be megabytes)."""
    return text if len(text) <= QUOTE else f"{text[:QUOTE]}… ({len(text)} characters)"


def parse_body(raw: bytes) -> Any:
    """The JSON value of a request body, checked as the module docstring says; 400 :class:`APIError`
    otherwise (``code``: ``invalid_encoding``, ``invalid_json``, ``nesting_too_deep`` or
    ``number_out_of_range``; ``param``: the top-level field at fault, where there is one)."""
    try:
        text = raw.decode("utf-8")  # strict: also refuses UTF-8-encoded surrogates (b"\xed\xa0\x80")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8: byte {exc.start} ({raw[exc.start:exc.start + 1]!r})"
                            f" {exc.reason}; send JSON encoded as UTF-8", code="invalid_encoding") from None
    try:
        value = json.loads(text.removeprefix("\ufeff"), parse_int=_parse_int, parse_float=_parse_float,
                           parse_constant=_parse_constant)
    except RecursionError:  # json's C scanner counts its depth: a clean error, not a crash
        raise APIError(400, f"the request body is nested too deeply: at most {MAX_DEPTH} levels of arrays and "
                            "objects", code="nesting_too_deep") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    _check_values(value)
    return value


def _check_values(root: Any) -> None:
    """Walk the parsed values (iteratively: no recursion however deep) for what :func:`parse_body` refuses."""
    stack: list[tuple[Any, str, int]] = [(root, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, _OutOfRange):
            kind = "is not JSON" if value.text in ("NaN", "Infinity", "-Infinity") else "is out of range"
            raise _error(path, f"the number {quote(value.text)} {kind}: numbers must be finite doubles and integers "
                               "must fit in 64 bits", "number_out_of_range")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise _error(path, f"nested too deeply: at most {MAX_DEPTH} levels of arrays and objects",
                             "nesting_too_deep")
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, path, key=True)
                    name = quote(key)  # a key may be megabytes too
                    stack.append((item, f"{path}.{name}" if path else name, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str, *, key: bool = False) -> None:
    m = _SURROGATE.search(text)
    if m is not None:
        what = "a key" if key else "the string"
        raise _error(path, f"{what} holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x} at character {m.start()}),"
                           " which is not a Unicode character; escape astral characters as a surrogate pair",
                     "invalid_encoding")


def _error(path: str, message: str, code: str) -> APIError:
    """A 400 for the value at ``path`` (``messages[0].content``), ``param`` its top-level field."""
    if not path:
        return APIError(400, f"the request body: {message}", code=code)
    param = re.split(r"[.\[]", path, maxsplit=1)[0] or None
    if len(path) > 4 * QUOTE:  # 64 levels of keys
        path = f"{path[:4 * QUOTE]}…"
    return APIError(400, f"{path}: {message}", param=param, code=code)


def json_safe(value: Any) -> Any:
    """``value`` with NaN / infinity as None (JSON has neither: a logprob of -inf is ``null``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """``value`` as JSON text: non-finite floats as null, never ``NaN`` / ``Infinity`` (``allow_nan=False``
    checks it), non-ASCII as itself except lone surrogates, which are escaped (``\\ud800``) so the text
    always encodes to UTF-8."""
    value = json_safe(value)
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    if _SURROGATE.search(text) is not None:  # bitmtp's own text has none; an echo of odd input might
        text = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text


__all__ = ["MAX_DEPTH", "parse_body", "dumps", "json_safe", "quote"]
