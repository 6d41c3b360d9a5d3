"""The real kopf operator (kvserve.operator.handlers) against KMock's Kubernetes emulator."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import kmock as kmock_lib
import kopf
import yaml
from conftest import free_port

from kvserve.operator.crd import GROUP, KIND, PLURAL, VERSION
from kvserve.operator.handlers import build_registry, reconcile
from kvserve.operator.kube import PLURALS, KubeClient
from kvserve.operator.reconcile import ApplyResult, apply_objects, prune
from kvserve.operator.children import build_children

NS = "ml"
VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]
CR_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"
DEPLOYMENTS = "apps/v1/deployments"
WAIT_S = 20.0  # an upper bound for the operator to react; it normally takes well under a second

OWNED = {
    "v1/configmaps": "ConfigMap", "v1/services": "Service", "apps/v1/deployments": "Deployment",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
    "autoscaling/v2/horizontalpodautoscalers": "HorizontalPodAutoscaler",
    "v1/persistentvolumeclaims": "PersistentVolumeClaim",
    "networking.k8s.io/v1/ingresses": "Ingress",
    "gateway.networking.k8s.io/v1/httproutes": "HTTPRoute",
    "monitoring.coreos.com/v1/servicemonitors": "ServiceMonitor",
    "monitoring.coreos.com/v1/podmonitors": "PodMonitor",
    "keda.sh/v1alpha1/scaledobjects": "ScaledObject",
    "networking.k8s.io/v1/networkpolicies": "NetworkPolicy",
    "v1/secrets": "Secret",
    "batch/v1/jobs": "Job",
    # spec.routing.mode inferencePool
    "inference.networking.k8s.io/v1/inferencepools": "InferencePool",
    "v1/serviceaccounts": "ServiceAccount",
    "rbac.authorization.k8s.io/v1/roles": "Role",
    "rbac.authorization.k8s.io/v1/rolebindings": "RoleBinding",
    # spec.disaggregation.workload DisaggregatedSet
    "disaggregatedset.x-k8s.io/v1/disaggregatedsets": "DisaggregatedSet",
    # a replica over several nodes
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": "LeaderWorkerSet",
}
SECRETS = "v1/secrets"


def declare_resources(kmock: Any) -> None:
    """Discovery for kopf: namespaces, events, CRDs, our CRD, and every kind we write."""
    info = kmock_lib.ResourceInfo
    kmock.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs=VERBS)
    kmock.resources["v1/events"] = info(kind="Event", namespaced=True, verbs=VERBS)
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS)
    kmock.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = info(
        kind=KIND, namespaced=True, verbs=VERBS, subresources=["status", "scale"])
    for resource, kind in OWNED.items():
        kmock.resources[resource] = info(kind=kind, namespaced=True, verbs=VERBS)
    kmock.resources["v1/pods"] = info(kind="Pod", namespaced=True, verbs=VERBS)  # read only


@dataclass
class Harness:
    kmock: Any
    memo: kopf.Memo


@contextlib.asynccontextmanager
async def running_operator(kmock: Any,
                           status_interval: float = 3600.0) -> AsyncIterator[Harness]:
    """The operator in this test's own task: kopf cancels every task born after it started at
    exit, so stopping it from a fixture's teardown task would cancel the teardown itself."""
    declare_resources(kmock)
    registry = build_registry(status_interval=status_interval, login=False)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=str(kmock.url))

    # Short timeouts, no retries: a handler thread caught by the shutdown ends quickly.
    memo = kopf.Memo(kube=KubeClient.for_url(str(kmock.url), timeout=2.0, retries=False))
    task = asyncio.create_task(kopf.operator(
        registry=registry, standalone=True, clusterwide=True, memo=memo))
    try:
        yield Harness(kmock, memo)
    finally:
        # Cancelling (not the stop flag) ends KMock's open watch streams at once instead of
        # after kopf's 5-second grace period for "hung" tasks.
        memo.kube.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=WAIT_S)


# A reconcile (and a resync) ends with prune's LIST of every kind in PLURALS' order: the LIST of
# the last kind is the last request it sends about children.
LAST_PRUNED = list(PLURALS.values())[-1]


def reconciles_done(kmock: Any, after: int) -> int:
    """Reconciles or resyncs that reached their end (pruning) after request number `after`."""
    return sum(1 for r in list(kmock)[after:]
               if r.method.value == "GET" and r.url.path.endswith(f"/{LAST_PRUNED}"))


def service_cr(name: str = "llama", **spec_overrides: Any) -> dict:
    spec = {"model": {"name": "llama-2-7b"}, "gpu": {"type": "A100-80GB"},
            "engine": {"maxModelLen": 4096}, "replicas": 2,
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}
    spec.update(spec_overrides)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1,
                         "resourceVersion": "1"},
            "spec": spec}


async def wait_for(predicate: Any, what: str) -> Any:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while asyncio.get_running_loop().time() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stored(kmock: Any, resource: str, name: str) -> dict | None:
    try:
        obj = kmock.objects[resource, NS, name]
    except KeyError:
        return None
    return None if obj.deleted else obj.raw


