"""OpenAI request bodies → one ``bitmtp.generate`` call.

:func:`parse_request` checks a ``/v1/completions`` or ``/v1/chat/completions`` body and returns a
:class:`Request`: the prompt's token ids and its decoding options, validated (``bitmtp.decoding_config``).
:func:`sampling_kwargs` is the one place the OpenAI field names map to ``generate``'s.

Fields a client leaves out take ``bitmtp.generate``'s defaults — temperature 0, i.e. greedy decoding,
not OpenAI's 1.0 — except ``max_tokens``: 16 for completions (OpenAI's default) and the rest of the KV
store for chat. Every check fails with a 400 whose message starts with the field's name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bitmtp.errors import BitMTPError
from bitmtp.serve.body import quote
from bitmtp.serve.errors import APIError, bad_request

#: OpenAI name → (``generate`` keyword, JSON type). Extensions beyond OpenAI's API: top_k, min_p,
#: repetition_penalty. The ranges are ``bitmtp.decoding.sampling.SamplingParams``'s (checked there).
_SAMPLING: dict[str, tuple[str, str]] = {
    "temperature": ("temperature", "number"),
    "top_p": ("top_p", "number"),
    "top_k": ("top_k", "top_k"),
    "min_p": ("min_p", "number"),
    "repetition_penalty": ("repetition_penalty", "number"),
    "presence_penalty": ("presence_penalty", "number"),
    "frequency_penalty": ("frequency_penalty", "number"),
    "seed": ("seed", "int"),
    "stop": ("stop", "stop"),
}

#: OpenAI fields bitmtp cannot honour, with the value that asks for nothing (anything else is a 400)
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "suffix": None, "logit_bias": None, "tools": None,
                "tool_choice": None, "functions": None, "function_call": None, "parallel_tool_calls": None}

_CHAT_ROLES = {"system", "developer", "user", "assistant"}
#: completions' default max_tokens (OpenAI's)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@functools.cache
def _refused_by_tokenizer() -> tuple[type[BaseException], ...]:
    """What a tokenizer or chat template raises for input it will not take: the ``tokenizers`` library's
    TypeError / ValueError, a UnicodeError, and jinja2's TemplateError (a template's raise_exception)."""
    kinds: list[type[BaseException]] = [TypeError, ValueError, UnicodeError]
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:
        pass
    else:
        kinds.append(TemplateError)
    return tuple(kinds)


@dataclass
class Request:
    """A checked request: what to generate and how to answer."""

    chat: bool
    input_ids: list[int]
    stream: bool = False
    include_usage: bool = False
    #: return the chosen tokens' log-probabilities
    logprobs: bool = False
    #: the model name the client gave (None: left out)
    model: str | None = None
    #: send each piece of text with the origins of its tokens (``"bitmtp": {"origins": true}``)
    origins: bool = False
    #: the request's decoding options, validated (``bitmtp.decoding_config``)
    config: Any = None


def _kind(x: Any) -> str:
    return "null" if x is None else {bool: "a boolean", str: "a string", list: "an array", dict: "an object",
                                     int: "an integer", float: "a number"}.get(type(x), type(x).__name__)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(name: str, value: Any, kind: str) -> Any:
    """``value`` of sampling field ``name`` checked for its JSON type; returns the value generate takes."""
    if kind == "stop":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad_request(name, f"expected a string or an array of strings, got {_kind(value)}")
        return list(items) or None  # [] asks for no stop string
    if kind in ("int", "top_k"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(name, f"expected an integer, got {_kind(value)}")
        return max(value, 0) if kind == "top_k" and value == -1 else value  # -1: no top-k cut (vLLM's spelling)
    if not _is_number(value) or not math.isfinite(value):
        raise bad_request(name, f"expected a finite number, got {_kind(value) if not _is_number(value) else value}")
    return value


def sampling_kwargs(body: Mapping[str, Any], *, chat: bool) -> tuple[dict[str, Any], bool]:
    """The OpenAI sampling fields of ``body`` → ``bitmtp.generate`` keyword arguments, and whether the
    chosen tokens' logprobs are asked for: the one place the names map. Fields that are absent or null
    take generate's defaults; values out of range are a 400 naming the field (the ranges are
    ``SamplingParams``', checked here before the request waits for a KV store)."""
    from bitmtp.decoding.sampling import SamplingParams

    kwargs: dict[str, Any] = {}
    for name, (kwarg, kind) in _SAMPLING.items():
        value = body.get(name)
        if value is not None:
            value = _check(name, value, kind)
        if value is not None:
            kwargs[kwarg] = value
    try:
        SamplingParams(**{k: v for k, v in kwargs.items() if k != "stop"})
    except BitMTPError as exc:  # the message starts with the generate keyword, here the OpenAI name too
        field_name = str(exc).split(":", 1)[0]
        raise APIError(400, str(exc), param=field_name if field_name in _SAMPLING else None) from None
    logprobs = _logprobs(body, chat=chat)
    if logprobs:
        kwargs["logprobs"] = True
    return kwargs, logprobs


