"""`python -m kvserve.service.api_server` as a real process: start-up log (memory budget, URL, the
curl line), serving, and SIGTERM draining the running request before a clean exit."""

from __future__ import annotations

import json
import signal

import httpx
from server_process import api_server_process


def test_sigterm_drains_then_exits(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with api_server_process(tiny_model_dir, log, "--max-model-len", "512",
                            "--shutdown-grace-period", "60") as (proc, url):
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
    text = log.read_text()
    assert "drained (0 request(s) aborted)" in text
    assert "memory budget: KV cache: 512 blocks x 16 tokens" in text
    assert f"curl {url}/v1/chat/completions" in text
    assert "openai.Client(base_url=" in text
