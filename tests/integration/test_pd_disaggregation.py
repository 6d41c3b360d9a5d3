"""Prefill/decode disaggregation end to end (tiny random model, CPU, fp32 greedy): two real
`kvserve serve` replicas with the engine's KV connector (engine/kv_transfer/), one kv_producer
and one kv_consumer, heartbeating to a real Redis, and `kvserve router --policy pd` (in the test
process) over them.

Straight to the replicas: the prefill replica prefills a prompt with max_tokens=1 and answers where
its blocks are (vLLM's kv_transfer_params); the decode replica sent those params pulls the blocks
and computes only the prompt's last partial block, and answers exactly what one replica alone
answers. A prefill replica killed in the middle of a transfer (a third process, with the
connector's fault injection), or one whose KV layout differs (block size, dtype, model: an engine
started from those flags in the test process), leaves the decode replica to compute the prompt
itself: same answer, the failure counted and, for a layout, a refusal naming each difference.
Two replicas of tensor_parallel_size 2 move each rank's shard rank to rank.

Through the router: the replicas announce prefill / decode; long uncached prompts are prefilled
on the prefill replica and decoded with its kv_transfer_params (the decode replica's external
prefix-cache hits show the blocks it pulled); outputs equal the offline engine's greedy ones,
streamed or not; a prompt the decode replica holds, or a short one, is prefilled locally; a
prefill replica that died means a local prefill, exact still.

The module's replicas start at once, in its fixture, and serve every test but the
tensor-parallel one (first, with its own); the test that kills the prefill replica runs last."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from conftest import RedisServer, free_port, make_llm, wait_for
from server_process import health
from server_thread import ServerThread
from test_api_server import metrics

SERVICE = "pdtest"
THRESHOLD = 32
BLOCK = 16
PROMPT_LEN = 100  # 6 full blocks pulled, the last 4 tokens computed by the decode replica
MAX_TOKENS = 12
PROMPTS = [f"Request {i}: paged attention keeps the KV cache in blocks of sixteen tokens, and a "
           f"prefill replica hands the blocks of a long prompt to a decode replica, which "
           f"pulls them instead of computing them again; tenant {i} asks for a short summary."
           for i in range(3)]
SHORT = "Hi there"
AFTER_KILL = ("A tenant of its own: prefill replicas compute prompts, decode replicas generate, "
              "and when a prefill replica dies the decode replica computes the prompt itself.")


def kv_flags(role: str) -> list[str]:
    """The connector on an ephemeral port of the loopback (port 0: any free one; a
    kv_producer's kv_transfer_params name the one it got)."""
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "KVServeConnector", "kv_role": role,
        "kv_connector_extra_config": {"kv_port": 0, "kv_bind_host": "127.0.0.1",
                                      "transfer_timeout": 60}})]