def engine_container(kmock: Any, name: str) -> dict:
    return stored(kmock, DEPLOYMENTS, f"{name}-engine")["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def writes(kmock: Any) -> list[str]:
    """Every create/patch/update/delete the operator sent for the objects it owns, but the
    registration Secret's create, sent on every reconcile and answered 409 once it exists
    (the operator may create Secrets, not read them)."""
    owned = {kmock_lib.resource(r) for r in OWNED if r != SECRETS}
    return [f"{r.method.value} {r.url.path}" for r in list(kmock)
            if r.method.value in ("POST", "PATCH", "PUT", "DELETE")
            and r.resource in owned]


async def create(kmock: Any, body: dict) -> None:
    async with kmock.post(CR_PATH, json=body) as resp:
        assert resp.status < 300, await resp.text()


PLURAL_KEY = f"{GROUP}/{VERSION}/{PLURAL}"


async def test_create_builds_sized_workload(kmock: Any) -> None:
    async with running_operator(kmock):
        await create(kmock, service_cr())
        await wait_for(lambda: stored(kmock, PLURAL_KEY, "llama").get("status", {}).get("sizing"),
                       "status.sizing")
    container = engine_container(kmock, "llama")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = container["args"]
    assert args[:2] == ["serve", "meta-llama/Llama-2-7b-hf"]
    assert flag(args, "--max-model-len") == "4096"
    assert flag(args, "--tensor-parallel-size") == "1"
    assert flag(args, "--redis-url") == "redis://llama-redis:6379/0"
    assert flag(args, "--served-model-name") == "llama-2-7b"
    assert stored(kmock, DEPLOYMENTS, "llama-engine")["spec"]["replicas"] == 2
    assert stored(kmock, "v1/services", "llama-engine")["spec"]["ports"][0]["port"] == 8000
    assert stored(kmock, "v1/services", "llama")["spec"]["selector"][
        "app.kubernetes.io/component"] == "router"
    assert stored(kmock, DEPLOYMENTS, "llama-router") is not None
    hpa = stored(kmock, "autoscaling/v2/horizontalpodautoscalers", "llama")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                                            "name": "llama"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    owner = stored(kmock, DEPLOYMENTS, "llama-engine")["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-llama" and owner["controller"] is True
    status = stored(kmock, PLURAL_KEY, "llama")["status"]
    assert status["sizing"]["gpusPerReplica"] == 1 and status["sizing"]["numBlocks"] == 7541
    assert status["selector"] == ("app.kubernetes.io/instance=llama,"
                                  "app.kubernetes.io/component=engine")


async def test_big_model_gets_several_gpus(kmock: Any) -> None:
    async with running_operator(kmock):
        await create(kmock, service_cr("big", model={"name": "llama-3-70b"},
                                       gpu={"type": "H100-80GB"}, engine={"maxModelLen": 8192}))
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "big-engine"), "the engine Deployment")
    container = engine_container(kmock, "big")
    # The default target, 32 requests of 8192 tokens: TP 2 holds 3 of them, TP 4 holds 60.
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert flag(container["args"], "--tensor-parallel-size") == "4"


async def test_max_model_len_change_patches_deployment(kmock: Any) -> None:
    async with running_operator(kmock):
        await create(kmock, service_cr("edit"))
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "edit-engine"), "the engine Deployment")
        patch = {"spec": {"engine": {"maxModelLen": 2048}}}
        async with kmock.patch(f"{CR_PATH}/edit", json=patch,
                               headers={"Content-Type": "application/merge-patch+json"}) as resp:
            assert resp.status < 300
        await wait_for(lambda: flag(engine_container(kmock, "edit")["args"], "--max-model-len")
                       == "2048", "the Deployment patched to --max-model-len 2048")
    assert any(w.startswith("PATCH") and w.endswith("/deployments/edit-engine")
               for w in writes(kmock))


def ready_condition(kmock: Any, name: str) -> dict | None:
    conds = stored(kmock, PLURAL_KEY, name).get("status", {}).get("conditions", [])
    return next((c for c in conds if c["type"] == "Ready"), None)


def events(kmock: Any, reason: str) -> list[dict]:
    return [obj.raw for (res, _, _), obj in kmock.objects.items()
            if res == kmock_lib.resource("v1/events") and obj.raw.get("reason") == reason]


async def test_invalid_spec_is_refused_without_workload(kmock: Any) -> None:
    body = service_cr("huge", model={"name": "llama-3-70b"},
                      gpu={"type": "L4", "maxPerReplica": 2})
    async with running_operator(kmock):
        await create(kmock, body)
        cond = await wait_for(lambda: ready_condition(kmock, "huge"), "the Ready condition")
        event = await wait_for(lambda: events(kmock, "InsufficientGPUMemory"), "a warning event")
    assert event[0]["type"] == "Warning" and event[0]["involvedObject"]["name"] == "huge"
    assert cond["status"] == "False" and cond["reason"] == "InsufficientGPUMemory"
    assert "65.71 GiB" in cond["message"]  # the per-GPU weight share, with the numbers
    assert stored(kmock, DEPLOYMENTS, "huge-engine") is None
    assert writes(kmock) == []


async def test_unknown_model_is_refused(kmock: Any) -> None:
    async with running_operator(kmock):
        await create(kmock, service_cr("odd", model={"name": "my-private-llm"}))
        cond = await wait_for(lambda: ready_condition(kmock, "odd"), "the Ready condition")
    assert (cond["status"], cond["reason"]) == ("False", "UnknownModel")
    assert "spec.model.architecture" in cond["message"]
    assert writes(kmock) == []


