"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import re
from typing import Any

from bitmtp.errors import BitMTPError

#: generate()'s argument names → the OpenAI request field a client set (an error names the field it sent)
_PARAM_OF = {"max_new_tokens": "max_tokens", "input_ids": "prompt", "prompt": "prompt", "eos_token_id": None}


class APIError(BitMTPError):
    """An error answered as OpenAI error JSON with ``status`` (400 bad parameter, 404 unknown model,
    408 body not received in time, 429 queue full, 503 still loading, 500 a bug). ``param`` names the
    request field at fault; ``headers`` are added to the response (e.g. ``connection: close``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})
        self.type = type or {400: "invalid_request_error", 404: "invalid_request_error", 408: "invalid_request_error",
                             429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    """A 400 for request field ``param``; the message starts with the field's name, as BitMTPError's do."""
    return APIError(400, f"{param}: {message}" if param else message, param=param, code=code)


def from_bitmtp_error(exc: BitMTPError, *, chat: bool) -> APIError:
    """A BitMTPError raised by ``bitmtp.generate`` (its message starts with the argument's name) as a 400
    naming the request field that argument comes from."""
    message = str(exc)
    m = re.match(r"([A-Za-z_][A-Za-z_0-9/]*):", message)
    name = m.group(1) if m else None
    param = _PARAM_OF.get(name, name) if name else None
    if param == "prompt" and chat:
        param = "messages"
    return APIError(400, message, param=param)
