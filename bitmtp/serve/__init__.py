"""``bitmtp.serve``: an OpenAI-compatible HTTP server over :func:`bitmtp.generate` (``pip install
'bitmtp[serve]'``), and its Ray Serve deployment (``pip install 'bitmtp[ray]'``).

- :func:`create_app` — the FastAPI app: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``
  (streamed as server-sent events), ``/health``; requests decode on a pool of ``model.session()`` KV
  stores behind a bounded queue (429 when it is full).
- :func:`run_in_thread` — serve an app on a background thread (tests, notebooks).
- :func:`ray_app` — the same app as a Ray Serve deployment, one model per replica (``python -m bitmtp
  serve --replicas N``).

Importing this package needs neither FastAPI nor Ray; the functions raise a BitMTPError naming the
extra to install when theirs is missing.
"""

from __future__ import annotations

from bitmtp.serve.app import create_app
from bitmtp.serve.errors import APIError
from bitmtp.serve.ray_serve import ray_app
from bitmtp.serve.server import BackgroundServer, run_in_thread

__all__ = ["create_app", "run_in_thread", "BackgroundServer", "ray_app", "APIError"]
