"""The KV connector between two real `kvserve serve` processes (tiny model, CPU, fp32 greedy):
a kv_producer replica prefills a prompt with max_tokens=1 and answers where its blocks are
(vLLM's kv_transfer_params); a kv_consumer replica sent those params pulls the blocks over TCP
and computes only the prompt's last partial block, and answers exactly what one replica alone
answers. A prefill replica killed in the middle of a transfer, or one whose KV layout differs
(block size, dtype, model), leaves the decode replica to compute the prompt itself: same answer,
the failure counted and, for a layout, a refusal naming each difference. (The router driving
such a pair: test_pd_disaggregation.py.)"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from conftest import free_port, wait_for
from server_process import api_server_process
from test_api_server import metrics

BLOCK = 16
PROMPT_LEN = 100  # 6 full blocks pulled, the last 4 tokens computed by the decode replica
MAX_TOKENS = 16


def kv_flags(role: str, port: int = 0) -> list[str]:
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "KVServeConnector", "kv_role": role,
        "kv_connector_extra_config": {"kv_port": port, "transfer_timeout": 60}})]


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


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory) -> Iterator[dict]:
    """A prefill and a decode replica (engines in a thread: the process split's path for
    kv_transfer_params is tested in tests/unit/engine/kv_transfer/)."""
    tmp = tmp_path_factory.mktemp("kvt")
    with ExitStack() as stack:
        _, prefill = stack.enter_context(api_server_process(
            tiny_model_dir, tmp / "prefill.log", *kv_flags("kv_producer", free_port())))
        _, decode = stack.enter_context(api_server_process(
            tiny_model_dir, tmp / "decode.log", *kv_flags("kv_consumer")))
        yield {"prefill": prefill, "decode": decode, "decode_log": tmp / "decode.log"}


def test_decode_through_pulled_blocks_answers_as_one_replica(pair):
    prefill, decode = pair["prefill"], pair["decode"]
    ids = prompt_ids(1)
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


def test_chat_requests_carry_kv_transfer_params_both_ways(pair):
    prefill, decode = pair["prefill"], pair["decode"]
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


def test_prefill_killed_mid_transfer_decode_computes_the_prompt(pair, tiny_model_dir,
                                                                tmp_path, monkeypatch):
    decode, stall = pair["decode"], tmp_path / "stalled"
    monkeypatch.setenv("KVSERVE_KV_FAULT_STALL_FILE", str(stall))
    ids = prompt_ids(2)
    with api_server_process(tiny_model_dir, tmp_path / "prefill.log",
                            *kv_flags("kv_producer", free_port())) as (proc, prefill):
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


def test_mismatched_layout_is_refused_at_the_handshake(pair, tiny_model_dir, tmp_path):
    """A prefill replica of another model name, block size and KV dtype: the decode replica
    refuses its blocks at the handshake, says why, and computes the prompt itself."""
    other = tmp_path / "tiny-other"
    shutil.copytree(tiny_model_dir, other)
    decode, ids = pair["decode"], prompt_ids(3)
    with api_server_process(other, tmp_path / "prefill.log", *kv_flags("kv_producer"),
                            "--block-size", "32", "--kv-cache-dtype", "bfloat16"
                            ) as (_, prefill):
        params = complete(prefill, ids, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        before = figures(decode)
        out = complete(decode, ids, kv_transfer_params=params)
        assert figures(prefill)["sent"] == 0
    d = delta(figures(decode), before)
    assert (d["failures"], d["hits"], d["computed"]) == (1, 0, PROMPT_LEN)
    ref = complete(decode, ids, cache_salt="reference")
    assert tokens(out) == tokens(ref)
    log = pair["decode_log"].read_text()
    assert "refused at handshake" in log
    for why in ("model 'tiny-other' there, 'tiny-llama' here", "block_size 32 there, 16 here",
                "kv_dtype 'torch.bfloat16' there, 'torch.float32' here"):
        assert why in log, log[-3000:]




@pytest.mark.slow  # two replicas of two ranks each: four processes to start
def test_tensor_parallel_replicas_move_each_rank_shard(tiny_model_dir, tmp_path):
    """Two replicas of tensor_parallel_size 2 (gloo on the CPU, a worker process each): each
    rank's shard moves rank to rank, and the answer is one replica's."""
    ids, tp = prompt_ids(4), ("--tensor-parallel-size", "2")
    with api_server_process(tiny_model_dir, tmp_path / "prefill.log",
                            *kv_flags("kv_producer", free_port()), *tp) as (_, prefill), \
            api_server_process(tiny_model_dir, tmp_path / "decode.log",
                               *kv_flags("kv_consumer"), *tp) as (_, decode):
        params = complete(prefill, ids, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        assert params["tp_size"] == 2
        out = complete(decode, ids, kv_transfer_params=params)
        ref = complete(prefill, ids, cache_salt="reference")
        d = figures(decode)
    assert tokens(out) == tokens(ref)
    full = (PROMPT_LEN - 1) // BLOCK * BLOCK
    assert (d["hits"], d["computed"], d["failures"]) == (full, PROMPT_LEN - full, 0)