def _logprobs(body: Mapping[str, Any], *, chat: bool) -> bool:
    """Whether the chosen tokens' logprobs are asked for. Chat: ``logprobs: true`` (``top_logprobs``
    must be 0); completions: ``logprobs: 0`` (the chosen tokens only; OpenAI's N > 0 adds the top N
    alternatives, which bitmtp does not compute)."""
    value = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
            raise bad_request("top_logprobs", f"expected an integer, got {_kind(top)}")
        if top:
            raise bad_request("top_logprobs", "bitmtp returns the chosen tokens' log-probabilities only, not the "
                                              "top alternatives; give 0 or leave it out")
        if value is None:
            return False
        if not isinstance(value, bool):
            raise bad_request("logprobs", f"expected a boolean, got {_kind(value)}")
        return value
    if value is None:
        return False
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request("logprobs", f"expected an integer, got {_kind(value)}")
    if value != 0:
        raise bad_request("logprobs", f"bitmtp returns the chosen tokens' log-probabilities only (logprobs 0), not "
                                      f"the top {value} alternatives; give 0")
    return True


def _content(i: int, msg: Mapping[str, Any]) -> str:
    """A chat message's text: a string, null (an assistant turn without text) or text parts."""
    content = msg.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("messages", f"message {i}, content part {j}: bitmtp takes text parts only "
                                              "({'type': 'text', 'text': '...'})")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request("messages", f"message {i}: content must be a string or an array of text parts, "
                                  f"got {_kind(content)}")


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages", "expected a non-empty array of {'role': ..., 'content': ...} objects, got "
                                      + ("an empty array" if msgs == [] else _kind(msgs)))
    out = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, Mapping):
            raise bad_request("messages", f"message {i} is {_kind(msg)}, not an object")
        role = msg.get("role")
        if role not in _CHAT_ROLES:
            raise bad_request("messages", f"message {i}: role must be one of {', '.join(sorted(_CHAT_ROLES))}, "
                                          f"got {quote(repr(role))}")
        # "developer" is OpenAI's newer name for the system turn; chat templates know "system"
        out.append({"role": "system" if role == "developer" else role, "content": _content(i, msg)})
    return out


