"""`python -m kvserve.service.api_server` as a real process for tests: the tiny model served as
"tiny" on a free local port, its output in a log file."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from conftest import free_port, wait_for


def health(url: str) -> int:
    """The status of GET /health; 0 while nothing answers."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return 0


@contextmanager
def api_server_process(model_dir: Path, log: Path, *flags: str, timeout: float = 180.0,
                       engine_core: str | None = "thread"
                       ) -> Iterator[tuple[subprocess.Popen, str]]:
    """The server process (with `flags` added to its command line) and its URL, once /health
    answers 200; killed on the way out unless the test has ended it. `engine_core` is its
    `--engine-core`: the thread unless a test is about the split (the core process adds seconds
    of start-up), None for the default."""
    if engine_core is not None:
        flags = ("--engine-core", engine_core, *flags)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.service.api_server", "--model", str(model_dir),
             "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
             "--kv-cache-memory", "4MiB", "--dtype", "float32", "--log-level", "info", *flags],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or health(url) == 200, timeout, "the server")
        assert proc.poll() is None, log.read_text()[-3000:]
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
