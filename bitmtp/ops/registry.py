"""The backend registry: which implementation runs an op.

A backend is an object with a ``name``, an ``availability(device)`` check returning
``(ok, reason)``, and methods named after the ops it implements (``act_quant``,
``w2a8_accumulate``, ``w2a8_linear_q``, ``dense_linear``, …). Selection, per call:

1. an explicit ``backend=`` argument, else the ``BITMTP_BACKEND`` environment variable: that
   backend must exist and be available on the tensors' device, or :class:`BackendUnavailableError`
   says why. An op the chosen backend does not implement runs on the ``torch`` reference (kernels
   speed some ops up; the reference defines all of them).
2. otherwise the first available backend in the device's preference order
   (:data:`PREFERENCE`); passing over a preferred backend logs one line saying why.

A backend whose compiled extension is not installed raises :class:`NativeKernelsMissing` from its
loader: bitmtp then runs on the next backend, and the first attempt to load it warns once per process
(a ``logging`` warning and a ``RuntimeWarning``) with the reason, the cost and the fix;
:func:`missing_native` returns that message for ``python -m bitmtp info``.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from bitmtp.errors import BackendUnavailableError, BitMTPError

log = logging.getLogger("bitmtp")

ENV_VAR = "BITMTP_BACKEND"

#: Automatic choice per device type, best first.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": ("cuda", "triton", "torch"),
    "cpu": ("cpu", "torch"),
}


class Backend(Protocol):
    name: str

    def availability(self, device: torch.device) -> tuple[bool, str]: ...


_BACKENDS: dict[str, Backend] = {}
_LOADERS: dict[str, Callable[[], Backend]] = {}
_LOAD_ERRORS: dict[str, str] = {}
_LOGGED: set[tuple[str, str, str]] = set()
_OVERRIDES: dict[tuple[str, str], Callable[..., Any]] = {}
_MISSING_NATIVE: dict[str, str] = {}  # backend name -> the warning its missing extension gave
_WARNED: set[str] = set()  # backends whose missing extension was already announced in this process


class NativeKernelsMissing(ImportError):
    """A backend's compiled extension is not installed or does not load. The message says why, what
    running without it costs, and how to get it; the registry announces it once per process."""


def register_backend(name: str, loader: Callable[[], Backend]) -> None:
    """Register a backend lazily: ``loader`` is called (once) the first time it is needed."""
    _CHOSEN.clear()
    _LOADERS[name] = loader
    _BACKENDS.pop(name, None)
    _LOAD_ERRORS.pop(name, None)
    _MISSING_NATIVE.pop(name, None)


def backend_names() -> list[str]:
    return list(_LOADERS)


def _load(name: str) -> Backend | None:
    if name in _BACKENDS:
        return _BACKENDS[name]
    if name in _LOAD_ERRORS:
        return None
    try:
        _BACKENDS[name] = _LOADERS[name]()
    except Exception as exc:  # an optional dependency missing or broken: report, never crash import
        _LOAD_ERRORS[name] = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, NativeKernelsMissing):
            _announce_missing(name, str(exc))
        return None
    return _BACKENDS[name]


def _announce_missing(name: str, message: str) -> None:
    """Warn once per process that backend ``name`` lacks its native kernels: silently running several
    times slower is the failure this exists to prevent (an install without a compiler succeeds)."""
    _MISSING_NATIVE[name] = message
    if name in _WARNED:
        return
    _WARNED.add(name)
    # one message per sink: the warning always (shown by default, filterable), the log record only where the
    # application configured logging (unconfigured, logging's last-resort handler would print it a second time)
    if log.hasHandlers():
        log.warning("bitmtp: %s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def missing_native(name: str | None = None) -> dict[str, str]:
    """Backends (all, or just ``name``) whose native kernels failed to load, with the warning each gave.
    Loads the backends it is asked about, so the answer does not depend on what ran before."""
    for n in [name] if name is not None else list(_LOADERS):
        if n in _LOADERS:
            _load(n)
    return {n: m for n, m in _MISSING_NATIVE.items() if (name is None or n == name) and n in _LOAD_ERRORS}


def availability(name: str, device: torch.device | str = "cpu") -> tuple[bool, str]:
    """``(ok, reason)`` for backend ``name`` on ``device``."""
    if name not in _LOADERS:
        return False, f"unknown backend (known: {', '.join(_LOADERS)})"
    backend = _load(name)
    if backend is None:
        return False, f"failed to load: {_LOAD_ERRORS[name]}"
    return backend.availability(device if isinstance(device, torch.device) else torch.device(device))


def available_backends(device: torch.device | str = "cpu") -> dict[str, tuple[bool, str]]:
    """Every registered backend with ``(ok, reason)`` on ``device``."""
    return {name: availability(name, device) for name in _LOADERS}


def _requested(backend: str | None) -> str | None:
    if backend is not None:
        return backend
    env = os.environ.get(ENV_VAR, "").strip()
    return env or None


#: the automatic choice per (op, device) — what :func:`select` returns with no backend requested — made once: a
#: step selects ~5 ops, each choice ~10-25 µs of Python with the caches cold after the layers (bench/glue.py).
#: Cleared whenever what it depends on changes (a backend registered or loaded, an override entered or left).
_CHOSEN: dict[tuple[str, torch.device], tuple[tuple, Callable[..., Any]]] = {}


def select(op: str, device: torch.device, backend: str | None = None) -> Callable[..., Any]:
    """The callable implementing ``op`` for tensors on ``device``."""
    name = _requested(backend)
    if name is None:
        state = _state()
        got = _CHOSEN.get((op, device))
        if got is None or got[0] != state:
            got = _CHOSEN[(op, device)] = (state, _select(op, device, None))
        return got[1]
    return _select(op, device, name, backend)


def choice_state(backend: str | None = None) -> tuple:
    """What :func:`select`'s answers for ``backend`` (None: the automatic choice) depend on — the backend requested
    (argument or ``BITMTP_BACKEND``), the tables, the overrides and preferences: a caller that caches something
    derived from several selections keys it on this (``Decoder._native_tail``)."""
    return (_requested(backend), *_state())


def _state() -> tuple:
    """What the automatic choice depends on (tests swap the tables themselves: a new dict or a popped entry)."""
    return (id(_BACKENDS), len(_BACKENDS), id(_LOADERS), len(_LOADERS), len(_LOAD_ERRORS), len(_OVERRIDES),
            tuple(PREFERENCE.get("cpu", ())), tuple(PREFERENCE.get("cuda", ())))


def _select(op: str, device: torch.device, name: str | None, backend: str | None = None) -> Callable[..., Any]:
    source = "backend=" if backend is not None else f"{ENV_VAR}"
    if name is not None:
        if name not in _LOADERS:
            raise BitMTPError(f"{source}: unknown backend {name!r}; known backends: {', '.join(_LOADERS)}")
        ok, why = availability(name, device)
        if not ok:
            raise BackendUnavailableError(f"{source}: backend {name!r} cannot run on {device}: {why}")
    else:
        name = _auto(op, device)
    override = _OVERRIDES.get((name, op))
    if override is not None:
        return override
    impl = getattr(_BACKENDS[name], op, None)
    if impl is None:
        impl = getattr(_load("torch"), op)
    return impl


def requested_backend(backend: str | None = None) -> str | None:
    """The backend a call would be pinned to: ``backend`` if given, else ``BITMTP_BACKEND``, else None."""
    return _requested(backend)


def overridden(backend: str) -> bool:
    """Whether any op of ``backend`` is currently replaced through :func:`override`."""
    return any(name == backend for name, _ in _OVERRIDES)


def backend(name: str) -> Backend | None:
    """The loaded backend object ``name`` (None when it failed to load)."""
    if name not in _LOADERS:
        raise BitMTPError(f"unknown backend {name!r}; known backends: {', '.join(_LOADERS)}")
    return _load(name)


def _auto(op: str, device: torch.device) -> str:
    order = PREFERENCE.get(device.type, ("torch",))
    skipped = []
    for name in order:
        if name not in _LOADERS:
            continue
        ok, why = availability(name, device)
        if ok and hasattr(_BACKENDS[name], op):
            if skipped:
                key = (device.type, op, name)
                if key not in _LOGGED:
                    _LOGGED.add(key)
                    log.info("bitmtp: %s on %s runs on backend %r (%s)", op, device.type, name, "; ".join(skipped))
            return name
        skipped.append(f"{name}: {why if not ok else 'does not implement ' + op}")
    return "torch"


@contextmanager
def override(backend: str, op: str, fn: Callable[..., Any]) -> Iterator[None]:
    """Temporarily replace ``op`` of ``backend`` (benchmark gates inject slowed kernels this way)."""
    key = (backend, op)
    previous = _OVERRIDES.get(key)
    _OVERRIDES[key] = fn
    _CHOSEN.clear()
    try:
        yield
    finally:
        _CHOSEN.clear()
        if previous is None:
            _OVERRIDES.pop(key, None)
        else:
            _OVERRIDES[key] = previous


__all__ = [
    "ENV_VAR",
    "PREFERENCE",
    "NativeKernelsMissing",
    "missing_native",
    "register_backend",
    "backend_names",
    "availability",
    "available_backends",
    "select",
    "override",
    "overridden",
    "requested_backend",
    "backend",
]
