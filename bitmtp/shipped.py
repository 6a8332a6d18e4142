"""Shipped MTP adapters: adapter folders inside the package (``bitmtp/adapters/<name>/``), plus any
under the folders named by ``BITMTP_ADAPTERS`` (``os.pathsep``-separated).

``bitmtp.load`` attaches one by itself when the loaded base model matches it — same architecture
and shape, and the same weight fingerprint (``bitmtp.model.adapters.base_fingerprint``) — so a
shipped adapter is never applied to a model it was not trained on. Among matches, the one with the
highest ``preference`` in its config's ``training`` record wins (the one that measured best).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bitmtp.formats.adapters import CONFIG_FILE, AdapterConfig, BaseShape

ENV = "BITMTP_ADAPTERS"


def adapter_dirs() -> list[Path]:
    roots = [Path(__file__).parent / "adapters"]
    roots += [Path(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    found = []
    for root in roots:
        if root.is_dir():
            found += sorted(p for p in root.iterdir() if (p / CONFIG_FILE).is_file())
    return found


def find_shipped(args: Any, fingerprint: str) -> Path | None:
    """The best shipped adapter for a model with ``args`` (ModelArgs) and weight ``fingerprint``."""
    best, best_pref = None, float("-inf")
    shape = asdict(BaseShape.of(args))
    for path in adapter_dirs():
        try:
            raw = json.loads((path / CONFIG_FILE).read_text())
            cfg = AdapterConfig(**raw)
        except (ValueError, TypeError):
            continue  # a broken folder is not a match; loading it explicitly reports why
        if cfg.fingerprint != fingerprint or asdict(cfg.base) != shape:
            continue
        pref = float((cfg.training or {}).get("preference", 0))
        if pref > best_pref:
            best, best_pref = path, pref
    return best