async def test_second_reconcile_changes_nothing(kmock: Any) -> None:
    async with running_operator(kmock) as operator:
        await create(kmock, service_cr("again"))
        await wait_for(lambda: stored(kmock, PLURAL_KEY, "again").get("status", {})
                       .get("sizing"), "the first reconcile")
        before = writes(kmock)
        body = copy.deepcopy(stored(kmock, PLURAL_KEY, "again"))
        patch = kopf.Patch()
        await asyncio.to_thread(reconcile, body=body, patch=patch, memo=operator.memo,
                                logger=logging.getLogger("test"))
        assert before and writes(kmock) == before
        assert dict(patch) == {}


async def patch_cr(kmock: Any, name: str, patch: dict) -> None:
    async with kmock.patch(f"{CR_PATH}/{name}", json=patch,
                           headers={"Content-Type": "application/merge-patch+json"}) as resp:
        assert resp.status < 300


async def test_timer_reports_readiness_from_the_deployment(kmock: Any) -> None:
    async with running_operator(kmock, status_interval=0.2):
        await create(kmock, service_cr("ready"))
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "ready-engine"), "the Deployment")
        first = await wait_for(lambda: ready_condition(kmock, "ready"), "the Ready condition")
        assert (first["status"], first["reason"]) == ("False", "Progressing")
        # What the Deployment controller would report once both pods pass /health.
        status = {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}
        async with kmock.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/ready-engine",
                               json=status) as resp:
            assert resp.status < 300
        cond = await wait_for(lambda: (c := ready_condition(kmock, "ready")) and
                              c["status"] == "True" and c, "Ready=True")
    assert cond["reason"] == "ReplicasReady"
    assert stored(kmock, PLURAL_KEY, "ready")["status"]["readyReplicas"] == 2


LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"


async def test_a_two_node_model_is_a_leader_worker_set_ready_by_groups(kmock: Any) -> None:
    """Llama 3.1 405B on H100s: a LeaderWorkerSet of 2-pod groups (no engine Deployment), Ready
    from the groups LWS reports; a model that fits one node then replaces it by a Deployment."""
    big = service_cr("big", model={"name": "llama-3.1-405b"}, gpu={"type": "H100-80GB"},
                     engine={"maxModelLen": 8192}, replicas=1, autoscaling=None)
    del big["spec"]["autoscaling"]
    async with running_operator(kmock, status_interval=0.2):
        await create(kmock, big)
        lws = await wait_for(lambda: stored(kmock, LWS, "big-engine"), "the LeaderWorkerSet")
        assert stored(kmock, DEPLOYMENTS, "big-engine") is None
        tmpl = lws["spec"]["leaderWorkerTemplate"]
        assert tmpl["size"] == 2 and lws["metadata"]["ownerReferences"][0]["uid"] == "uid-big"
        assert tmpl["workerTemplate"]["spec"]["containers"][0]["args"][:2] == ["serve",
                                                                                "--headless"]
        first = await wait_for(lambda: ready_condition(kmock, "big"), "the Ready condition")
        assert (first["status"], first["reason"]) == ("False", "Progressing")
        status = {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}
        async with kmock.patch(f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/"
                               "leaderworkersets/big-engine", json=status) as resp:
            assert resp.status < 300
        await wait_for(lambda: (c := ready_condition(kmock, "big")) and c["status"] == "True",
                       "Ready=True from the LeaderWorkerSet")
        sizing = stored(kmock, PLURAL_KEY, "big")["status"]["sizing"]
        assert (sizing["tensorParallelSize"], sizing["pipelineParallelSize"],
                sizing["nodesPerReplica"]) == (8, 2, 2)
        small = {"spec": {"model": {"name": "llama-3-8b"}}}
        async with kmock.patch(f"{CR_PATH}/big", json=small) as resp:
            assert resp.status < 300
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "big-engine"), "the Deployment")
        await wait_for(lambda: stored(kmock, LWS, "big-engine") is None,
                       "the LeaderWorkerSet pruned")


async def test_scale_and_router_off_are_applied(kmock: Any) -> None:
    async with running_operator(kmock):
        await create(kmock, service_cr("knobs"))
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "knobs-router"), "the router")
        # `kubectl scale --replicas 10` beyond autoscaling.maxReplicas (4), and the router off.
        await patch_cr(kmock, "knobs", {"spec": {"replicas": 10, "router": {"enabled": False}}})
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "knobs-router") is None,
                       "the router Deployment deleted")
    assert stored(kmock, DEPLOYMENTS, "knobs-engine")["spec"]["replicas"] == 4
    assert stored(kmock, "v1/services", "knobs")["spec"]["selector"][
        "app.kubernetes.io/component"] == "engine"
    assert any(w.startswith("DELETE") and w.endswith("/deployments/knobs-router")
               for w in writes(kmock))


def pd_cr(name: str, disaggregation: dict) -> dict:
    """A service with prefill and decode pools (no spec.replicas / spec.autoscaling)."""
    body = service_cr(name, disaggregation=disaggregation)
    del body["spec"]["autoscaling"], body["spec"]["replicas"]
    return body


