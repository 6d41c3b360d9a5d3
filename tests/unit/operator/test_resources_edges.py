"""resources.py edges the mutation run found untested (docs/mutation.md): pod hardening on every
workload, /dev/shm only for tensor parallelism, the port names monitors select, scale-up steps."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvserve.operator.children import build_children

EXAMPLES = Path(__file__).resolve().parents[3] / "manifests" / "examples"


def objects(name: str) -> dict[str, dict]:
    body = yaml.safe_load((EXAMPLES / name).read_text())
    body["metadata"].update(namespace="ml", uid="uid-1")
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build_children(body).objects}


def pods(objs: dict[str, dict]) -> dict[str, dict]:
    return {k: o["spec"]["template"]["spec"] for k, o in objs.items() if o["kind"] == "Deployment"}


def test_every_pod_runs_hardened() -> None:
    objs = objects("llama-2-7b-a100.yaml")
    assert set(pods(objs)) == {"Deployment/llama-2-7b-engine", "Deployment/llama-2-7b-router",
                               "Deployment/llama-2-7b-redis"}
    for name, pod in pods(objs).items():
        assert pod["automountServiceAccountToken"] is False, name  # no API access from pods
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])


def test_shared_memory_only_for_tensor_parallel_ranks() -> None:
    one = pods(objects("llama-2-7b-a100.yaml"))["Deployment/llama-2-7b-engine"]
    assert "nvidia.com/gpu" in one["containers"][0]["resources"]["limits"]
    assert not [v for v in one["volumes"] if v["name"] == "shm"]
    four = pods(objects("llama-3-70b-h100-fp8.yaml"))["Deployment/llama-3-70b-engine"]
    (shm,) = [v for v in four["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}  # 1 GiB per rank
    assert {"name": "shm", "mountPath": "/dev/shm"} in four["containers"][0]["volumeMounts"]


def test_service_ports_are_named_after_the_container_ports_they_reach() -> None:
    objs = objects("llama-2-7b-a100.yaml")
    for svc in [o for o in objs.values() if o["kind"] == "Service"]:
        target = svc["spec"]["selector"]["app.kubernetes.io/component"]
        container = pods(objs)[f"Deployment/llama-2-7b-{target}"]["containers"][0]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        (port,) = svc["spec"]["ports"]
        assert named[port["name"]] == port["targetPort"], svc["metadata"]["name"]


def test_autoscaling_adds_and_removes_replicas_one_at_a_time() -> None:
    behavior = objects("llama-2-7b-a100.yaml")["HorizontalPodAutoscaler/llama-2-7b"]["spec"][
        "behavior"]
    for direction in ("scaleUp", "scaleDown"):
        (policy,) = behavior[direction]["policies"]
        assert (policy["type"], policy["value"]) == ("Pods", 1), direction
    # Down is slower than up: a replica takes minutes to load, so removing one is the costly step.
    assert (behavior["scaleDown"]["stabilizationWindowSeconds"]
            > behavior["scaleUp"]["stabilizationWindowSeconds"])


def cr(**spec: object) -> dict:
    return {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-9"},
            "spec": {"model": {"name": "llama-3-8b"}, "gpu": {"type": "L40S"}, **spec}}


def built(body: dict) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build_children(body).objects}


def test_the_redis_auth_file_goes_to_a_memory_volume_only_with_a_password() -> None:
    from kvserve.operator.resources import REDIS_AUTH_SCRIPT

    with_pw = pods(built(cr(redis={"passwordSecretRef": {"name": "auth", "key": "pw"}})))
    pod = with_pw["Deployment/chat-redis"]
    (auth,) = [v for v in pod["volumes"] if v["name"] == "auth"]
    assert auth["emptyDir"]["medium"] == "Memory"  # the password never touches a disk
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "auth"]
    assert f"> {mount['mountPath']}/auth.conf" in REDIS_AUTH_SCRIPT  # the read-only root FS
    plain = pods(built(cr()))["Deployment/chat-redis"]
    assert [v["name"] for v in plain["volumes"]] == ["data"]


def test_the_index_redis_is_a_single_instance_replaced_not_rolled() -> None:
    redis = built(cr())["Deployment/chat-redis"]["spec"]
    assert redis["replicas"] == 1  # two would each hold half the index
    assert redis["strategy"] == {"type": "Recreate"}


def test_the_weights_init_container_gets_a_writable_tmp() -> None:
    pod = pods(built(cr(model={"name": "llama-3-8b", "cache": {"pvc": {"size": "60Gi"}}})))[
        "Deployment/chat-engine"]
    (init,) = pod["initContainers"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in init["volumeMounts"]


def test_the_weights_init_container_mounts_only_its_tmp_and_the_claim() -> None:
    """The fetch container writes the claim and its own scratch /tmp, nothing of the engine's
    (its compile cache, its config): another mount is another pod template, so every engine pod
    of the service would roll for it."""
    from kvserve.operator.weights import VOLUME, WEIGHTS_DIR

    pod = pods(built(cr(model={"name": "llama-3-8b", "cache": {"pvc": {"size": "60Gi"}}})))[
        "Deployment/chat-engine"]
    (init,) = pod["initContainers"]
    assert init["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"},
                                    {"name": VOLUME, "mountPath": WEIGHTS_DIR}]
    assert {"name": "cache", "mountPath": "/var/cache/kvserve"} in \
        pod["containers"][0]["volumeMounts"]  # the engine's scratch, not the fetcher's
