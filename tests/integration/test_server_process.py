"""`python -m kvserve.service.api_server` as a real process: start-up log (memory budget, URL, the
curl line), serving, and SIGTERM draining the running request before a clean exit."""

from __future__ import annotations

import json
import os
import re
import signal

import httpx
from conftest import wait_for
from server_process import api_server_process, health


def test_sigterm_drains_then_exits(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with api_server_process(tiny_model_dir, log, "--max-model-len", "512",
                            "--shutdown-grace-period", "60", engine_core="process"
                            ) as (proc, url):
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                # From the signal on it drains: /health answers 503, then new work is refused
                # with 503. Neither check may be skipped: the stream above still has ~399 tokens
                # to generate, so the server cannot have drained and shut its port before them
                # (a connection error here fails the test).
                seen: list[int] = []
                wait_for(lambda: seen.append(health(url)) or seen[-1] != 200, 30,
                         "the server to start draining")
                assert seen[-1] == 503, f"/health gave {seen[-1]} (0: no answer) while draining"
                refused = httpx.post(url + "/v1/completions", json={**body, "stream": False})
                assert refused.status_code == 503
                assert refused.json()["error"]["type"] == "service_unavailable"
                data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]", (data[-3:], log.read_text()[-3000:])
        assert json.loads(data[-2][6:]).get("usage", {}).get("completion_tokens") == 400, (
            data[-3:], log.read_text()[-3000:])
        assert proc.wait(60) == 0
    text = log.read_text()
    assert "drained (0 request(s) aborted)" in text
    assert "memory budget: KV cache: 512 blocks x 16 tokens" in text
    assert f"curl {url}/v1/chat/completions" in text
    assert "openai.Client(base_url=" in text


def test_engine_core_death_ends_streams_and_the_server(tiny_model_dir, tmp_path, monkeypatch):
    """The default server (`--engine-core auto`, on this CPU) runs the engine core in its own
    process: when it dies, an open stream ends with an SSE error event, /health answers 503 with
    the reason, and the server exits (non-zero) so that Kubernetes restarts the pod."""
    monkeypatch.setenv("KVSERVE_EXIT_AFTER_CORE_DEATH_S", "5")
    log = tmp_path / "server.log"
    with api_server_process(tiny_model_dir, log, "--max-model-len", "512",
                            engine_core=None) as (proc, url):
        match = re.search(r"engine core: process (\d+)", log.read_text())
        assert match, log.read_text()[-2000:]
        core_pid = int(match.group(1))
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"]
                os.kill(core_pid, signal.SIGKILL)
                data = [line for line in lines if line.startswith("data: ")]
            health = http.get(url + "/health")
        errors = [json.loads(d[6:]) for d in data if d != "data: [DONE]" and "error" in d]
        assert errors and "engine" in errors[-1]["error"]["message"], data[-3:]
        assert health.status_code == 503
        assert health.json()["status"] == "dead"
        assert "exit code -9" in health.json()["reason"]
        assert proc.wait(60) == 1
    assert "engine core: " in log.read_text()