async def test_disaggregation_builds_both_pools_and_reports_their_readiness(
        kmock: Any) -> None:
    async with running_operator(kmock):
        await create(kmock, pd_cr("pd", {"prefill": {"replicas": 1},
                                         "decode": {"replicas": 2}}))
        prefill = await wait_for(lambda: stored(kmock, DEPLOYMENTS, "pd-prefill"), "prefill")
        decode = await wait_for(lambda: stored(kmock, DEPLOYMENTS, "pd-decode"), "decode")
        router = await wait_for(lambda: stored(kmock, DEPLOYMENTS, "pd-router"), "the router")
        first = await wait_for(lambda: ready_condition(kmock, "pd"), "the Ready condition")
        assert (first["status"], first["reason"]) == ("False", "Progressing")
        for name, n in (("pd-prefill", 1), ("pd-decode", 2)):
            status = {"status": {"replicas": n, "readyReplicas": n, "updatedReplicas": n}}
            async with kmock.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}",
                                   json=status) as resp:
                assert resp.status < 300
        cond = await wait_for(lambda: (c := ready_condition(kmock, "pd")) and
                              c["status"] == "True" and c, "Ready=True")
    assert stored(kmock, DEPLOYMENTS, "pd-engine") is None
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (1, 2)
    roles = [json.loads(flag(d["spec"]["template"]["spec"]["containers"][0]["args"],
                             "--kv-transfer-config"))["kv_role"] for d in (prefill, decode)]
    assert roles == ["kv_producer", "kv_consumer"]
    assert flag(router["spec"]["template"]["spec"]["containers"][0]["args"], "--policy") == "pd"
    assert cond["message"].startswith("3/3 engine replicas ready")
    assert stored(kmock, PLURAL_KEY, "pd")["status"]["readyReplicas"] == 3


async def test_disaggregated_set_workload_is_applied_in_place_of_deployments(
        kmock: Any) -> None:
    body = pd_cr("lws", {"workload": "DisaggregatedSet", "prefill": {}, "decode": {}})
    async with running_operator(kmock):
        await create(kmock, body)
        ds = await wait_for(lambda: stored(kmock, "disaggregatedset.x-k8s.io/v1/"
                                           "disaggregatedsets", "lws-pd"), "the DisaggregatedSet")
        status = {"status": {"roleStatuses": [
            {"name": r, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
            for r in ("prefill", "decode")]}}
        async with kmock.patch(f"/apis/disaggregatedset.x-k8s.io/v1/namespaces/{NS}/"
                               "disaggregatedsets/lws-pd", json=status) as resp:
            assert resp.status < 300
        cond = await wait_for(lambda: (c := ready_condition(kmock, "lws")) and
                              c["status"] == "True" and c, "Ready=True from the roles")
    assert [r["name"] for r in ds["spec"]["roles"]] == ["prefill", "decode"]
    assert (ds["metadata"]["ownerReferences"][0]["uid"]) == "uid-lws"
    for name in ("lws-engine", "lws-prefill", "lws-decode"):
        assert stored(kmock, DEPLOYMENTS, name) is None
    assert cond["message"].startswith("2/2 engine replicas ready")


async def test_mismatched_tensor_parallel_pools_are_refused_without_workload(
        kmock: Any) -> None:
    body = pd_cr("tp", {"prefill": {"tensorParallelSize": 1},
                        "decode": {"tensorParallelSize": 2}})
    async with running_operator(kmock):
        await create(kmock, body)
        cond = await wait_for(lambda: ready_condition(kmock, "tp"), "the Ready condition")
    assert (cond["status"], cond["reason"]) == ("False", "InvalidDisaggregation")
    assert "tensorParallelSize" in cond["message"]
    for name in ("tp-engine", "tp-prefill", "tp-decode"):
        assert stored(kmock, DEPLOYMENTS, name) is None
    assert writes(kmock) == []


POOLS = "inference.networking.k8s.io/v1/inferencepools"


async def test_inference_pool_mode_creates_the_gie_objects_and_router_mode_removes_them(
        kmock: Any) -> None:
    gateway = {"parentRefs": [{"name": "inference-gateway"}]}
    async with running_operator(kmock):
        await create(kmock, service_cr("gie", routing={"mode": "inferencePool",
                                                       "failureMode": "FailOpen"},
                                       gateway=gateway))
        pool = await wait_for(lambda: stored(kmock, POOLS, "gie"), "the InferencePool")
        route = await wait_for(lambda: stored(kmock, "gateway.networking.k8s.io/v1/httproutes",
                                              "gie"), "the HTTPRoute")
        epp = await wait_for(lambda: stored(kmock, DEPLOYMENTS, "gie-epp"), "the EPP")
        assert stored(kmock, DEPLOYMENTS, "gie-router") is None
        for resource in ("v1/serviceaccounts", "rbac.authorization.k8s.io/v1/roles",
                         "rbac.authorization.k8s.io/v1/rolebindings", "v1/services"):
            assert stored(kmock, resource, "gie-epp") is not None, resource
        await patch_cr(kmock, "gie", {"spec": {"routing": {"mode": "router"}}})
        gone = [(POOLS, "gie"), (DEPLOYMENTS, "gie-epp"), ("v1/serviceaccounts", "gie-epp"),
                ("rbac.authorization.k8s.io/v1/roles", "gie-epp"),
                ("rbac.authorization.k8s.io/v1/rolebindings", "gie-epp")]
        await wait_for(lambda: all(stored(kmock, *key) is None for key in gone),
                       "the pool, the EPP and its RBAC pruned")
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "gie-router"), "the router back")
    (owner,) = pool["metadata"]["ownerReferences"]
    assert (owner["uid"], owner["controller"]) == ("uid-gie", False)
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert pool["spec"]["selector"]["matchLabels"] == stored(
        kmock, DEPLOYMENTS, "gie-engine")["spec"]["selector"]["matchLabels"]
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    assert epp["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["epp", "--grpc-port"]
    backends = stored(kmock, "gateway.networking.k8s.io/v1/httproutes", "gie")["spec"]["rules"]
    assert backends[0]["backendRefs"] == [{"name": "gie", "port": 8000}]


async def test_an_unknown_routing_mode_is_refused_without_workload(kmock: Any) -> None:
    async with running_operator(kmock):
        await create(kmock, service_cr("odd-route", routing={"mode": "gateway"}))
        cond = await wait_for(lambda: ready_condition(kmock, "odd-route"), "the Ready condition")
    assert (cond["status"], cond["reason"]) == ("False", "InvalidSpec")
    assert cond["message"].startswith("spec.routing.mode: 'gateway' is not one of")
    assert writes(kmock) == []


async def test_timer_repairs_a_deleted_child(kmock: Any) -> None:
    async with running_operator(kmock, status_interval=0.2):
        await create(kmock, service_cr("heal"))
        await wait_for(lambda: stored(kmock, "v1/services", "heal-engine"), "the engine Service")
        async with kmock.delete(f"/api/v1/namespaces/{NS}/services/heal-engine") as resp:
            assert resp.status < 300
        assert stored(kmock, "v1/services", "heal-engine") is None
        await wait_for(lambda: stored(kmock, "v1/services", "heal-engine"),
                       "the engine Service recreated")
    creates = [w for w in writes(kmock) if w == f"POST /api/v1/namespaces/{NS}/services"]
    assert len(creates) >= 4  # redis, engine, entry, then the engine Service again


async def test_cli_entry_point_runs_the_operator(kmock: Any, tmp_path: Any) -> None:
    """`python -m kvserve.operator operator --all-namespaces`, as the operator image runs it: kopf
    logs in through a kubeconfig; its liveness endpoint answers. (KMock 0.8 cannot list
    namespaces, which kopf's namespace-scoped mode needs, so that mode is not run here.)"""
    declare_resources(kmock)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}]}))
    port = free_port()
    log = tmp_path / "operator.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvserve.operator", "operator", "--all-namespaces",
            "--liveness", f"http://127.0.0.1:{port}/healthz",
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            stdout=sink, stderr=asyncio.subprocess.STDOUT)
    try:
        await create(kmock, service_cr("cli"))
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "cli-engine") or proc.returncode,
                       f"the Deployment from the operator process; its log: {log}")
        assert proc.returncode is None, log.read_text()[-3000:]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert resp.status == 200
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=WAIT_S)
    assert stored(kmock, DEPLOYMENTS, "cli-engine") is not None, log.read_text()[-3000:]


