"""Prefill/decode disaggregation end to end: two real `kvserve serve` replicas (tiny model, CPU,
fp32), a real Redis and `kvserve router --policy pd` (in the test process). Long uncached
prompts are prefilled on the other replica and decoded with its kv_transfer_params; outputs equal
the offline engine's greedy ones, streamed or not; a prompt the decode replica holds, or a short
one, is prefilled locally; a prefill replica that died means a local prefill, exact still. With
the engine's KV connector (engine/kv_transfer) the replicas run
as kv_producer / kv_consumer, announce prefill / decode, and the decode replica's external
prefix-cache hits show the blocks it pulled."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import RedisServer, free_port, make_llm, wait_for

SERVICE = "pdtest"
THRESHOLD = 32
PROMPTS = [f"Request {i}: paged attention keeps the KV cache in blocks of sixteen tokens, and a "
           f"prefill replica hands the blocks of a long prompt to a decode replica, which "
           f"pulls them instead of computing them again; tenant {i} asks for a short summary."
           for i in range(3)]
SHORT = "Hi there"
AFTER_KILL = ("A tenant of its own: prefill replicas compute prompts, decode replicas generate, "
              "and when a prefill replica dies the decode replica computes the prompt itself.")
MAX_TOKENS = 12


def has_connector() -> bool:
    """The engine's KV connector and its --kv-transfer-config flag have landed."""
    from kvserve.service.serve_args import build_serve_parser

    return "--kv-transfer-config" in build_serve_parser().format_help()


def serve(rid: str, model: Path, redis_url: str, tmp: Path, kv_role: str | None
          ) -> tuple[subprocess.Popen, str]:
    port = free_port()
    flags = []
    if kv_role is not None:
        flags = ["--kv-transfer-config", json.dumps({"kv_connector": "KVServeConnector",
                                                     "kv_role": kv_role})]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.service.cli", "serve", str(model),
         "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
         "--kv-cache-memory", "8MiB", "--host", "127.0.0.1", "--port", str(port),
         "--redis-url", redis_url, "--service-name", SERVICE, "--replica-id", rid,
         "--advertise-url", f"http://127.0.0.1:{port}", "--engine-core", "thread",
         "--log-level", "warning", *flags],
        stdout=(tmp / f"{rid}.log").open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}"


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
    tmp = tmp_path_factory.mktemp("pd")
    redis = RedisServer(redis_binary, tmp)
    redis.start()
    connector = has_connector()
    procs = {}
    try:
        for rid, kv_role in (("prefill-0", "kv_producer"), ("decode-0", "kv_consumer")):
            procs[rid] = serve(rid, tiny_model_dir, redis.url, tmp,
                               kv_role if connector else None)
        for rid, (proc, url) in procs.items():
            wait_for(lambda: proc.poll() is not None or _status(url) == 200, 240, rid)
            assert proc.poll() is None, (tmp / f"{rid}.log").read_text()[-3000:]
        router = Router(tiny_model_dir, redis.url)
        wait_for(lambda: len(_health(router.url).get("replicas", [])) == 2, 120,
                 "the router to see both replicas")
        yield {"router": router, "urls": {rid: url for rid, (_, url) in procs.items()},
               "procs": {rid: proc for rid, (proc, _) in procs.items()},
               "connector": connector}
        router.stop()
    finally:
        for proc, _ in procs.values():
            proc.kill()
            proc.wait()
        redis.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, str]:
    """Greedy fp32 completions of the offline engine: what one replica alone answers."""
    from kvserve import SamplingParams

    llm = make_llm(tiny_model_dir)
    outs = llm.generate([*PROMPTS, SHORT, AFTER_KILL],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return {o.prompt: o.outputs[0].text for o in outs}


def _status(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


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


def test_roles_are_announced_in_the_heartbeats(cluster):
    roles = {r["id"]: r["role"] for r in _health(cluster["router"].url)["replicas"]}
    if cluster["connector"]:
        assert roles == {"prefill-0": "prefill", "decode-0": "decode"}
    else:
        assert roles == {"prefill-0": "both", "decode-0": "both"}


@pytest.mark.parametrize("stream", [False, True])
def test_long_prompt_is_prefilled_remotely_and_decoded_exactly(cluster, reference, stream):
    router = cluster["router"].url
    prompt = PROMPTS[int(stream)]
    before = {d: _metric(router, "kvserve:router_pd_decisions_total", f'decision="{d}"')
              for d in ("remote", "fallback")}
    decode_url = cluster["urls"]["decode-0"]
    hits_before = _metric(decode_url, "vllm:external_prefix_cache_hits_total")
    text, headers = _complete(router, prompt, stream)
    assert text == reference[prompt]
    decode, prefill = headers["x-kvserve-replica"], headers.get("x-kvserve-prefill-replica")
    decision = headers["x-kvserve-pd-decision"]
    after = _metric(router, "kvserve:router_pd_decisions_total", f'decision="{decision}"')
    assert after == before.get(decision, -1) + 1
    if cluster["connector"]:
        assert (decision, decode, prefill) == ("remote", "decode-0", "prefill-0")
        # the blocks this prompt's prefill made were pulled, not computed again
        hits = _metric(decode_url, "vllm:external_prefix_cache_hits_total") - hits_before
        assert hits >= 16
    else:
        # The replicas run no connector: the prefill replica answered without
        # kv_transfer_params (then it is not asked again for a while), so the decode replica
        # prefilled locally; nothing was lost.
        assert decision in ("fallback", "local_no_prefiller") and prefill is None
    if decision != "local_no_prefiller":  # the other replica ran the prompt
        other = next(u for rid, u in cluster["urls"].items() if rid != decode)
        assert _metric(other, "vllm:prompt_tokens_total") > 0


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
    prefill = "prefill-0" if cluster["connector"] else None
    if prefill is None:  # two `both` replicas: kill whichever is not the decode replica
        _, headers = _complete(router, SHORT)
        prefill = next(rid for rid in procs if rid != headers["x-kvserve-replica"])
    procs[prefill].kill()
    procs[prefill].wait()
    before = _metric(router, "kvserve:router_pd_decisions_total", 'decision="remote"')
    text, headers = _complete(router, AFTER_KILL)
    # right after the kill the heartbeat still names it (fallback); once it has expired there
    # is no prefill replica left (local_no_prefiller): local prefill either way
    assert headers["x-kvserve-pd-decision"] in ("fallback", "local_no_prefiller")
    assert headers["x-kvserve-replica"] != prefill
    assert _metric(router, "kvserve:router_pd_decisions_total", 'decision="remote"') == before
    assert text == reference[AFTER_KILL]
