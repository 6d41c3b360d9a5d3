"""--policy pd: where the prompt is prefilled (service/router/pd.py), the prefill request and the
decode request's kv_transfer_params, and the role a replica announces in its heartbeat."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvserve.service.prefix_index.replica_info import (INFO_FIELDS, MalformedHeartbeatError,
                                                       ReplicaInfo, role_of_kv_role)
from kvserve.service.router import pd
from kvserve.service.routing_policy import Candidate, PolicyConfig
from kvserve.service.server.publishing import replica_role

POLICY = PolicyConfig(min_match_tokens=32)
PD = pd.PDConfig(threshold=64, max_prefill_queue=2)
BS = 16


def cand(rid: str, role: str = "both", load: int = 0, matched: int = 0) -> Candidate:
    return Candidate(rid, f"http://{rid}", load, 0.0, matched, 0, role)


def plan(decode: Candidate, cands: list[Candidate], prompt: int | None) -> pd.PDPlan:
    return pd.plan(decode, cands, prompt, BS, PD, POLICY, num_blocks=(prompt or 0) // BS)


def test_long_uncached_prompt_is_prefilled_on_a_prefill_replica():
    d, p = cand("d", "decode"), cand("p", "prefill")
    got = plan(d, [d, p], prompt=400)
    assert got.decision == pd.REMOTE and got.remote
    assert [c.replica_id for c in got.prefill] == ["p"]
    assert got.uncached_tokens == 400


def test_the_decode_replicas_cached_prefix_is_not_counted():
    # 400 tokens, 22 blocks (352 tokens) cached on the decode replica: 48 left <= 64.
    d, p = cand("d", "decode", matched=22), cand("p", "prefill")
    got = plan(d, [d, p], prompt=400)
    assert (got.decision, got.uncached_tokens) == (pd.LOCAL_SHORT, 48)
    # one block less cached: 64 left, still within the threshold; two less: 80 > 64
    assert plan(cand("d", "decode", matched=21), [p], 400).decision == pd.LOCAL_SHORT
    assert plan(cand("d", "decode", matched=20), [p], 400).decision == pd.REMOTE


def test_busy_prefill_pool_means_local_prefill():
    d = cand("d", "decode")
    busy = [cand("p1", "prefill", load=3), cand("p2", "prefill", load=5)]
    assert plan(d, [d, *busy], 400).decision == pd.LOCAL_BUSY
    # one short queue is enough, and only it is tried
    got = plan(d, [d, *busy, cand("p3", "prefill", load=2)], 400)
    assert got.decision == pd.REMOTE
    assert [c.replica_id for c in got.prefill] == ["p3"]


def test_prefill_ranking_prefers_the_replica_holding_the_prompt_then_load():
    d = cand("d", "decode")
    pool = [cand("p1", "prefill", load=1), cand("p2", "prefill", load=1, matched=10),
            cand("p3", "prefill", load=0)]
    got = plan(d, [d, *pool], 400)
    assert got.prefill[0].replica_id == "p2"
    assert {c.replica_id for c in got.prefill} == {"p1", "p2", "p3"}


def test_no_prefill_replica_besides_the_decode_one():
    d, d2 = cand("d", "decode"), cand("d2", "decode")
    assert plan(d, [d, d2], 400).decision == pd.LOCAL_NO_PREFILLER
    b = cand("b", "both")
    assert plan(b, [b, d], 400).decision == pd.LOCAL_NO_PREFILLER  # never itself


def test_both_role_replicas_prefill_for_each_other():
    a, b = cand("a"), cand("b")
    got = plan(a, [a, b], 400)
    assert got.decision == pd.REMOTE and [c.replica_id for c in got.prefill] == ["b"]


def test_skipped_and_producer_only_replicas_change_the_plan():
    d, p, q = cand("d", "decode"), cand("p", "prefill"), cand("q", "both")
    got = pd.plan(d, [d, p, q], 400, BS, PD, POLICY, skip={"p"})
    assert [c.replica_id for c in got.prefill] == ["q"]
    assert pd.plan(d, [d, p], 400, BS, PD, POLICY, skip={"p"}).decision == \
        pd.LOCAL_NO_PREFILLER
    # every decode-capable replica gone: a producer-only one decodes, and prefills itself
    assert plan(p, [p, cand("p2", "prefill")], 400).decision == pd.LOCAL_NO_PREFILLER


def test_unknown_prompt_or_no_replica_is_local():
    d = cand("d", "decode")
    assert plan(d, [d, cand("p", "prefill")], None).decision == pd.LOCAL_UNKNOWN
    assert pd.plan(None, [], 400, BS, PD, POLICY).decision == pd.LOCAL_UNKNOWN


def test_decode_capable_leaves_prefill_replicas_out_unless_there_is_nothing_else():
    cs = [cand("p", "prefill"), cand("d", "decode"), cand("b", "both")]
    assert [c.replica_id for c in pd.decode_capable(cs)] == ["d", "b"]
    only = [cand("p", "prefill"), cand("q", "prefill")]
    assert pd.decode_capable(only) == only


def test_pd_config_refuses_negative_values():
    with pytest.raises(ValueError, match="pd-threshold"):
        pd.PDConfig(threshold=-1)
    with pytest.raises(ValueError):
        pd.PDConfig(prefill_timeout=0)


def test_prefill_body_asks_for_one_token_and_a_remote_decode():
    body = {"model": "m", "messages": [], "stream": True, "max_tokens": 50,
            "max_completion_tokens": 50, "stream_options": {"include_usage": True},
            "min_tokens": 5, "temperature": 0}
    out = pd.prefill_body(body)
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert out["stream"] is False and "stream_options" not in out and "min_tokens" not in out
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert out["kv_transfer_params"]["do_remote_prefill"] is False
    assert body["max_tokens"] == 50 and body["stream"] is True  # the original is untouched
    assert "max_completion_tokens" not in pd.prefill_body({"prompt": "x"})


def test_transfer_params_from_a_prefill_answer():
    good = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
            "remote_engine_id": "e1", "remote_host": "10.0.0.1", "remote_port": 5600}
    assert pd.transfer_params({"choices": [], "kv_transfer_params": good}) == good
    assert pd.transfer_params({"kv_transfer_params": None}) is None
    assert pd.transfer_params({}) is None
    assert pd.transfer_params(["not", "a", "dict"]) is None
    assert pd.transfer_params({"kv_transfer_params": {**good, "do_remote_prefill": False}}) \
        is None
    assert pd.transfer_params({"kv_transfer_params": {**good, "remote_block_ids": None}}) \
        is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_a_prefill_replica_that_refuses_means_local_prefill():
    counts: dict[str, int] = {}

    def acquire(rid: str) -> None:
        counts[rid] = counts.get(rid, 0) + 1

    def release(rid: str) -> None:
        counts[rid] -= 1

    down: list[str] = []

    async def run() -> object:
        dead = [Candidate(f"p{i}", f"http://127.0.0.1:{_closed_port()}", role="prefill")
                for i in range(3)]
        async with httpx.AsyncClient() as http:
            return await pd.remote_prefill(http, "/v1/completions", {"prompt": "x"}, {}, dead,
                                           PD, acquire, release, down.append)

    assert asyncio.run(run()) is None
    assert counts == {"p0": 0, "p1": 0}  # two tried, each released
    assert down == ["p0", "p1"]  # out of routing for --down-cooldown, as the proxy does


class _NoParams(BaseHTTPRequestHandler):
    """A replica without a KV connector: a prefill answered, no kv_transfer_params."""

    def do_POST(self) -> None:  # noqa: N802 -- http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        body = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": None}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_replica_answering_without_params_is_reported_as_no_producer():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoParams)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    reported: list[str] = []

    async def run() -> object:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        async with httpx.AsyncClient() as http:
            return await pd.remote_prefill(http, "/v1/completions", {"prompt": "x"}, {},
                                           [Candidate("b", url, role="both")], PD,
                                           lambda _: None, lambda _: None, None,
                                           reported.append)
    try:
        assert asyncio.run(run()) is None
    finally:
        server.shutdown()
    assert reported == ["b"]


def test_heartbeat_role_field():
    base = {"url": "http://r:8000", "model": "m", "block_size": "16", "heartbeat_at": "1.0"}

    def info(**extra: str) -> ReplicaInfo:
        fields = {**base, **extra}
        return ReplicaInfo.from_fields("r", [fields.get(f) for f in INFO_FIELDS])

    assert info().role == "both"  # replicas from before the field
    assert info(role="prefill").role == "prefill"
    assert info(role="decode").role == "decode"
    with pytest.raises(MalformedHeartbeatError, match="role"):
        info(role="leader")


def test_role_from_kv_transfer_config():
    assert role_of_kv_role("kv_producer") == "prefill"
    assert role_of_kv_role("kv_consumer") == "decode"
    assert role_of_kv_role("kv_both") == role_of_kv_role(None) == "both"
    cfg = {"kv_connector": "KVServeConnector", "kv_role": "kv_producer"}
    assert replica_role(json.dumps(cfg)) == "prefill"
    assert replica_role(cfg) == "prefill"
    assert replica_role(type("Cfg", (), {"kv_role": "kv_consumer"})()) == "decode"
    assert replica_role(None) == replica_role("") == "both"