async def test_refused_write_is_reported_as_apply_failed(kmock: Any) -> None:
    forbidden = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                 "reason": "Forbidden", "message": "deployments.apps is forbidden"}
    kmock[f"post /apis/apps/v1/namespaces/{NS}/deployments"] << 403 << forbidden
    async with running_operator(kmock):
        await create(kmock, service_cr("denied", router={"enabled": False},
                                       redis={"deploy": False}))
        cond = await wait_for(lambda: ready_condition(kmock, "denied"), "the Ready condition")
        warned = await wait_for(lambda: events(kmock, "ApplyFailed"), "a warning event")
    assert (cond["status"], cond["reason"]) == ("False", "ApplyFailed")
    assert "403" in cond["message"] and "forbidden" in cond["message"]
    assert (warned[0]["type"], warned[0]["involvedObject"]["name"]) == ("Warning", "denied")
    assert "403" in warned[0]["message"]


async def test_apply_creates_where_the_server_has_no_object(kmock: Any) -> None:
    """Server-side apply creates on a real API server; an emulator answers 404, so the client
    creates (POST) with the same field manager, and the next apply is a PATCH."""
    declare_resources(kmock)
    spec_body = service_cr("race")
    service = next(o for o in build_children(spec_body).objects if o["kind"] == "Service")
    kube = KubeClient.for_url(str(kmock.url), timeout=2.0, retries=False)
    first = await asyncio.to_thread(apply_objects, kube, [service])
    second = await asyncio.to_thread(apply_objects, kube, [service])
    assert first.applied == [f"Service/{service['metadata']['name']}"]
    assert second.unchanged == first.applied  # same hash: nothing sent the second time
    sent = [w for w in writes(kmock)]
    assert [w.split()[0] for w in sent] == ["PATCH", "POST"]


def sent(kmock: Any, method: str, path_end: str) -> list[Any]:
    return [r for r in list(kmock) if r.method.value == method and r.url.path.endswith(path_end)]


def is_cache_off_apply(r: Any) -> bool:
    return (r.method.value == "PATCH" and r.url.path.endswith("/deployments/cached-engine")
            and "initContainers" not in r.data["spec"]["template"]["spec"])


def status_patches(kmock: Any, name: str, after: int) -> list[dict]:
    """The status of each PATCH of the CR `name` after request number `after` that reports an
    apply (status.lastApplied): a reconcile that got there has pruned already."""
    return [r.data["status"] for r in list(kmock)[after:]
            if r.method.value == "PATCH" and r.url.path.endswith(f"/{PLURAL}/{name}/status")
            and isinstance(r.data, dict) and "lastApplied" in r.data.get("status", {})]


