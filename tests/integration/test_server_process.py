"""`python -m kvserve.service.api_server` as a real process: start-up log (memory budget, URL, the
curl line), serving, and SIGTERM draining the running request before a clean exit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
from conftest import free_port


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return 0


def test_sigterm_drains_then_exits(tiny_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.service.api_server", "--model", str(tiny_model_dir),
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "512", "--kv-cache-memory", "4MiB", "--dtype", "float32",
         "--shutdown-grace-period", "60",
         "--log-level", "info"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: health(url) == 200 or proc.poll() is not None, 180, "the server")
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                # While it drains, new work is refused (503); once it has exited, the port is shut.
                try:
                    refused = httpx.post(url + "/v1/completions", json={**body, "stream": False})
                    assert refused.status_code == 503
                    assert refused.json()["error"]["type"] == "service_unavailable"
                except httpx.ConnectError:
                    pass
                data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert json.loads(data[-2][6:])["usage"]["completion_tokens"] == 400
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = (tmp_path / "server.log").read_text()
    assert "drained (0 request(s) aborted)" in text
    assert "memory budget: KV cache: 512 blocks x 16 tokens" in text
    assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in text
    assert "openai.Client(base_url=" in text