def _prompt_ids(model: Any, body: Mapping[str, Any]) -> list[int]:
    """Completions' ``prompt``: text, an array of one text, or token ids (an array of integers)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if prompt == "":
            raise bad_request("prompt", "the prompt is empty")
        return model.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        try:
            return model.check_ids(prompt)
        except BitMTPError as exc:
            raise bad_request("prompt", str(exc).removeprefix("input_ids: ")) from None
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("prompt", f"a batch of {len(prompt)} prompts; bitmtp serves one prompt per request")
    raise bad_request("prompt", f"expected a string or an array of token ids, got {_kind(prompt)}")


def parse_request(body: Any, *, chat: bool, model: Any, model_name: str) -> Request:
    """Check an OpenAI request body against ``model`` (a :class:`bitmtp.BitMTPModel`) served as
    ``model_name``: 400 :class:`APIError` for a bad field, 404 for another model's name; a prompt plus
    ``max_tokens`` over the KV store's capacity is a 400 ``context_length_exceeded``."""
    if not isinstance(body, Mapping):
        raise bad_request(None, f"the request body must be a JSON object, got {_kind(body)}")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad_request("model", f"expected a string, got {_kind(name)}")
    if name is not None and name != model_name:
        raise APIError(404, f"model: {quote(repr(name))} does not exist; this server serves {model_name!r} (GET "
                            "/v1/models)",
                       param="model", code="model_not_found")
    for key, neutral in _UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value != neutral and not (key == "logit_bias" and value == {}):
            raise bad_request(key, f"not supported by bitmtp (got {quote(repr(value))}); leave it out")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("stream", f"expected a boolean, got {_kind(stream)}")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, Mapping):
            raise bad_request("stream_options", f"expected an object, got {_kind(options)}")
        if not stream:
            raise bad_request("stream_options", "only allowed with stream: true")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad_request("stream_options", f"include_usage: expected a boolean, got {_kind(include_usage)}")
    kwargs, logprobs = sampling_kwargs(body, chat=chat)
    origins = _extension_options(body.get("bitmtp"))
    field_name = "messages" if chat else "prompt"
    try:
        ids = model.encode(_messages(body)) if chat else _prompt_ids(model, body)
    except APIError:
        raise
    except BitMTPError as exc:  # e.g. a tokenizer-less model, messages that encode() refuses
        raise bad_request(field_name, str(exc).removeprefix("prompt: ")) from None
    except _refused_by_tokenizer() as exc:  # evaluated only when encoding raised: jinja2 imported lazily
        # the client's text or turns, refused by the tokenizer (text it cannot take) or by the chat template
        # (its raise_exception, e.g. roles that do not alternate): the request's fault, not the server's
        raise bad_request(field_name, f"the model's tokenizer or chat template refused it ({type(exc).__name__}: "
                                      f"{quote(str(exc))})") from None
    kwargs["max_new_tokens"] = _max_tokens(body, chat=chat, prompt_tokens=len(ids), capacity=model.engine.capacity)
    try:  # every decoding option validated once, as generate() would (its config is what the request decodes with)
        config = model.decoding_config(**kwargs)
    except BitMTPError as exc:
        field_name = str(exc).split(":", 1)[0]
        raise APIError(400, str(exc), param=field_name if field_name in _SAMPLING else None) from None
    return Request(chat=chat, input_ids=ids, stream=stream, include_usage=include_usage,
                   logprobs=logprobs, model=name, origins=origins, config=config)


#: the request's extension field ``"bitmtp"``: option → what it asks for
EXTENSION_OPTIONS = {"origins": "each piece of text with the origins of its tokens (bitmtp.origins)"}


def _extension_options(value: Any) -> bool:
    """The request's ``"bitmtp"`` extension object (null or absent: no options) → whether it asks for
    origins."""
    if value is None:
        return False
    if not isinstance(value, Mapping):
        raise bad_request("bitmtp", f"expected an object such as {{\"origins\": true}}, got {_kind(value)}")
    for key in value:
        if key not in EXTENSION_OPTIONS:
            raise bad_request("bitmtp", f"unknown option {quote(repr(key))}; the options are "
                                        + ", ".join(f"{k!r} ({v})" for k, v in EXTENSION_OPTIONS.items()))
    origins = value.get("origins", False)
    if origins is None:
        return False
    if not isinstance(origins, bool):
        raise bad_request("bitmtp", f"origins: expected a boolean, got {_kind(origins)}")
    return origins


def _max_tokens(body: Mapping[str, Any], *, chat: bool, prompt_tokens: int, capacity: int) -> int:
    """``max_tokens`` (chat also takes ``max_completion_tokens``) checked against what the KV store
    leaves after the prompt."""
    field_name = "max_tokens"
    value = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        field_name, value = "max_completion_tokens", body["max_completion_tokens"]
    room = capacity - prompt_tokens
    if room < 1:
        raise APIError(400, f"{'messages' if chat else 'prompt'}: the prompt is {prompt_tokens} tokens and the KV "
                            f"store holds {capacity}; shorten it to under {capacity} tokens (or serve with a larger "
                            "--capacity)", param="messages" if chat else "prompt", code="context_length_exceeded")
    if value is None:
        return room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(field_name, f"expected an integer, got {_kind(value)}")
    if value < 1:
        raise bad_request(field_name, f"must be >= 1, got {value}")
    if value > room:
        raise APIError(400, f"{field_name}: the prompt ({prompt_tokens} tokens) plus {field_name} ({value}) exceeds "
                            f"the KV store's capacity of {capacity} tokens; ask for at most {room} (or serve with a "
                            "larger --capacity)", param=field_name, code="context_length_exceeded")
    return value


__all__ = ["APIError", "Request", "parse_request", "sampling_kwargs"]
