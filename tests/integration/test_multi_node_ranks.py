"""A replica spanning two "hosts" on localhost, started as a LeaderWorkerSet and torchrun start
them: a leader `kvserve serve` (API, rank 0, pipeline stage 0) and a `kvserve serve --headless`
worker (stage 1), each finding its rank from the environment alone. The pair answers as one rank
does; a killed worker rank takes the group down (the leader's /health says why with a 503, both
processes exit nonzero), and so does a killed leader."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from conftest import free_port, make_llm, wait_for
from forked_process import ForkedProc, fork_module, stop_forkserver
from server_process import health

from kvserve import SamplingParams

PROMPT = "Paged attention stores the KV cache in"
FLAGS = ("--model", "{model}", "--pipeline-parallel-size", "2", "--dtype", "float32",
         "--max-model-len", "256", "--log-level", "info")


# The seconds the leader stays up after its engine core died, answering /health with a 503.
# The server reads it when it is imported, and the forkserver imports it when it starts: so the
# variable is set before this module's first fork, on a forkserver of its own.
EXIT_GRACE_S = "5"


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> Iterator[None]:
    """Both hosts are `kvserve serve` processes forked from forked_process.py's preloaded
    forkserver (each a real process of its own: pid, ports, signals, exit code), not spawned
    interpreters importing torch and transformers again; the ranks and engine core they start
    are spawned as in production."""
    stop_forkserver()
    patch = pytest.MonkeyPatch()
    patch.setenv("KVSERVE_EXIT_AFTER_CORE_DEATH_S", EXIT_GRACE_S)
    try:
        yield
    finally:
        patch.undo()
        stop_forkserver()


def command(model: Path, *extra: str) -> list[str]:
    return ["serve", *(f.format(model=model) for f in FLAGS), *extra]


@contextmanager
def group(model: Path, tmp: Path, leader_env: dict, worker_env: dict,
          engine_core: str) -> Iterator[tuple[ForkedProc, ForkedProc, str]]:
    """(leader, worker, the leader's URL) once /health answers 200; both killed after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = {"MASTER_PORT": str(free_port()), "KVSERVE_COMMAND_PORT": str(free_port()),
            "KVSERVE_EXIT_AFTER_CORE_DEATH_S": EXIT_GRACE_S}
    worker = fork_module("kvserve.service.cli", command(model, "--headless"), tmp / "worker.log",
                         {**base, **worker_env})
    leader = fork_module(
        "kvserve.service.cli",
        command(model, "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
                "tiny", "--kv-cache-memory", "4MiB", "--engine-core", engine_core),
        tmp / "leader.log", {**base, **leader_env})
    try:
        wait_for(lambda: leader.poll() is not None or health(url) == 200, 300, "the leader")
        assert leader.poll() is None, (tmp / "leader.log").read_text()[-3000:]
        yield leader, worker, url
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def complete(url: str) -> str:
    client = openai.Client(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    return out.choices[0].text


def one_rank_text(model: Path) -> str:
    llm = make_llm(model, max_model_len=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=16)
        return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()


def test_lws_pods_serve_as_one_rank_and_a_killed_worker_ends_the_group(tiny_model_dir,
                                                                        tmp_path) -> None:
    expected = one_rank_text(tiny_model_dir)
    lws = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "127.0.0.1"}
    with group(tiny_model_dir, tmp_path, {**lws, "LWS_WORKER_INDEX": "0"},
               {**lws, "LWS_WORKER_INDEX": "1"}, engine_core="process") as (leader, worker, url):
        assert complete(url) == expected
        ranks = psutil.Process(worker.pid).children()
        rank = next(p for p in ranks if "resource_tracker" not in " ".join(p.cmdline()))
        rank.send_signal(signal.SIGKILL)
        seen: list[httpx.Response] = []

        def dead() -> bool:
            try:
                r = httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                return leader.poll() is not None
            seen.append(r)
            return r.status_code == 503

        wait_for(dead, 120, "the leader to notice the dead rank")
        assert seen and seen[-1].status_code == 503, "the leader exited before saying why"
        assert "rank 1" in seen[-1].json()["reason"]
        assert leader.wait(120) != 0  # LWS restarts the group
        assert worker.wait(60) != 0


def test_torchrun_ranks_and_a_killed_leader_ends_the_worker(tiny_model_dir, tmp_path) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}
    with group(tiny_model_dir, tmp_path, {**env, "RANK": "0"}, {**env, "RANK": "1"},
               engine_core="thread") as (leader, worker, url):
        assert complete(url)
        leader.send_signal(signal.SIGKILL)
        assert worker.wait(120) != 0
        assert "exited with code" in (tmp_path / "worker.log").read_text()
