"""The EPP's InferencePool watcher against KMock's Kubernetes emulator, through the real
kubernetes client: the pool's Ready pods become endpoints, and a pod turning Ready is seen."""

from __future__ import annotations

import asyncio
from typing import Any

import kmock as kmock_lib
from kubernetes import client

from kvserve.service.epp.pool import GROUP, PLURAL, VERSION, PoolWatcher

NS = "llm"
VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]
POOL = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferencePool",
        "metadata": {"name": "chat", "namespace": NS},
        "spec": {"selector": {"matchLabels": {"kvserve.io/service": "chat"}},
                 "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "chat-epp", "port": {"number": 9002}}}}


def pod(name: str, ip: str, ready: bool, service: str = "chat") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"kvserve.io/service": service}},
            "spec": {"containers": [{"name": "kvserve", "image": "kvserve"}]},
            "status": {"podIP": ip, "phase": "Running", "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


def api(kmock: Any) -> tuple[client.CoreV1Api, client.CustomObjectsApi]:
    cfg = client.Configuration(host=str(kmock.url).rstrip("/"))
    api_client = client.ApiClient(cfg)
    return client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)


async def test_pool_watcher_follows_the_pool_and_its_ready_pods(kmock: Any) -> None:
    info = kmock_lib.ResourceInfo
    kmock.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = info(kind="InferencePool", namespaced=True,
                                                          verbs=VERBS)
    kmock.resources["v1/pods"] = info(kind="Pod", namespaced=True, verbs=VERBS)
    core, custom = api(kmock)
    await asyncio.to_thread(custom.create_namespaced_custom_object, GROUP, VERSION, NS, PLURAL,
                            POOL)
    for body in (pod("a", "10.1.0.1", True), pod("b", "10.1.0.2", False),
                 pod("c", "10.1.0.3", True, service="other")):
        await asyncio.to_thread(core.create_namespaced_pod, NS, body)
    seen: list[tuple[str, ...]] = []
    watcher = PoolWatcher("chat", NS, seen.append, interval=0.05, clients=lambda: api(kmock))
    watcher.start()
    try:
        await wait(lambda: seen == [("10.1.0.1:8000",)] and watcher.synced)
        await asyncio.to_thread(core.patch_namespaced_pod, "b", NS,
                                {"status": pod("b", "10.1.0.2", True)["status"]})
        await wait(lambda: seen[-1] == ("10.1.0.1:8000", "10.1.0.2:8000"))
    finally:
        await watcher.close()
    assert len(seen) == 2  # called on changes only


async def wait(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")