async def test_weights_cache_claim_is_created_once_and_shared(kmock: Any) -> None:
    """One claim for every replica: scaling up adds pods to the same pod template (one init
    container, one claim), never a second claim; switching the cache off keeps the claim."""
    cache = {"name": "llama-2-7b", "cache": {"pvc": {"size": "40Gi"}}}
    async with running_operator(kmock):
        await create(kmock, service_cr("cached", model=cache))
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "cached-engine"), "the Deployment")
        await patch_cr(kmock, "cached", {"spec": {"replicas": 3, "autoscaling": None}})
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "cached-engine")["spec"]["replicas"]
                       == 3, "the Deployment scaled to 3")
        pod = stored(kmock, DEPLOYMENTS, "cached-engine")["spec"]["template"]["spec"]
        await patch_cr(kmock, "cached", {"spec": {"model": {"cache": None}}})
        cache_off = await wait_for(lambda: next((i + 1 for i, r in enumerate(list(kmock))
                                                 if is_cache_off_apply(r)), 0),
                                   "the Deployment applied without the init container")
        # The status patch of that reconcile comes after its prune: the claim outlived it.
        after = await wait_for(lambda: status_patches(kmock, "cached", cache_off),
                               "the status patch of the cache-off reconcile")
    assert after[0]["lastApplied"] == {**after[0]["lastApplied"],
                                       "applied": ["Deployment/cached-engine"], "deleted": []}
    claim = stored(kmock, "v1/persistentvolumeclaims", "cached-weights")
    assert claim["spec"]["resources"]["requests"]["storage"] == "40Gi"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "uid-cached"
    assert [v for v in pod["volumes"] if v["name"] == "weights"] == [
        {"name": "weights", "persistentVolumeClaim": {"claimName": "cached-weights"}}]
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-weights"]
    claim_writes = [w for w in writes(kmock) if "persistentvolumeclaims" in w]
    assert claim_writes == [f"PATCH /api/v1/namespaces/{NS}/persistentvolumeclaims/cached-weights",
                            f"POST /api/v1/namespaces/{NS}/persistentvolumeclaims"]


