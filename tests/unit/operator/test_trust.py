"""Tenants and trust: the Redis password and the registration token reach pods only from Secrets,
a password in the spec is refused and never repeated, NetworkPolicies, foreign objects."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from pathlib import Path

import kubernetes_validate
import pytest
import redis
from conftest import free_port
from kvserve.operator.children import build_children
from kvserve.operator.reconcile import foreign, owner_uid, stamped
from kvserve.operator.resources import REDIS_AUTH_SCRIPT, redis_deployment
from kvserve.operator.spec import InvalidSpecError, parse_spec
from kvserve.operator.trust import (
    REDIS_PASSWORD_ENV,
    REGISTRATION_KEY,
    REGISTRATION_TOKEN_ENV,
    RedactingFilter,
    redact,
)

SECRET = "s3cr3t-Pa55"


def cr(**spec: object) -> dict:
    base = {"model": {"name": "llama-3-8b"}, "gpu": {"type": "L40S"}}
    base.update(spec)
    return {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-9"}, "spec": base}


def objects(body: dict) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build_children(body).objects}


def container(objs: dict, name: str) -> dict:
    return objs[f"Deployment/{name}"]["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


@pytest.mark.parametrize("text, expected", [
    ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
    ("rediss://user:p@ss@host/1", "rediss://user:***@host/1"),
    ("failed redis://a:b@h1/0 and redis://c:d@h2/0",
     "failed redis://a:***@h1/0 and redis://c:***@h2/0"),
    ("redis://user@host:6379/0", "redis://user@host:6379/0"),
    ("http://host:8000/v1 x@y", "http://host:8000/v1 x@y"),
])
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_log_filter_redacts_formatted_messages() -> None:
    record = logging.LogRecord("kopf.objects", logging.ERROR, __file__, 1,
                               "handler failed: %s", (f"redis://:{SECRET}@r:6379",), None)
    assert RedactingFilter().filter(record)
    assert SECRET not in record.getMessage() and "redis://:***@r:6379" in record.getMessage()


def test_password_in_redis_url_is_refused_without_repeating_it() -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(cr(redis={"url": f"redis://default:{SECRET}@redis.shared:6379/0"}))
    assert err.value.reason == "RedisPasswordInSpec"
    assert SECRET not in str(err.value)
    assert "passwordSecretRef" in str(err.value) and "redis://default:***@" in str(err.value)


def test_schema_errors_never_repeat_a_password() -> None:
    with pytest.raises(InvalidSpecError) as err:  # fails the url pattern before anything else
        parse_spec(cr(redis={"url": f"http://:{SECRET}@redis:6379"}))
    assert "does not match" in str(err.value) and SECRET not in str(err.value)


def test_redis_password_reaches_replicas_and_router_from_the_secret_only() -> None:
    body = cr(redis={"url": "redis://redis.shared:6379/0",
                     "passwordSecretRef": {"name": "redis-auth"}})
    objs = objects(body)
    want = {"name": REDIS_PASSWORD_ENV,
            "valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "password"}}}
    for name in ("chat-engine", "chat-router"):
        c = container(objs, name)
        assert env_of(c)[REDIS_PASSWORD_ENV] == want
        assert "--redis-url" in c["args"]
        assert c["args"][c["args"].index("--redis-url") + 1] == "redis://redis.shared:6379/0"
    assert "Deployment/chat-redis" not in objs


def test_no_password_env_without_a_secret_ref() -> None:
    assert REDIS_PASSWORD_ENV not in env_of(container(objects(cr()), "chat-engine"))


def test_registration_token_reaches_replicas_and_router() -> None:
    objs = objects(cr())
    want = {"name": REGISTRATION_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
        "name": "chat-registration", "key": REGISTRATION_KEY}}}
    for name in ("chat-engine", "chat-router"):
        assert env_of(container(objs, name))[REGISTRATION_TOKEN_ENV] == want


def test_registration_secret_is_created_once_with_a_random_token() -> None:
    first, second = build_children(cr()), build_children(cr())
    (secret,) = first.create_once
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "chat-registration"
    assert owner_uid(secret) == "uid-9"
    token = secret["stringData"][REGISTRATION_KEY]
    assert len(token) == 64 and int(token, 16) >= 0
    assert second.create_once[0]["stringData"][REGISTRATION_KEY] != token
    # The token is not in what is applied on every reconcile, so nothing there changes with it.
    assert [stamped(o) for o in first.objects] == [stamped(o) for o in second.objects]
    assert not any(o["kind"] == "Secret" for o in first.objects)
    kubernetes_validate.validate(secret, "1.31", strict=True)


def test_deployed_redis_requires_the_password_without_a_flag() -> None:
    spec = parse_spec(cr(redis={"passwordSecretRef": {"name": "redis-auth", "key": "pw"}}))
    c = redis_deployment(spec)["spec"]["template"]["spec"]["containers"][0]
    assert env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth",
                                                                        "key": "pw"}
    assert c["command"][:3] == ["sh", "-c", REDIS_AUTH_SCRIPT]
    assert "--requirepass" not in c["args"]
    kubernetes_validate.validate(redis_deployment(spec), "1.31", strict=True)


def test_redis_auth_script_really_requires_the_password(tmp_path: Path, redis_binary) -> None:
    """The container's script, run by a real shell and redis-server (the path moved to tmp)."""
    script = REDIS_AUTH_SCRIPT.replace("/run/redis", str(tmp_path))
    port = free_port()
    proc = subprocess.Popen(["sh", "-c", script, "redis-server", "--port", str(port), "--save",
                             "", "--dir", str(tmp_path)],
                            env={**os.environ, "REDIS_PASSWORD": SECRET},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        authed = redis.Redis(port=port, password=SECRET)
        for _ in range(100):
            try:
                authed.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        assert authed.ping()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(100).startswith(b"-NOAUTH")
        assert (tmp_path / "auth.conf").stat().st_mode & 0o077 == 0
        # The password is nowhere in the process's command line.
        assert SECRET not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def policies(body: dict) -> dict[str, dict]:
    return {name.split("/", 1)[1]: o for name, o in objects(body).items()
            if name.startswith("NetworkPolicy/")}


def ingress_of(policy: dict) -> list[dict]:
    return policy["spec"]["ingress"]


def test_network_policies_by_default() -> None:
    pols = policies(cr())
    assert set(pols) == {"chat-router", "chat-engine", "chat-redis"}
    for p in pols.values():
        kubernetes_validate.validate(p, "1.31", strict=True)
        assert p["spec"]["policyTypes"] == ["Ingress"]
    router = pols["chat-router"]
    assert router["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert ingress_of(router) == [{"ports": [{"protocol": "TCP", "port": 8000}]}]  # any client
    (engine_rule,) = ingress_of(pols["chat-engine"])
    assert engine_rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert engine_rule["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "chat",
                                         "app.kubernetes.io/component": "router"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    (redis_rule,) = ingress_of(pols["chat-redis"])
    assert redis_rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            for p in redis_rule["from"]] == ["engine", "router"]


def test_network_policy_clients_and_prometheus_selectors() -> None:
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}]
    prom = [{"namespaceSelector": {"matchLabels": {"team": "obs"}},
             "podSelector": {"matchLabels": {"app": "prometheus"}}}]
    pols = policies(cr(networkPolicy={"clients": clients, "prometheus": prom},
                       redis={"url": "redis://shared:6379/0"}))
    assert set(pols) == {"chat-router", "chat-engine"}  # no Redis of its own
    assert ingress_of(pols["chat-router"])[0]["from"] == clients + prom
    assert ingress_of(pols["chat-engine"])[0]["from"][1:] == prom
    for p in pols.values():
        kubernetes_validate.validate(p, "1.31", strict=True)


