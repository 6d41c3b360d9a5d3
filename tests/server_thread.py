"""A real server on a background thread for tests: uvicorn with the production DrainingServer,
on an ephemeral port, in the test process (so a test can reach the engine it serves)."""

from __future__ import annotations

import signal
import threading
import time

from fastapi import FastAPI

from kvserve.service.server.drain import DrainingServer


class ServerThread:
    """A DrainingServer on a background thread.

    `stop()` drains like SIGTERM would; `drain()` starts that without waiting."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        self.server = DrainingServer.for_app(app, host, port, log_level)
        self.thread = threading.Thread(target=self.server.run, name="kvserve-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def drain(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout: float = 60.0) -> None:
        if self.thread.is_alive():
            self.drain()
            self.thread.join(timeout)

