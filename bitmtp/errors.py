"""Exceptions raised by bitmtp.

Every error a user can cause is a :class:`BitMTPError`; the subclasses also derive from the
matching built-in exception so ``except ValueError`` style handlers keep working. Messages name
the argument, field or file at fault.
"""

from __future__ import annotations


class BitMTPError(Exception):
    """Base class of every error bitmtp raises on purpose."""


class ShapeError(BitMTPError, ValueError):
    """A tensor argument has the wrong number of dimensions or the wrong size."""


class DTypeError(BitMTPError, TypeError):
    """A tensor argument has the wrong dtype."""


class DeviceError(BitMTPError, ValueError):
    """Tensor arguments live on the wrong device (or on different devices)."""


class FormatError(BitMTPError, ValueError):
    """Data does not follow the format it claims (e.g. non-ternary values given to the packer)."""


class LayoutError(BitMTPError, ValueError):
    """A buffer is non-contiguous or misaligned where a kernel needs it dense and aligned."""


class TokenIdError(BitMTPError, IndexError):
    """A token id outside the model's vocabulary; an ``IndexError`` too, as transformers' embedding
    lookup raises for the same input (``bitmtp.patch`` keeps that contract)."""


class BackendUnavailableError(BitMTPError, RuntimeError):
    """An explicitly requested backend cannot run here (missing package, device or extension)."""


__all__ = [
    "BitMTPError",
    "ShapeError",
    "DTypeError",
    "DeviceError",
    "FormatError",
    "LayoutError",
    "BackendUnavailableError",
    "TokenIdError",
]


class FallbackWarning(UserWarning):
    """bitmtp could not run a call itself and handed it to another implementation (``bitmtp.patch``: a call
    transformers' own ``generate`` runs, e.g. beam search or an arbitrary logits processor)."""
