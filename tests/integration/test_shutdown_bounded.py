"""Every shutdown path of a real `kvserve serve` / `kvserve router` process ends the process
within a bound (issue 41): a second SIGTERM with a request in flight, one SIGTERM with a request
longer than the grace period, the engine core's death, and a router whose replica was SIGKILLed.
The bounds are deadlines for a hang, not performance figures: a process that hangs (as these did,
for 13 minutes and more) fails them; a slow machine does not."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import RedisServer, free_port, wait_for
from server_process import api_server_process, health

from kvserve.service.signal_drain import FORCED_EXIT_S, SHUTDOWN_MARGIN_S

pytestmark = pytest.mark.slow

LONG = {"model": "tiny", "prompt": "The quick", "max_tokens": 480, "temperature": 0,
        "ignore_eos": True, "stream": True}
# What a busy 2-core machine may add to a bound (process start-up is not counted: the clock
# starts at the signal).
SLACK_S = 30.0


def core_pid(log: Path) -> int:
    match = re.search(r"engine core: process (\d+)", log.read_text())
    assert match, log.read_text()[-2000:]
    return int(match.group(1))


def gone(pid: int) -> bool:
    """The process has exited (a zombie left for its parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def exits_within(proc: subprocess.Popen, seconds: float, log: Path) -> int:
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {seconds:.0f} s after the signal:\n"
                             f"{log.read_text()[-4000:]}") from None


def first_token(lines) -> str:
    line = next(x for x in lines if x.startswith("data: "))
    assert json.loads(line[6:])["choices"], line
    return line


def test_a_second_sigterm_with_a_stream_in_flight_ends_the_server_and_its_core(
        tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with api_server_process(tiny_model_dir, log, "--max-model-len", "512",
                            "--shutdown-grace-period", "600", engine_core="process"
                            ) as (proc, url):
        pid = core_pid(log)
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", url + "/v1/completions", json=LONG) as resp:
                lines = resp.iter_lines()
                first_token(lines)
                proc.send_signal(signal.SIGTERM)
                wait_for(lambda: health(url) != 200, 30, "the server to start draining")
                proc.send_signal(signal.SIGTERM)  # the grace period (600 s) is not waited for
                start = time.monotonic()
                exits_within(proc, FORCED_EXIT_S + SLACK_S, log)
        assert "second signal: exiting" in log.read_text()
        wait_for(lambda: gone(pid), SLACK_S - (time.monotonic() - start) + 5,
                 "the engine core to exit with the server")


def test_one_sigterm_with_a_request_longer_than_the_grace_period_exits_after_it(
        tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    grace = 1.0
    with api_server_process(tiny_model_dir, log, "--max-model-len", "512",
                            "--shutdown-grace-period", str(grace), engine_core="process"
                            ) as (proc, url):
        pid = core_pid(log)
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", url + "/v1/completions", json=LONG) as resp:
                lines = resp.iter_lines()
                first_token(lines)
                proc.send_signal(signal.SIGTERM)
                rest = [x for x in lines if x.startswith("data: ")]
        assert rest, "the stream ended without a last event"
        assert exits_within(proc, grace + SHUTDOWN_MARGIN_S + SLACK_S, log) == 0
        wait_for(lambda: gone(pid), SLACK_S, "the engine core to exit with the server")


def test_the_engine_core_killed_ends_an_idle_server_with_the_reason(tiny_model_dir, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("KVSERVE_EXIT_AFTER_CORE_DEATH_S", "1")
    log = tmp_path / "server.log"
    with api_server_process(tiny_model_dir, log, "--max-model-len", "512",
                            engine_core="process") as (proc, _):
        os.kill(core_pid(log), signal.SIGKILL)
        assert exits_within(proc, 1 + SHUTDOWN_MARGIN_S + SLACK_S, log) == 1
    assert "exit code -9" in log.read_text()


def test_a_router_whose_replica_was_killed_exits_on_sigterm(tiny_model_dir, tmp_path,
                                                            redis_binary):
    """The router of issue 41's hang: Redis shared load on, its replica SIGKILLed mid-stream,
    then SIGTERM: the router drains (nothing left in flight) and exits."""
    from test_router import SERVICE, spawn, wait_healthy

    redis = RedisServer(redis_binary, tmp_path)
    redis.start()
    port = free_port()
    try:
        with api_server_process(tiny_model_dir, tmp_path / "replica.log", "--max-model-len",
                                "512", "--redis-url", redis.url, "--service-name", SERVICE,
                                "--replica-id", "r1") as (replica, _):
            router = spawn("router", [
                "kvserve.service.router", "--host", "127.0.0.1", "--port", str(port),
                "--redis-url", redis.url, "--service-name", SERVICE, "--tokenizer",
                str(tiny_model_dir), "--shared-load-interval", "0.1",
                "--shutdown-grace-period", "5", "--log-level", "info"], port, tmp_path)
            try:
                wait_healthy(router, time.monotonic() + 120)
                with httpx.stream("POST", router.url + "/v1/completions", json=LONG,
                                  timeout=60) as resp:
                    chunks = resp.iter_raw()
                    next(chunks)
                    replica.kill()
                    replica.wait()
                    received = b"".join(chunks)  # the router ends the broken stream
                assert received
                router.proc.send_signal(signal.SIGTERM)
                exits_within(router.proc, 5 + SHUTDOWN_MARGIN_S + SLACK_S, router.log)
            finally:
                if router.proc.poll() is None:
                    router.proc.kill()
                    router.proc.wait()
    finally:
        redis.stop()


def test_the_watchdog_ends_a_shutdown_past_its_deadline(tiny_model_dir, tmp_path, monkeypatch):
    """With no grace and no margin, the watchdog's deadline is the signal itself: it fires
    before uvicorn's own shutdown (which waits 0.1 s at least) and ends the process with status
    3, the threads' stacks in the log and the engine core killed."""
    monkeypatch.setenv("KVSERVE_SHUTDOWN_MARGIN_S", "0")
    log = tmp_path / "server.log"
    with api_server_process(tiny_model_dir, log, "--max-model-len", "512",
                            "--shutdown-grace-period", "0", engine_core="process"
                            ) as (proc, _):
        pid = core_pid(log)
        proc.send_signal(signal.SIGTERM)
        assert exits_within(proc, SLACK_S, log) == 3
    text = log.read_text()
    assert "shutdown did not end in time" in text
    assert "Thread 0x" in text or "Current thread 0x" in text  # faulthandler's dump
    wait_for(lambda: gone(pid), SLACK_S, "the engine core to be killed")
