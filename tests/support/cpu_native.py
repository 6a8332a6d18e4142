"""The native CPU extension (csrc/cpu) and the ISA paths this CPU can run.

Importing this module skips the importing test module when ``bitmtp.ops.backends.cpu_backend`` cannot be
imported; ``ISAS`` is empty when the extension is not built (test modules skip on that themselves)."""

from __future__ import annotations

import pytest

cpu_backend = pytest.importorskip("bitmtp.ops.backends.cpu_backend")
try:
    ISAS: list[str] = cpu_backend.supported_isas()
except ImportError:
    ISAS = []
