"""The real kopf operator against KMock sizes an uncatalogued hub model from its own files, served
by a real HTTP server that answers like the hub: status.sizing from the headers, the token from
a Secret, and a clear condition (never a guessed size, never a hot loop) when it cannot read."""

from __future__ import annotations

import base64
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from hub_server import HubServer
from test_operator_kmock import (
    DEPLOYMENTS, NS, PLURAL_KEY, create, engine_container, running_operator, service_cr,
    stored, wait_for,
)
from tiny_families import build_family

from kvserve.engine.sizing.weights_size import local_checkpoint

TOKEN = "hf_kmock_token"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return build_family("qwen3", tmp_path_factory.mktemp("hub") / "qwen3")[0]


@pytest.fixture(scope="module")
def hub(qwen3):
    server = HubServer()
    server.add_folder("acme/tiny-qwen3", qwen3)
    server.add_folder("acme/gated-qwen3", qwen3, token=TOKEN)
    server.start()
    yield server
    server.stop()


def hub_service(name: str, repo: str, endpoint: str, **model: Any) -> dict:
    return service_cr(name, model={"uri": f"hf://{repo}", **model}, gpu={"type": "L4"},
                      engine={"maxModelLen": 512}, env=[{"name": "HF_ENDPOINT",
                                                         "value": endpoint}])


def condition(kmock: Any, name: str, kind: str) -> dict | None:
    conds = (stored(kmock, PLURAL_KEY, name) or {}).get("status", {}).get("conditions", [])
    return next((c for c in conds if c["type"] == kind), None)


async def test_uncatalogued_gated_model_is_sized_from_its_headers(kmock: Any, hub, qwen3) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": "hub-token", "namespace": NS},
              "data": {"token": base64.b64encode(TOKEN.encode()).decode()}}
    async with running_operator(kmock):
        async with kmock.post(f"/api/v1/namespaces/{NS}/secrets", json=secret) as resp:
            assert resp.status < 300
        await create(kmock, hub_service("gated", "acme/gated-qwen3", hub.url,
                                        tokenSecretRef={"name": "hub-token"}))
        sizing = await wait_for(lambda: (stored(kmock, PLURAL_KEY, "gated") or {}).get(
            "status", {}).get("sizing"), "status.sizing")
    assert sizing["weightBytes"] == local_checkpoint(qwen3).weights.resident_bytes(2)  # bf16
    assert sizing["modelSource"].startswith("files: ")
    env = engine_container(kmock, "gated")["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub-token",
                                                                "key": "token"}}} in env
    assert any(r.authorization == f"Bearer {TOKEN}" for r in hub.requests)


async def test_missing_model_gets_a_condition_and_no_workload(kmock: Any, hub, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kopf.objects")

    def resyncs() -> int:  # kopf logs each finished timer tick on the object's logger
        return sum("'resync'" in r.getMessage() for r in caplog.records)

    async with running_operator(kmock, status_interval=0.2):
        await create(kmock, hub_service("nope", "acme/nope", hub.url))
        sized = await wait_for(lambda: condition(kmock, "nope", "Sized"), "the Sized condition")
        seen = sum("acme/nope" in r.path for r in hub.requests)
        ticks = resyncs()
        # Several resync ticks seen to end (not a sleep): a cached failure, no re-read.
        await wait_for(lambda: resyncs() >= ticks + 3, "three resync ticks")
        again = sum("acme/nope" in r.path for r in hub.requests)
    assert (sized["status"], sized["reason"]) == ("False", "ModelNotFound")
    assert "acme/nope" in sized["message"]
    assert "sizing" not in stored(kmock, PLURAL_KEY, "nope").get("status", {})
    assert stored(kmock, DEPLOYMENTS, "nope-engine") is None
    assert again == seen


async def test_unreachable_hub_is_reported_and_retried_later(kmock: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with running_operator(kmock):
        await create(kmock, hub_service("far", "acme/tiny-qwen3", url))
        ready = await wait_for(lambda: condition(kmock, "far", "Ready"), "the Ready condition")
    assert (ready["status"], ready["reason"]) == ("False", "ModelUnreachable")
    assert url in ready["message"]
    assert stored(kmock, DEPLOYMENTS, "far-engine") is None