def start_serve(name: str, model: Path, tmp: Path, *flags: str, redis_url: str | None = None,
                env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`kvserve serve` as a process (not waited for: the module's replicas start together);
    with `redis_url`, replica `name` of the pd service."""
    port = free_port()
    if redis_url is not None:
        flags = (*flags, "--redis-url", redis_url, "--service-name", SERVICE, "--replica-id",
                 name, "--advertise-url", f"http://127.0.0.1:{port}")
    with (tmp / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.service.cli", "serve", str(model),
             "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
             "--kv-cache-memory", "8MiB", "--host", "127.0.0.1", "--port", str(port),
             "--engine-core", "thread", "--log-level", "warning", *flags],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return proc, f"http://127.0.0.1:{port}"


def in_process_replica(model: Path, *flags: str) -> ServerThread:
    """A replica from `kvserve serve` flags in the test process (engine and HTTP server on
    threads, no Python start-up to pay); stop() it, then shut its engine down."""
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.service.serve_args import build_serve_parser, engine_config_from_args
    from kvserve.service.server.app import create_app
    from kvserve.service.server.config import ServerConfig

    args = build_serve_parser().parse_args(
        [str(model), "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
         "--kv-cache-memory", "4MiB", *flags])
    engine = LLMEngine.from_config(engine_config_from_args(args))
    return ServerThread(create_app(engine, ServerConfig(served_model_names=["tiny"]))).start()


def stop_in_process(srv: ServerThread) -> None:
    engine = srv.server.engine.engine
    srv.stop()
    engine.shutdown()


class Router:
    """`kvserve router --policy pd` inside the test process."""

    def __init__(self, model: Path, redis_url: str) -> None:
        import argparse

        import uvicorn

        from kvserve.service.router.app import create_app
        from kvserve.service.router.cli import add_arguments, config_from_args

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        self.port = free_port()
        cfg = config_from_args(parser.parse_args(
            ["--host", "127.0.0.1", "--port", str(self.port), "--redis-url", redis_url,
             "--service-name", SERVICE, "--tokenizer", str(model), "--policy", "pd",
             "--pd-threshold", str(THRESHOLD), "--expose-routing-headers",
             "--log-level", "warning"]))
        self.server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, redis_binary, tmp_path_factory) -> Iterator[dict]:
    """prefill-0 and decode-0 in the pd service, and a kv_producer outside it (`stalling`,
    for the kill) whose block server stalls halfway through a transfer; all started at once."""
    tmp = tmp_path_factory.mktemp("pd")
    stall = tmp / "stalled"
    with ExitStack() as stack:
        redis = RedisServer(redis_binary, tmp)
        redis.start()
        stack.callback(redis.stop)
        procs: dict[str, tuple[subprocess.Popen, str]] = {}

        def reap() -> None:
            for proc, _ in procs.values():
                proc.kill()
                proc.wait()
        stack.callback(reap)
        for rid, kv_role in (("prefill-0", "kv_producer"), ("decode-0", "kv_consumer")):
            procs[rid] = start_serve(rid, tiny_model_dir, tmp, *kv_flags(kv_role),
                                     redis_url=redis.url)
        procs["stalling"] = start_serve("stalling", tiny_model_dir, tmp,
                                        *kv_flags("kv_producer"),
                                        env={"KVSERVE_KV_FAULT_STALL_FILE": str(stall)})
        for name, (proc, url) in procs.items():
            wait_for(lambda: proc.poll() is not None or health(url) == 200, 240, name)
            assert proc.poll() is None, (tmp / f"{name}.log").read_text()[-3000:]
        router = Router(tiny_model_dir, redis.url)
        stack.callback(router.stop)
        wait_for(lambda: len(_health(router.url).get("replicas", [])) == 2, 120,
                 "the router to see both replicas")
        yield {"router": router, "urls": {rid: procs[rid][1] for rid in ("prefill-0", "decode-0")},
               "procs": {rid: procs[rid][0] for rid in ("prefill-0", "decode-0")},
               "prefill": procs["prefill-0"][1], "decode": procs["decode-0"][1],
               "decode_log": tmp / "decode-0.log",
               "stalling": procs["stalling"], "stall_file": stall}


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, str]:
    """Greedy fp32 completions of the offline engine: what one replica alone answers."""
    from kvserve import SamplingParams

    llm = make_llm(tiny_model_dir)
    outs = llm.generate([*PROMPTS, SHORT, AFTER_KILL],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return {o.prompt: o.outputs[0].text for o in outs}


def _health(url: str) -> dict:
    try:
        return httpx.get(url + "/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _metric(url: str, name: str, labels: str = "") -> float:
    """A counter's value on a /metrics page (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*{re.escape(labels)}[^}}]*}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def _complete(url: str, prompt: str, stream: bool = False) -> tuple[str, httpx.Headers]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"], resp.headers
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += "".join(c.get("text", "") for c in chunk.get("choices", []))
        return text, resp.headers


# ---- straight to the replicas: the KV connector ------------------------------------------------

def prompt_ids(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(PROMPT_LEN)]


def complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def tokens(body: dict) -> list[str]:
    return body["choices"][0]["logprobs"]["tokens"]


def figures(url: str) -> dict[str, float]:
    m = metrics(url)
    return {"queries": m.get("vllm:external_prefix_cache_queries_total", 0.0),
            "hits": m.get("vllm:external_prefix_cache_hits_total", 0.0),
            "computed": m.get("kvserve:prompt_tokens_computed_total", 0.0),
            "failures": m.get("kvserve:kv_transfer_failures_total", 0.0),
            "received": m.get("kvserve:kv_transfer_blocks_total{direction=received}", 0.0),
            "sent": m.get("kvserve:kv_transfer_blocks_total{direction=sent}", 0.0),
            "held": m.get("kvserve:kv_transfer_held_requests", 0.0)}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


@pytest.mark.slow  # two replicas of two ranks each
def test_tensor_parallel_replicas_move_each_rank_shard(tiny_model_dir, tmp_path):
    """Two replicas of tensor_parallel_size 2 (gloo on the CPU, a worker process each): a
    `kvserve serve` process prefills, an engine in the test process (one tensor-parallel engine
    per process) decodes, started together, their workers forked (the spawned kind's start:
    test_tensor_parallel_server.py); each rank's shard moves rank to rank, and the answer is
    one replica's. First in the module: the workers fork before its servers' threads start."""
    ids, tp = prompt_ids(4), ("--tensor-parallel-size", "2")
    with ExitStack() as stack:
        proc, prefill = start_serve("prefill-tp", tiny_model_dir, tmp_path,
                                    *kv_flags("kv_producer"), *tp,
                                    env={"KVSERVE_WORKER_MULTIPROC_METHOD": "fork"})
        stack.callback(proc.wait)
        stack.callback(proc.kill)
        decode = in_process_replica(tiny_model_dir, *kv_flags("kv_consumer"), *tp)
        stack.callback(stop_in_process, decode)
        wait_for(lambda: proc.poll() is not None or health(prefill) == 200, 240, "prefill-tp")
        assert proc.poll() is None, (tmp_path / "prefill-tp.log").read_text()[-3000:]
        params = complete(prefill, ids, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        assert params["tp_size"] == 2
        out = complete(decode.url, ids, kv_transfer_params=params)
        ref = complete(prefill, ids, cache_salt="reference")
        d = figures(decode.url)
    assert tokens(out) == tokens(ref)
    full = (PROMPT_LEN - 1) // BLOCK * BLOCK
    assert (d["hits"], d["computed"], d["failures"]) == (full, PROMPT_LEN - full, 0)


def test_decode_through_pulled_blocks_answers_as_one_replica(cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    ids = prompt_ids(1)
    wait_for(lambda: figures(prefill)["held"] == 0, 30, "no blocks held from earlier tests")
    before = {"p": figures(prefill), "d": figures(decode)}
    first = complete(prefill, ids, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == -(-PROMPT_LEN // BLOCK)
    assert params["remote_port"] > 0 and params["tp_size"] == 1
    assert figures(prefill)["held"] == 1  # kept until the decode replica has them
    out = complete(decode, ids, kv_transfer_params=params)
    # the reference: the same replica, the prompt under another cache salt (nothing cached)
    ref = complete(prefill, ids, cache_salt="reference")
    assert tokens(out) == tokens(ref)
    assert out["kv_transfer_params"] is None
    d = delta(figures(decode), before["d"])
    full = (PROMPT_LEN - 1) // BLOCK * BLOCK
    assert (d["queries"], d["hits"], d["received"]) == (PROMPT_LEN, full, full // BLOCK)
    assert d["computed"] == PROMPT_LEN - full  # the decode replica's own prefill: the tail
    # the decode replica's confirmation frees the prefill replica's blocks (at its next tick)
    wait_for(lambda: figures(prefill)["held"] == 0, 30, "the prefill replica to free them")
    assert delta(figures(prefill), before["p"])["sent"] == full // BLOCK


def test_chat_requests_carry_kv_transfer_params_both_ways(cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    body = {"model": "tiny", "temperature": 0, "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": "paged attention and blocks " * 12}]}
    first = httpx.post(prefill + "/v1/chat/completions", timeout=120, json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    before = figures(decode)
    out = httpx.post(decode + "/v1/chat/completions", timeout=120, json={
        **body, "kv_transfer_params": first["kv_transfer_params"]}).json()
    ref = httpx.post(prefill + "/v1/chat/completions", timeout=120,
                     json={**body, "cache_salt": "reference"}).json()
    assert out["choices"][0]["message"] == ref["choices"][0]["message"]
    assert delta(figures(decode), before)["hits"] >= BLOCK


def test_prefill_killed_mid_transfer_decode_computes_the_prompt(cluster):
    decode, stall = cluster["decode"], cluster["stall_file"]
    proc, prefill = cluster["stalling"]
    ids = prompt_ids(2)
    params = complete(prefill, ids, max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    ref = complete(prefill, ids, cache_salt="reference")
    before = figures(decode)
    result: dict = {}
    pulling = threading.Thread(target=lambda: result.update(
        complete(decode, ids, kv_transfer_params=params)))
    pulling.start()
    wait_for(stall.exists, 60, "the transfer to reach the middle of the layers")
    os.kill(proc.pid, signal.SIGKILL)  # half the layers sent, the rest never will be
    pulling.join(timeout=120)
    assert tokens(result) == tokens(ref)
    d = delta(figures(decode), before)
    assert (d["failures"], d["hits"], d["computed"]) == (1, 0, PROMPT_LEN)


def test_mismatched_layout_is_refused_at_the_handshake(cluster, tiny_model_dir, tmp_path):
    """A prefill replica of another model name, block size and KV dtype (its engine built from
    those serve flags, in the test process): the decode replica refuses its blocks at the
    handshake, says why, and computes the prompt itself."""
    other = tmp_path / "tiny-other"
    shutil.copytree(tiny_model_dir, other)
    decode, ids = cluster["decode"], prompt_ids(3)
    srv = in_process_replica(other, *kv_flags("kv_producer"), "--block-size", "32",
                             "--kv-cache-dtype", "bfloat16")
    try:
        params = complete(srv.url, ids, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        assert params["remote_port"] > 0
        before = figures(decode)
        out = complete(decode, ids, kv_transfer_params=params)
        assert figures(srv.url)["sent"] == 0
    finally:
        stop_in_process(srv)
    d = delta(figures(decode), before)
    assert (d["failures"], d["hits"], d["computed"]) == (1, 0, PROMPT_LEN)
    ref = complete(decode, ids, cache_salt="reference")
    assert tokens(out) == tokens(ref)
    log = cluster["decode_log"].read_text()
    assert "refused at handshake" in log
    for why in ("model 'tiny-other' there, 'tiny-llama' here", "block_size 32 there, 16 here",
                "kv_dtype 'torch.bfloat16' there, 'torch.float32' here"):
        assert why in log, log[-3000:]


# ---- through the router: --policy pd -----------------------------------------------------------

def test_roles_are_announced_in_the_heartbeats(cluster):
    roles = {r["id"]: r["role"] for r in _health(cluster["router"].url)["replicas"]}
    assert roles == {"prefill-0": "prefill", "decode-0": "decode"}


@pytest.mark.parametrize("stream", [False, True])
def test_long_prompt_is_prefilled_remotely_and_decoded_exactly(cluster, reference, stream):
    router = cluster["router"].url
    prompt = PROMPTS[int(stream)]
    before = _metric(router, "kvserve:router_pd_decisions_total", 'decision="remote"')
    decode_url = cluster["decode"]
    hits_before = _metric(decode_url, "vllm:external_prefix_cache_hits_total")
    prompts_before = _metric(cluster["prefill"], "vllm:prompt_tokens_total")
    text, headers = _complete(router, prompt, stream)
    assert text == reference[prompt]
    decode, prefill = headers["x-kvserve-replica"], headers.get("x-kvserve-prefill-replica")
    assert (headers["x-kvserve-pd-decision"], decode, prefill) == \
        ("remote", "decode-0", "prefill-0")
    assert _metric(router, "kvserve:router_pd_decisions_total",
                   'decision="remote"') == before + 1
    # the prefill replica ran the prompt, and the blocks its prefill made were pulled, not
    # computed again
    assert _metric(cluster["prefill"], "vllm:prompt_tokens_total") > prompts_before
    hits = _metric(decode_url, "vllm:external_prefix_cache_hits_total") - hits_before
    assert hits >= 16


def test_a_prompt_the_decode_replica_holds_is_prefilled_locally(cluster, reference):
    router = cluster["router"].url
    prompt = PROMPTS[2]
    first, headers = _complete(router, prompt)
    decode = headers["x-kvserve-replica"]
    # once its blocks are in the index, the same prompt is (almost) all cached on a replica
    wait_for(lambda: _complete(router, prompt)[1]["x-kvserve-pd-decision"] == "local_short",
             30, "the decode replica's blocks to reach the index")
    text, headers = _complete(router, prompt)
    assert (text, first) == (reference[prompt], reference[prompt])
    assert headers["x-kvserve-pd-decision"] == "local_short"
    assert "x-kvserve-prefill-replica" not in headers
    assert int(headers["x-kvserve-predicted-matched-tokens"]) > 0
    assert headers["x-kvserve-replica"] in cluster["urls"] and decode in cluster["urls"]


def test_short_prompt_is_prefilled_locally(cluster, reference):
    text, headers = _complete(cluster["router"].url, SHORT)
    assert text == reference[SHORT]
    assert headers["x-kvserve-pd-decision"] == "local_short"
    assert _metric(cluster["router"].url, "kvserve:router_pd_decisions_total",
                   'decision="local_short"') >= 1


def test_a_dead_prefill_replica_means_local_prefill_and_exact_output(cluster, reference):
    """Last in the module: it kills the prefill replica."""
    router = cluster["router"].url
    procs = cluster["procs"]
    procs["prefill-0"].kill()
    procs["prefill-0"].wait()
    before = _metric(router, "kvserve:router_pd_decisions_total", 'decision="remote"')
    text, headers = _complete(router, AFTER_KILL)
    # right after the kill the heartbeat still names it (fallback); once it has expired there
    # is no prefill replica left (local_no_prefiller): local prefill either way
    assert headers["x-kvserve-pd-decision"] in ("fallback", "local_no_prefiller")
    assert headers["x-kvserve-replica"] == "decode-0"
    assert _metric(router, "kvserve:router_pd_decisions_total", 'decision="remote"') == before
    assert text == reference[AFTER_KILL]
