"""bitmtp: multi-token decoding for ternary (1.58-bit, W2A8) language models.

The foundation layer is importable without any compiled extension: the T2 packed ternary format
(:mod:`bitmtp.formats`), the W2A8 ops with their pure-torch references and backend registry
(:mod:`bitmtp.ops`), and :class:`TernaryLinear`.
"""

from bitmtp.errors import (
    BackendUnavailableError,
    BitMTPError,
    DeviceError,
    DTypeError,
    FormatError,
    LayoutError,
    ShapeError,
    TokenIdError,
)
from bitmtp.ops import TernaryLinear, act_quant, available_backends, w2a8_accumulate, w2a8_linear


def __getattr__(name):
    # load() pulls in the model and runtime layers; import them on first use so `import bitmtp`
    # stays light for users of the ops alone.
    if name in ("load", "generate", "decoding_config", "BitMTPModel", "GenerateOutput", "Span", "TextStream"):
        from bitmtp import api

        return getattr(api, name)
    if name in ("patch", "unpatch"):
        from bitmtp import hf

        return getattr(hf, name)
    if name == "DecodingConfig":
        from bitmtp.decoding.config import DecodingConfig

        return DecodingConfig
    raise AttributeError(f"module 'bitmtp' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "__version__",
    "BitMTPError",
    "ShapeError",
    "DTypeError",
    "DeviceError",
    "FormatError",
    "LayoutError",
    "BackendUnavailableError",
    "TernaryLinear",
    "w2a8_linear",
    "w2a8_accumulate",
    "act_quant",
    "available_backends",
    "load",
    "generate",
    "decoding_config",
    "DecodingConfig",
    "BitMTPModel",
    "GenerateOutput",
    "Span",
    "TextStream",
    "TokenIdError",
    "patch",
    "unpatch",
]