def test_network_policy_without_router_lets_clients_reach_the_engines() -> None:
    pols = policies(cr(router={"enabled": False}))
    assert set(pols) == {"chat-engine", "chat-redis"}
    assert ingress_of(pols["chat-engine"]) == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    (redis_rule,) = ingress_of(pols["chat-redis"])
    assert len(redis_rule["from"]) == 1


def test_network_policy_off() -> None:
    assert policies(cr(networkPolicy={"enabled": False})) == {}


def test_foreign_object_detection() -> None:
    desired = build_children(cr()).objects[0]
    ours = {"metadata": {"ownerReferences": [{"uid": "uid-9"}]}}
    theirs = {"metadata": {"ownerReferences": [{"uid": "uid-other"}]}}
    assert foreign(desired, {"metadata": {}})
    assert foreign(desired, theirs)
    assert not foreign(desired, ours)
    assert not foreign(desired, None)
    rendered = build_children({**cr(), "metadata": {"name": "chat", "namespace": "ml"}})
    assert not foreign(rendered.objects[0], theirs)  # no uid: nothing to compare (render)


def test_render_names_the_registration_secret_but_prints_no_token() -> None:
    import yaml
    from kvserve.operator.render import render
    out = render(yaml.safe_dump(cr()))
    assert "# not shown: Secret chat-registration (created once by the operator" in out
    assert "kind: Secret" not in out and "stringData" not in out
