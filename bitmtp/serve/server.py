"""Running the app: in the foreground (``python -m bitmtp serve``) or on a background thread
(:func:`run_in_thread`: tests, benchmarks, notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from bitmtp.errors import BitMTPError
from bitmtp.serve.app import require_serve


class BackgroundServer:
    """A uvicorn server on a thread of this process, listening on ``url`` until :meth:`stop`
    (or the end of a ``with`` block)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        require_serve()
        import uvicorn

        # bind here, so port 0 (any free port) is known before the server starts. proto IPPROTO_TCP, not the
        # default 0: accepted sockets inherit it, and asyncio disables Nagle's algorithm (TCP_NODELAY) only on
        # sockets whose proto says TCP; without it every answer after a connection's first waited for the
        # client's delayed ACK (40 ms a /health, 40 ms between a stream's pieces)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                   socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
        self._thread = threading.Thread(target=self._serve, name="bitmtp-uvicorn", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` (an OpenAI client's base_url is this plus ``/v1``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self._sock])
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc

    def start(self, timeout: float = 300.0) -> BackgroundServer:
        """Start serving and wait until the app has started (its model loaded): BitMTPError when the
        startup failed or took longer than ``timeout`` seconds."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                why = self._error or "its startup failed; see the log"
                raise BitMTPError(f"serve: the server did not start ({why})")
            if time.monotonic() > deadline:
                self.stop()
                raise BitMTPError(f"serve: the server did not start within {timeout:g} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop serving (open streams are cut) and wait for the thread."""
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                  timeout: float = 300.0) -> BackgroundServer:
    """Serve ``app`` (from :func:`bitmtp.serve.create_app`) on a background thread, on ``port`` (0: a
    free one), and return once it answers; ``.url`` is where, ``.stop()`` ends it."""
    return BackgroundServer(app, host, port, log_level).start(timeout)


def serve_forever(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` in the foreground until Ctrl-C (``python -m bitmtp serve``)."""
    require_serve()
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
