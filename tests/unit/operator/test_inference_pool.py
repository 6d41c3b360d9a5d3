"""spec.routing.mode inferencePool: the InferencePool, the `kvserve epp` endpoint picker and the
HTTPRoute, each valid against its real schema and wired to the others and to the replicas."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from crd_schemas import FILES
from crd_schemas import errors as crd_errors
from kvserve.operator.children import build_children
from kvserve.operator.render import render
from kvserve.operator.spec import InvalidSpecError, parse_spec
from kvserve.operator.trust import REDIS_PASSWORD_ENV

NS = "ml"


def cr(name: str = "chat", uid: str = "uid-chat", **spec: Any) -> dict:
    return {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
            "metadata": {"name": name, "namespace": NS, "uid": uid},
            "spec": {"model": {"name": "llama-3-8b"}, "gpu": {"type": "L40S"}, **spec}}


def pool_cr(**spec: Any) -> dict:
    return cr(routing={"mode": "inferencePool", **spec.pop("routing", {})}, **spec)


GATEWAY = {"parentRefs": [{"name": "inference-gateway", "namespace": "gateways"}],
           "hostnames": ["llm.example.com"]}


def by_key(body: dict) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build_children(body).objects}


def cel_errors(pool: dict) -> list[str]:
    """The pool CRD's two CEL rules, which jsonschema does not evaluate."""
    found = []
    ref = pool["spec"]["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        found.append("endpointPickerRef: port is required when kind is 'Service'")
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    if len(numbers) != len(set(numbers)):
        found.append("targetPorts: port number must be unique")
    return found


@pytest.mark.parametrize("gateway", [None, GATEWAY], ids=["no-gateway", "gateway"])
def test_every_object_validates_against_its_real_schema(gateway: dict | None) -> None:
    body = pool_cr(**({"gateway": gateway} if gateway else {}),
                   redis={"passwordSecretRef": {"name": "redis-auth"}})
    objs = build_children(body).objects
    kinds = {o["kind"] for o in objs}
    assert {"InferencePool", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    for obj in objs:
        if obj["kind"] in FILES:
            assert crd_errors(obj) == [], obj["kind"]
        else:
            kubernetes_validate.validate(obj, "1.31", strict=True)
    pool = next(o for o in objs if o["kind"] == "InferencePool")
    assert cel_errors(pool) == []


def test_the_pool_schema_is_strict_and_its_cel_checks_can_fail() -> None:
    pool = by_key(pool_cr())["InferencePool/chat"]
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSoft"
    bad["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    bad["spec"]["endpointPickerRef"].pop("port")
    bad["spec"]["extensionRef"] = {"name": "old-field"}  # the pre-v1 spelling is refused
    assert len(crd_errors(bad)) == 2
    assert len(cel_errors(bad)) == 2


def test_the_pool_selects_the_replicas_on_their_port() -> None:
    objs = by_key(pool_cr())
    pool, engine = objs["InferencePool/chat"], objs["Deployment/chat-engine"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == engine["spec"]["selector"]["matchLabels"]
    pod_labels = engine["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    # No other pods of the service (router, EPP, Redis) match the pool's selector.
    for key, obj in objs.items():
        if obj["kind"] == "Deployment" and key != "Deployment/chat-engine":
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert not selector.items() <= labels.items(), key
    engine_port = engine["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert pool["spec"]["targetPorts"] == [{"number": engine_port["containerPort"]}]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"


def test_the_endpoint_picker_ref_reaches_the_epp_pods() -> None:
    objs = by_key(pool_cr())
    ref = objs["InferencePool/chat"]["spec"]["endpointPickerRef"]
    service = objs[f"Service/{ref['name']}"]
    assert ref["kind"] == "Service" and ref.get("group", "") == ""
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    deployment = objs[f"Deployment/{ref['name']}"]
    template = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    container = template["spec"]["containers"][0]
    assert port["targetPort"] in [p["containerPort"] for p in container["ports"]]
    args = container["args"]
    assert args[args.index("--grpc-port") + 1] == str(port["targetPort"])


@pytest.mark.parametrize("mode, expected", [(None, "FailClose"), ("FailClose", "FailClose"),
                                            ("FailOpen", "FailOpen")])
def test_failure_mode_passes_through(mode: str | None, expected: str) -> None:
    routing = {"failureMode": mode} if mode else {}
    pool = by_key(pool_cr(routing=routing))["InferencePool/chat"]
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == expected


def test_the_epp_runs_the_pool_flags_and_the_routers_redis() -> None:
    objs = by_key(pool_cr(redis={"url": "redis://shared:6379/2",
                                 "passwordSecretRef": {"name": "redis-auth", "key": "pw"}}))
    container = objs["Deployment/chat-epp"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kvserve"]
    assert container["args"] == [
        "epp", "--grpc-port", "9002", "--grpc-health-port", "9003", "--metrics-port", "9090",
        "--pool-name", "chat", "--pool-namespace", NS, "--tokenizer", "meta-llama/Meta-Llama-3-8B",
        "--redis-url", "redis://shared:6379/2", "--service-name", "chat"]
    engine = objs["Deployment/chat-engine"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert engine[engine.index("--service-name") + 1] == "chat"  # the key space they publish in
    password = next(e for e in container["env"] if e["name"] == REDIS_PASSWORD_ENV)
    assert password["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "pw"}
    # The router mode's router gets the same URL and the same Secret.
    router = by_key(cr(redis={"url": "redis://shared:6379/2",
                              "passwordSecretRef": {"name": "redis-auth", "key": "pw"}}))
    r = router["Deployment/chat-router"]["spec"]["template"]["spec"]["containers"][0]
    assert r["args"][r["args"].index("--redis-url") + 1] == "redis://shared:6379/2"
    assert password in r["env"]


def test_the_epp_uses_the_services_own_redis_or_none() -> None:
    own = by_key(pool_cr())["Deployment/chat-epp"]["spec"]["template"]["spec"]["containers"][0]
    assert own["args"][-4:] == ["--redis-url", "redis://chat-redis:6379/0", "--service-name",
                                "chat"]
    none = by_key(pool_cr(redis={"deploy": False}))
    args = none["Deployment/chat-epp"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--redis-url" not in args and "--service-name" not in args
    assert args[args.index("--pool-namespace") + 1] == NS
    assert "Deployment/chat-redis" not in none


def test_the_epp_probes_are_grpc_health_checks() -> None:
    pod = by_key(pool_cr())["Deployment/chat-epp"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    service_ports = {p["name"]: p["port"] for p in by_key(pool_cr())["Service/chat-epp"]
                     ["spec"]["ports"]}
    assert service_ports == {"grpc-ext-proc": 9002, "grpc-health": 9003, "http-metrics": 9090}


def test_the_epp_may_read_pods_and_pools_and_nothing_else() -> None:
    objs = by_key(pool_cr())
    pod = objs["Deployment/chat-epp"]["spec"]["template"]["spec"]
    account = objs[f"ServiceAccount/{pod['serviceAccountName']}"]
    assert pod["automountServiceAccountToken"] is True
    role, binding = objs["Role/chat-epp"], objs["RoleBinding/chat-epp"]
    granted = {(g, r): set(rule["verbs"]) for rule in role["rules"]
               for g in rule["apiGroups"] for r in rule["resources"]}
    assert granted == {("", "pods"): {"get", "list", "watch"},
                       ("inference.networking.k8s.io", "inferencepools"):
                           {"get", "list", "watch"}}
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": account["metadata"]["name"], "namespace": NS}]


def test_the_http_route_sends_the_gateways_traffic_to_the_pool() -> None:
    route = by_key(pool_cr(gateway=GATEWAY))["HTTPRoute/chat"]
    assert route["spec"]["parentRefs"] == GATEWAY["parentRefs"]
    assert route["spec"]["hostnames"] == GATEWAY["hostnames"]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat"}]
    # Router mode keeps its Service-backed route.
    plain = by_key(cr(gateway=GATEWAY))["HTTPRoute/chat"]
    assert plain["spec"]["rules"][0]["backendRefs"] == [{"name": "chat", "port": 8000}]


def test_without_parent_refs_there_is_no_route() -> None:
    assert not [k for k in by_key(pool_cr()) if k.startswith("HTTPRoute/")]


def test_router_mode_renders_no_gie_objects_and_keeps_its_router() -> None:
    for body in (cr(), cr(routing={"mode": "router"})):
        objs = by_key(body)
        assert not {k.split("/")[0] for k in objs} & {"InferencePool", "Role", "RoleBinding",
                                                      "ServiceAccount"}
        assert "Deployment/chat-epp" not in objs and "Deployment/chat-router" in objs
        assert objs["Service/chat"]["spec"]["selector"]["app.kubernetes.io/component"] == "router"


def test_pool_mode_has_no_router_deployment() -> None:
    objs = by_key(pool_cr(router={"enabled": True}))
    assert "Deployment/chat-router" not in objs
    # The plain Service stays, on the replicas (for an Ingress or in-cluster clients).
    assert objs["Service/chat"]["spec"]["selector"]["app.kubernetes.io/component"] == "engine"


def test_the_pool_has_one_owner_reference_and_it_is_not_a_controllers() -> None:
    objs = by_key(pool_cr(gateway=GATEWAY))
    refs = objs["InferencePool/chat"]["metadata"]["ownerReferences"]
    assert len(refs) == 1
    assert (refs[0]["kind"], refs[0]["uid"]) == ("KVInferenceService", "uid-chat")
    assert refs[0]["controller"] is False and refs[0]["blockOwnerDeletion"] is False
    for key, obj in objs.items():
        if key != "InferencePool/chat":
            assert obj["metadata"]["ownerReferences"][0]["controller"] is True, key


def test_network_policies_let_the_gateway_reach_the_epp_and_the_epp_reach_redis() -> None:
    objs = by_key(pool_cr())
    epp = objs["NetworkPolicy/chat-epp"]["spec"]
    assert epp["podSelector"]["matchLabels"] == objs["Deployment/chat-epp"]["spec"]["selector"][
        "matchLabels"]
    assert {p["port"] for r in epp["ingress"] for p in r["ports"]} == {9002, 9090}
    redis_peers = objs["NetworkPolicy/chat-redis"]["spec"]["ingress"][0]["from"]
    components = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                  for p in redis_peers}
    assert components == {"engine", "epp"}
    # Clients narrowed to the gateway's pods: the EPP still reaches the replicas (their metrics).
    gateway_pods = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}
    narrowed = by_key(pool_cr(networkPolicy={"clients": [gateway_pods]}))
    engine_from = narrowed["NetworkPolicy/chat-engine"]["spec"]["ingress"][0]["from"]
    assert gateway_pods in engine_from
    assert {"podSelector": {"matchLabels": narrowed["Deployment/chat-epp"]["spec"]["selector"][
        "matchLabels"]}} in engine_from
    epp_from = narrowed["NetworkPolicy/chat-epp"]["spec"]["ingress"][0]["from"]
    assert gateway_pods in epp_from


@pytest.mark.parametrize("routing, field", [({"mode": "gateway"}, "spec.routing.mode"),
                                            ({"mode": "inferencePool", "failureMode": "Open"},
                                             "spec.routing.failureMode"),
                                            ({"eppReplicas": 0}, "spec.routing.eppReplicas")])
def test_invalid_routing_says_what_to_fix(routing: dict, field: str) -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(cr(routing=routing))
    assert str(err.value).startswith(field)
    assert err.value.reason == "InvalidSpec"


def test_kvserve_render_prints_the_pool_objects() -> None:
    body = pool_cr(gateway=GATEWAY)
    del body["metadata"]["uid"]
    docs = [d for d in yaml.safe_load_all(render(yaml.safe_dump(body))) if d]
    kinds = [d["kind"] for d in docs]
    assert {"InferencePool", "HTTPRoute", "Role", "RoleBinding", "ServiceAccount"} <= set(kinds)
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    assert "ownerReferences" not in pool["metadata"]  # a file has no uid to own by
    assert crd_errors(pool) == []
    assert sum(1 for d in docs if d["kind"] == "Deployment"
               and d["metadata"]["name"].endswith("-router")) == 0


def test_the_real_epp_cli_reads_the_rendered_args_as_meant() -> None:
    import argparse

    from kvserve.service.epp import cli

    objs = by_key(pool_cr(redis={"url": "redis://shared:6379/2"}))
    container = objs["Deployment/chat-epp"]["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    cfg = cli.config_from_args(parser.parse_args(container["args"][1:]))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (cfg.grpc_port, cfg.grpc_health_port, cfg.metrics_port) == (
        ports["grpc"], ports["grpc-health"], ports["metrics"])
    assert (cfg.pool_name, cfg.pool_namespace) == ("chat", NS)
    assert objs[f"InferencePool/{cfg.pool_name}"]["metadata"]["namespace"] == cfg.pool_namespace
    engine = objs["Deployment/chat-engine"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (cfg.router.redis_url, cfg.router.service_name) == (
        "redis://shared:6379/2", engine[engine.index("--service-name") + 1])


PVC_MODEL = {"name": "llama-3-8b", "uri": "pvc://model-store/llama-3-8b-instruct"}


@pytest.mark.parametrize("model", [{"name": "llama-3-8b"}, PVC_MODEL], ids=["hub", "pvc"])
def test_the_epp_tokenizes_with_the_routers_tokenizer(model: dict) -> None:
    router = by_key(cr(model=model))["Deployment/chat-router"]["spec"]["template"]["spec"]
    epp = by_key(pool_cr(model=model))["Deployment/chat-epp"]
    kubernetes_validate.validate(epp, "1.31", strict=True)
    r_args, pod = router["containers"][0]["args"], epp["spec"]["template"]["spec"]
    e_args = pod["containers"][0]["args"]
    tokenizer = e_args[e_args.index("--tokenizer") + 1]
    assert tokenizer == r_args[r_args.index("--tokenizer") + 1]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    if model is PVC_MODEL:  # the files are on the claim: the EPP mounts it read-only, as the router
        assert list(claims.values()) == ["model-store"]
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] in claims]
        assert tokenizer.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
        assert mount in router["containers"][0]["volumeMounts"]
    else:  # a hub id the EPP fetches itself, like the router
        assert tokenizer == "meta-llama/Meta-Llama-3-8B" and claims == {}


@pytest.mark.parametrize("secure", [None, False, True])
def test_secure_serving_reaches_the_epp_flag(secure: bool | None) -> None:
    import argparse

    from kvserve.service.epp import cli

    routing = {} if secure is None else {"secureServing": secure}
    container = by_key(pool_cr(routing=routing))["Deployment/chat-epp"]["spec"]["template"][
        "spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.config_from_args(parser.parse_args(container["args"][1:])).secure_serving is \
        bool(secure)
    # The kubelet's gRPC probes speak plaintext: they stay on the health port, which the EPP
    # serves without TLS even with --secure-serving (tests/unit/service/test_epp_server.py).
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 9003


def test_secure_serving_must_be_a_boolean() -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(pool_cr(routing={"secureServing": "yes"}))
    assert str(err.value).startswith("spec.routing.secureServing")


def test_the_epp_metrics_port_has_monitors_of_its_own() -> None:
    from test_monitor_ports import matches

    objs = by_key(pool_cr(monitoring={"serviceMonitor": True, "podMonitor": True}))
    sm, pm = objs["ServiceMonitor/chat-epp"], objs["PodMonitor/chat-epp"]
    assert crd_errors(sm) == [] and crd_errors(pm) == []
    services = [o for o in objs.values() if o["kind"] == "Service"
                and matches(sm["spec"]["selector"], o["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in services] == ["chat-epp"]
    (port,) = [p for p in services[0]["spec"]["ports"] if p["name"] == sm["spec"]["endpoints"][0][
        "port"]]
    assert port["port"] == 9090  # the EPP's --metrics-port
    pods = [o["spec"]["template"] for o in objs.values() if o["kind"] == "Deployment"
            and matches(pm["spec"]["selector"], o["spec"]["template"]["metadata"]["labels"])]
    assert len(pods) == 1 and pods[0]["metadata"]["labels"]["app.kubernetes.io/component"] == "epp"
    ports = {p["name"]: p["containerPort"] for p in pods[0]["spec"]["containers"][0]["ports"]}
    assert ports[pm["spec"]["podMetricsEndpoints"][0]["port"]] == 9090
    # Without spec.monitoring, no monitors at all; in router mode, no EPP monitors.
    assert not any(k.endswith("Monitor/chat-epp") for k in by_key(pool_cr()))
    router_mode = by_key(cr(monitoring={"serviceMonitor": True, "podMonitor": True}))
    assert not any(k.endswith("Monitor/chat-epp") for k in router_mode)
