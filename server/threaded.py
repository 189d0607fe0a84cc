"""The server in a background thread of this process: for tests and for
benchmarks that compare HTTP with in-process serving on one engine.

Why a socket bound before uvicorn starts: port 0 then means "any free
port", and the port is known (:attr:`ThreadedServer.url`) without a race
between finding a free port and binding it. uvicorn installs signal
handlers only in the main thread, so in this thread it installs none; the
process' Ctrl-C stays the caller's.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from paged_jax.checks import check_float, check_int


class ThreadedServer:
    """uvicorn serving ``app`` in a daemon thread; a context manager.

    Args:
      app: the ASGI app (:func:`server.app.build_app`).
      host: the address to bind (default loopback only).
      port: the port; 0 picks a free one.
      log_level: uvicorn's (``"warning"`` keeps the access log quiet).

    Raises:
      ValueError: ``port`` outside [0, 65536).
      OSError: the address cannot be bound.
    """

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        check_int("port", port, 0, 65536)
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        """``http://host:port`` (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ThreadedServer:
        """Starts serving; returns once uvicorn accepts connections.

        Raises:
          RuntimeError: uvicorn stopped or did not start within ``timeout``
            seconds (its log says why).
        """
        check_float("timeout", timeout, 0, low_open=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread stopped while starting (see uvicorn's log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Asks uvicorn to exit (the app's lifespan stops its engine loop)
        and waits up to ``timeout`` seconds for the thread."""
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
