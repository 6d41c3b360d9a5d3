"""reconcile.apply_objects / create_missing / prune against KMock's API emulator, without kopf
(the mutation run found them covered only through the operator, docs/mutation.md)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kmock as kmock_lib

from kvserve.operator.children import build_children
from kvserve.operator.kube import PLURALS, KubeClient
from kvserve.operator.reconcile import apply_objects, create_missing, prune

NS = "ml"
VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]


def cr(name: str, uid: str, **spec: Any) -> dict:
    return {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
            "metadata": {"name": name, "namespace": NS, "uid": uid},
            "spec": {"model": {"name": "llama-2-7b"}, "gpu": {"type": "A100-80GB"},
                     "engine": {"maxModelLen": 4096}, **spec}}


def client(kmock: Any) -> KubeClient:
    for (api_version, kind), plural in {**PLURALS, ("v1", "Secret"): "secrets"}.items():
        kmock.resources[f"{api_version}/{plural}"] = kmock_lib.ResourceInfo(
            kind=kind, namespaced=True, verbs=VERBS)
    return KubeClient.for_url(str(kmock.url), timeout=2.0, retries=False)


def keys(objs: list[dict]) -> list[str]:
    return [f"{o['kind']}/{o['metadata']['name']}" for o in objs]


async def test_apply_sends_what_changed_and_only_that(kmock: Any) -> None:
    kube = client(kmock)
    objs = build_children(cr("a", "uid-a")).objects
    first = await asyncio.to_thread(apply_objects, kube, objs)
    assert first.applied == keys(objs) and first.changed
    assert set(first.live) == set(keys(objs))
    again = await asyncio.to_thread(apply_objects, kube, objs)
    assert (again.applied, again.unchanged, again.changed) == ([], keys(objs), False)
    assert set(again.live) == set(keys(objs))
    scaled = build_children(cr("a", "uid-a", replicas=3)).objects
    third = await asyncio.to_thread(apply_objects, kube, scaled)
    assert third.applied == ["Deployment/a-engine"] and third.changed


async def test_a_foreign_object_is_skipped_and_the_rest_applied(kmock: Any) -> None:
    kube = client(kmock)
    theirs = copy.deepcopy(build_children(cr("b", "uid-other")).objects)
    config = next(o for o in theirs if o["kind"] == "ConfigMap")
    await asyncio.to_thread(kube.apply, config)  # the same name, another owner
    ours = build_children(cr("b", "uid-b")).objects
    result = await asyncio.to_thread(apply_objects, kube, ours)
    assert result.foreign == ["ConfigMap/b-config"]
    assert result.applied == [k for k in keys(ours) if k != "ConfigMap/b-config"]
    stored = await asyncio.to_thread(kube.get, "v1", "ConfigMap", NS, "b-config")
    assert stored["metadata"]["ownerReferences"][0]["uid"] == "uid-other"


async def test_create_missing_creates_once(kmock: Any) -> None:
    kube = client(kmock)
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": "s", "namespace": NS}, "stringData": {"token": "t"}}
    first = await asyncio.to_thread(apply_objects, kube, [])
    await asyncio.to_thread(create_missing, kube, [secret], first)
    second = await asyncio.to_thread(apply_objects, kube, [])
    await asyncio.to_thread(create_missing, kube, [secret], second)
    assert (first.applied, second.unchanged) == (["Secret/s"], ["Secret/s"])


async def test_prune_deletes_only_our_leftovers(kmock: Any) -> None:
    kube = client(kmock)
    full = build_children(cr("c", "uid-c", model={
        "name": "llama-2-7b", "cache": {"pvc": {"size": "20Gi"}}})).objects
    other = build_children(cr("d", "uid-d")).objects
    await asyncio.to_thread(apply_objects, kube, full + other)
    # The router switched off: its Deployment leaves the desired set; the claim leaves it too.
    desired = [o for o in full if o["kind"] not in ("PersistentVolumeClaim",)
               and o["metadata"]["name"] != "c-router"]
    result = await asyncio.to_thread(apply_objects, kube, desired)
    await asyncio.to_thread(prune, kube, NS, "c", "uid-c", desired, result)
    gone = [k for k in keys(full) if k.endswith("/c-router")]  # Deployment, NetworkPolicy
    assert "Deployment/c-router" in gone and sorted(result.deleted) == sorted(gone)
    assert await asyncio.to_thread(kube.get, "apps/v1", "Deployment", NS, "c-router") is None
    assert await asyncio.to_thread(kube.get, "v1", "PersistentVolumeClaim", NS, "c-weights")
    for key in keys(desired) + keys(other):  # still desired, or another service's
        kind, name = key.split("/")
        api = next(o["apiVersion"] for o in full + other if o["kind"] == kind)
        assert await asyncio.to_thread(kube.get, api, kind, NS, name), key