async def test_removing_a_node_selector_removes_it_from_the_deployment(kmock: Any) -> None:
    """Server-side apply, forced, as kvserve-operator: the applied Deployment no longer holds
    the field, so the API server removes it (the field manager owned it). KMock merges naively,
    so this asserts what the operator sent, and how."""
    async with running_operator(kmock):
        await create(kmock, service_cr("pinned", nodeSelector={"gpu": "a100"}))
        await wait_for(lambda: stored(kmock, DEPLOYMENTS, "pinned-engine"), "the Deployment")
        await patch_cr(kmock, "pinned", {"spec": {"nodeSelector": None}})
        applied = await wait_for(
            lambda: [r for r in sent(kmock, "PATCH", "/deployments/pinned-engine")
                     if "nodeSelector" not in r.data["spec"]["template"]["spec"]],
            "an apply of the Deployment without nodeSelector")
        # Only what changed is sent again: the status names the Deployment alone.
        await wait_for(lambda: stored(kmock, PLURAL_KEY, "pinned")["status"]["lastApplied"]
                       ["applied"] == ["Deployment/pinned-engine"], "status.lastApplied")
    first = sent(kmock, "PATCH", "/deployments/pinned-engine")[0]
    assert first.data["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "a100"}
    request = applied[-1]
    assert request.headers["Content-Type"] == "application/apply-patch+yaml"
    assert (request.params["fieldManager"], request.params["force"]) == ("kvserve-operator",
                                                                         "true")
    cond = [c for c in stored(kmock, PLURAL_KEY, "pinned")["status"]["conditions"]
            if c["type"] == "Applied"][0]
    assert cond["status"] == "True" and "kvserve-operator" in cond["message"]


async def test_operator_restart_leaves_healthy_engines_alone(kmock: Any) -> None:
    """An operator upgrade is a restart: the resume handler rebuilds every child, finds each
    one's applied hash unchanged, and writes nothing, so no engine pod rolls."""
    async with running_operator(kmock):
        await create(kmock, service_cr("steady"))
        await wait_for(lambda: stored(kmock, PLURAL_KEY, "steady").get("status", {})
                       .get("sizing"), "the first reconcile")
    before = writes(kmock)
    mark = len(list(kmock))
    async with running_operator(kmock):
        await wait_for(lambda: reconciles_done(kmock, mark) >= 1,
                       "the new operator's resume reconcile, to its prune")
    assert before and writes(kmock) == before


def condition(kmock: Any, name: str, kind: str) -> dict | None:
    conds = stored(kmock, PLURAL_KEY, name).get("status", {}).get("conditions", [])
    return next((c for c in conds if c["type"] == kind), None)


async def test_foreign_object_is_left_alone_and_named(kmock: Any) -> None:
    """A Deployment of the engine's name that this service does not own (made by hand, or by
    another tool) is neither overwritten nor adopted; Conflict and Ready say which one. Once it
    is gone, the timer creates the operator's own."""
    declare_resources(kmock)
    theirs = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "clash-engine", "namespace": NS,
                           "labels": {"team": "someone-else"}},
              "spec": {"replicas": 7, "selector": {"matchLabels": {"app": "theirs"}},
                       "template": {"metadata": {"labels": {"app": "theirs"}}, "spec": {
                           "containers": [{"name": "web", "image": "nginx:1.27"}]}}}}
    async with kmock.post(f"/apis/apps/v1/namespaces/{NS}/deployments", json=theirs) as resp:
        assert resp.status < 300, await resp.text()
    before = copy.deepcopy(stored(kmock, DEPLOYMENTS, "clash-engine"))
    async with running_operator(kmock, status_interval=0.3) as operator:
        await create(kmock, service_cr("clash"))
        conflict = await wait_for(lambda: condition(kmock, "clash", "Conflict"), "Conflict")
        assert (conflict["status"], conflict["reason"]) == ("True", "ForeignObject")
        assert "Deployment/clash-engine" in conflict["message"]
        ready = condition(kmock, "clash", "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "ForeignObject")
        assert "Deployment/clash-engine" in ready["message"]
        await wait_for(lambda: events(kmock, "ForeignObject"), "a ForeignObject event")
        # The rest of the service is there; the foreign Deployment is exactly as it was.
        assert stored(kmock, DEPLOYMENTS, "clash-router") is not None
        mark = len(list(kmock))
        await wait_for(lambda: reconciles_done(kmock, mark) >= 2, "two resyncs, to their prune")
        assert stored(kmock, DEPLOYMENTS, "clash-engine") == before
        assert not [w for w in writes(kmock) if w.endswith("/deployments/clash-engine")]
        # The registration Secret: created once, owned, and never rotated by the resyncs.
        secret = stored(kmock, SECRETS, "clash-registration")
        token = secret["stringData"]["token"]
        assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-clash"
        body = copy.deepcopy(stored(kmock, PLURAL_KEY, "clash"))
        await asyncio.to_thread(reconcile, body=body, patch=kopf.Patch(), memo=operator.memo,
                                logger=logging.getLogger("test"))
        assert stored(kmock, SECRETS, "clash-registration")["stringData"]["token"] == token
        # Its owner removes it: the operator now creates its own engine Deployment.
        async with kmock.delete(f"/apis/apps/v1/namespaces/{NS}/deployments/clash-engine") as r:
            assert r.status < 300
        await wait_for(lambda: (c := condition(kmock, "clash", "Conflict")) and
                       c["status"] == "False", "Conflict=False")
    ours = stored(kmock, DEPLOYMENTS, "clash-engine")
    assert ours["metadata"]["ownerReferences"][0]["uid"] == "uid-clash"
    assert engine_container(kmock, "clash")["env"][-1]["name"] == "KVSERVE_REGISTRATION_TOKEN"


async def test_password_in_redis_url_is_refused_and_never_repeated(kmock: Any, caplog: Any) -> None:
    """Status, events and every log line of the operator (kopf's debug output, which prints the
    whole body, included: the filter `kvserve operator` installs) show the URL with *** in place
    of the password."""
    from kvserve.operator.trust import RedactingFilter, install_log_redaction

    caplog.set_level(logging.DEBUG)
    install_log_redaction()  # as run_operator does, on the root handlers (caplog's among them)
    password = "hunter2-in-the-spec"
    body = service_cr("leaky", redis={"url": f"redis://default:{password}@redis.shared:6379/0"})
    async with running_operator(kmock):
        await create(kmock, body)
        cond = await wait_for(lambda: ready_condition(kmock, "leaky"), "the Ready condition")
        event = await wait_for(lambda: events(kmock, "RedisPasswordInSpec"), "a warning event")
    assert (cond["status"], cond["reason"]) == ("False", "RedisPasswordInSpec")
    assert "redis://default:***@redis.shared:6379/0" in cond["message"]
    assert password not in str(stored(kmock, PLURAL_KEY, "leaky").get("status"))
    assert password not in str(event)
    for target in [caplog.handler, logging.getLogger("kopf.objects")]:
        for f in [f for f in target.filters if isinstance(f, RedactingFilter)]:
            target.removeFilter(f)
    redacted = [r for r in caplog.records if "default:***@" in r.getMessage()]
    assert redacted and not [r for r in caplog.records if password in r.getMessage()]
    assert stored(kmock, DEPLOYMENTS, "leaky-engine") is None


async def test_prune_deletes_what_left_the_desired_set_but_keeps_the_weights_claim(
        kmock: Any) -> None:
    """prune() alone: of this service's owned children, a Deployment no longer desired goes, the
    weights PVC (expensive to refill) stays."""
    declare_resources(kmock)
    spec_body = service_cr("keep", model={"name": "llama-2-7b",
                                          "cache": {"pvc": {"size": "40Gi"}}})
    objs = build_children(spec_body).objects
    kube = KubeClient.for_url(str(kmock.url), timeout=2.0, retries=False)
    await asyncio.to_thread(apply_objects, kube, objs)
    owned = {f"{o['kind']}/{o['metadata']['name']}" for o in objs}
    assert {"PersistentVolumeClaim/keep-weights", "Deployment/keep-router"} <= owned
    desired = [o for o in objs if o["kind"] not in ("PersistentVolumeClaim", "Deployment")
               or o["metadata"]["name"] == "keep-engine"]
    result = ApplyResult()
    await asyncio.to_thread(prune, kube, NS, "keep", "uid-keep", desired, result)
    kube.close()
    assert "PersistentVolumeClaim/keep-weights" not in result.deleted
    assert stored(kmock, "v1/persistentvolumeclaims", "keep-weights") is not None
    assert sorted(result.deleted) == sorted(
        f"Deployment/{o['metadata']['name']}" for o in objs
        if o["kind"] == "Deployment" and o["metadata"]["name"] != "keep-engine")
    assert stored(kmock, DEPLOYMENTS, "keep-router") is None
    assert stored(kmock, DEPLOYMENTS, "keep-engine") is not None


# ---------------------------------------------------------------------------- LoRA adapters


async def test_adapters_are_loaded_and_unloaded_on_running_pods_without_a_restart(
        kmock: Any) -> None:
    """Two engine pods are simulated replicas (service/sim/: vLLM's adapter endpoints). The
    operator loads the spec's adapters on both, a hub adapter only once its fetch Job succeeded;
    an edit of spec.adapters unloads and loads on the same pods and leaves the engine
    Deployment as it was; status.adapters says where each one is. The resync timer (every
    second here) finishes what a change could not (the fetch)."""
    from kvserve.service.sim.fleet import SimFleet
    from kvserve.service.sim.timing import TimingModel

    timing = TimingModel("t", prefill_s_per_token=0.0, decode_step_s=0.001,
                         decode_s_per_seq=0.0, decode_s_per_ctx_token=0.0, num_blocks=64)
    fleet = SimFleet(2, timing, model="smollm2-135m", lora_load_s=0.01)
    await fleet.start()
    pods = {f"lora-engine-{i}": fleet.url(i) for i in range(2)}
    w = "/var/lib/kvserve/weights"
    cr = service_cr("lora", model={"name": "smollm2-135m", "cache": {"pvc": {"size": "5Gi"}}},
                    adapters=[{"name": "local", "uri": "/opt/adapters/local"},
                              {"name": "hub", "uri": "hf://org/hub-lora"}])

    def held(i: int) -> dict[str, str]:
        return dict(fleet.replicas[i].adapters)

    def adapters_status() -> list[dict]:
        return stored(kmock, PLURAL_KEY, "lora").get("status", {}).get("adapters", [])

    try:
        async with running_operator(kmock, status_interval=1.0) as h:
            h.memo.pod_url = lambda pod: pods.get(pod["metadata"]["name"])
            for name in pods:
                await create_pod(kmock, name, "lora")
            await create_pod(kmock, "other-engine-0", "other")  # another service's pod
            await create(kmock, cr)
            await wait_for(lambda: all(held(i) == {"local": "/opt/adapters/local"}
                                       for i in range(2)), "the local adapter on both pods")
            await wait_for(lambda: adapters_status() and adapters_status()[1].get("message"),
                           "status saying the hub adapter is being fetched")
            assert adapters_status()[0] == {"name": "local", "uri": "/opt/adapters/local",
                                            "loadedOn": sorted(pods)}
            job = next(o.raw for (res, _, _), o in kmock.objects.items()
                       if res == kmock_lib.resource("batch/v1/jobs") and not o.deleted)
            engine_before = stored(kmock, DEPLOYMENTS, "lora-engine")["spec"]
            await patch_status(kmock, "apis/batch/v1", "jobs", job["metadata"]["name"],
                               {"status": {"succeeded": 1}})
            hub = f"{w}/adapters/org--hub-lora"
            await wait_for(lambda: all(held(i).get("hub") == hub for i in range(2)),
                           "the hub adapter on both pods once fetched")
            await patch_cr(kmock, "lora", {"spec": {"adapters": [
                {"name": "hub", "uri": "hf://org/hub-lora"},
                {"name": "new", "uri": "/opt/adapters/new"}]}})
            await wait_for(lambda: all(held(i) == {"hub": hub, "new": "/opt/adapters/new"}
                                       for i in range(2)), "local unloaded, new loaded")
            await wait_for(lambda: [a["name"] for a in adapters_status()] == ["hub", "new"]
                           and all(a["loadedOn"] == sorted(pods) for a in adapters_status()),
                           "status.adapters after the edit")

            def router_modules() -> list[str]:
                args = stored(kmock, DEPLOYMENTS, "lora-router")["spec"]["template"]["spec"][
                    "containers"][0]["args"]
                i = args.index("--lora-modules")
                return args[i + 1:i + 3]

            # The router gets the new registry (its pods roll; they hold no state).
            await wait_for(lambda: router_modules() == [f"hub={hub}", "new=/opt/adapters/new"],
                           "the router's --lora-modules after the edit")
        engine_after = stored(kmock, DEPLOYMENTS, "lora-engine")["spec"]
        assert engine_after["template"] == engine_before["template"]  # no restart
        assert fleet.replicas[0].counters.adapter_loads == 3  # local, hub, new: once each
    finally:
        await fleet.close()


async def create_pod(kmock: Any, name: str, service: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NS, "labels": {
               "app.kubernetes.io/instance": service, "app.kubernetes.io/component": "engine"}},
           "spec": {"containers": [{"name": "engine", "image": "x"}]},
           "status": {"phase": "Running", "podIP": "10.0.0.1"}}
    async with kmock.post(f"/api/v1/namespaces/{NS}/pods", json=pod) as resp:
        assert resp.status < 300, await resp.text()


async def patch_status(kmock: Any, base: str, plural: str, name: str, patch: dict) -> None:
    async with kmock.patch(f"/{base}/namespaces/{NS}/{plural}/{name}", json=patch,
                           headers={"Content-Type": "application/merge-patch+json"}) as resp:
        assert resp.status < 300, await resp.text()
