"""A replica's drain hands back what it could not finish (issue 41, "Drain without loss"): after
SIGTERM and `--drain-timeout`, a stream still running ends with exactly the agreed migrate event
and nothing after it, a non-streaming request gets 503 with the same body and
`x-kvserve-migrate: 1`; the router re-issues both elsewhere. A real `kvserve serve` process."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from conftest import wait_for
from server_process import api_server_process

from kvserve.service.server.handback import MIGRATE_HEADER

pytestmark = pytest.mark.slow

HANDED_BACK = {"error": {"message": "replica draining: stream handed back for migration",
                         "type": "ServiceUnavailableError", "code": 503, "param": None,
                         "kvserve_migrate": True}}
LONG = {"model": "tiny", "prompt": "The quick", "max_tokens": 480, "temperature": 0,
        "ignore_eos": True}


def running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    lines = [x for x in text.splitlines() if x.startswith("vllm:num_requests_running")]
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines)


def test_requests_still_running_at_the_drain_timeout_are_handed_back(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with api_server_process(tiny_model_dir, log, "--max-model-len", "512",
                            "--drain-timeout", "0") as (proc, url):
        answer: list[httpx.Response] = []
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}
                             ) as resp:
                lines = resp.iter_lines()
                first = next(x for x in lines if x.startswith("data: "))
                assert json.loads(first[6:])["choices"]
                waiter = threading.Thread(target=lambda: answer.append(
                    httpx.post(url + "/v1/completions", json=LONG, timeout=120)))
                waiter.start()
                # Both run now: the stream, started first, is ahead of the other request, so
                # the other one cannot finish before the stream is handed back.
                wait_for(lambda: running(url) == 2, 60, "both requests to run")
                proc.send_signal(signal.SIGTERM)
                rest = [x for x in lines if x.startswith("data: ")]
                waiter.join(120)
        assert rest, "the stream ended without a last event"
        assert json.loads(rest[-1][6:]) == HANDED_BACK, (rest[-3:], log.read_text()[-3000:])
        assert all("error" not in json.loads(x[6:]) for x in rest[:-1])  # one error, the last
        (late,) = answer
        assert late.status_code == 503, late.text
        assert late.headers[MIGRATE_HEADER] == "1"
        assert late.json() == HANDED_BACK
        assert proc.wait(60) == 0
