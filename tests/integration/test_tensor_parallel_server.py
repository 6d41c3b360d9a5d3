"""The OpenAI server over a 2-rank tensor-parallel engine: the openai client gets the tokens one
rank gives; a killed worker turns /health to 503 and requests into errors; SIGTERM of a server
process leaves no worker behind."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import psutil
from conftest import wait_for
from server_process import api_server_process
from server_thread import ServerThread

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig

PROMPT = "Paged attention stores the KV cache in"


def complete(url: str) -> str:
    client = openai.Client(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    return out.choices[0].text


def serve(model_dir, tp: int) -> ServerThread:
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), max_model_len=256, kv_cache_memory=4 << 20, dtype="float32",
        tensor_parallel_size=tp))
    return ServerThread(create_app(engine, ServerConfig(served_model_names=["tiny"]))).start()


def test_two_ranks_serve_the_same_text_and_a_dead_worker_is_a_503(tiny_model_dir) -> None:
    one = serve(tiny_model_dir, 1)
    try:
        expected = complete(one.url)
    finally:
        one.stop()
    srv = serve(tiny_model_dir, 2)
    engine = srv.server.engine.engine
    try:
        assert complete(srv.url) == expected
        assert httpx.get(srv.url + "/health").status_code == 200
        os.kill(engine.runner.workers.procs[0].pid, signal.SIGKILL)
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, 30, "/health 503")
        try:
            complete(srv.url)
            raise AssertionError("a request on a dead engine succeeded")
        except openai.APIStatusError as exc:
            assert exc.status_code >= 500
    finally:
        srv.stop()
        engine.shutdown()


def test_sigterm_leaves_no_worker_process(tiny_model_dir, tmp_path) -> None:
    with api_server_process(tiny_model_dir, tmp_path / "server.log", "--max-model-len", "256",
                            "--tensor-parallel-size", "2", timeout=240) as (proc, url):
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers, "no tensor-parallel worker process found"
        assert complete(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"left behind: {alive}"
