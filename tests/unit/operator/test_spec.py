"""Spec parsing: CRD defaults, schema checks, catalog lookup, semantic refusals."""

from __future__ import annotations

import pytest

from kvserve.operator.crd import spec_schema
from kvserve.operator.spec import (
    InvalidSpecError, apply_defaults, parse_quantity, parse_spec, schema_errors,
)


def body(**spec: object) -> dict:
    return {"metadata": {"name": "svc", "namespace": "team", "uid": "u-1"}, "spec": spec}


def test_defaults_come_from_the_crd_schema() -> None:
    s = parse_spec(body(model={"name": "mistral-7b"}, gpu={"type": "L40S"}))
    e = s.engine
    assert (e.block_size, e.gpu_memory_utilization, e.kv_cache_dtype) == (16, 0.9, "auto")
    assert e.max_model_len == 32768 and e.max_num_seqs is None  # the model's own context
    assert (s.replicas, s.router_enabled, s.router_policy, s.redis_deploy) == (1, True, "prefix",
                                                                              True)
    assert s.model.source == "mistralai/Mistral-7B-v0.1" and s.model.served_name == "mistral-7b"
    assert (s.name, s.namespace, s.uid) == ("svc", "team", "u-1")


def test_apply_defaults_leaves_given_values_and_the_input_alone() -> None:
    given = {"model": {"name": "x"}, "engine": {"blockSize": 32}}
    out = apply_defaults(spec_schema(), given)
    assert out["engine"]["blockSize"] == 32 and out["engine"]["dtype"] == "auto"
    assert given == {"model": {"name": "x"}, "engine": {"blockSize": 32}}


@pytest.mark.parametrize("spec, message", [
    ({"engine": {"gpuMemoryUtilization": 1.2}}, "spec.engine.gpuMemoryUtilization: 1.2 is above"),
    ({"engine": {"blockSize": 12}}, "spec.engine.blockSize: 12 is not one of [8, 16, 32]"),
    ({"engine": {"maxModelLen": "long"}}, "spec.engine.maxModelLen: expected integer"),
    ({"engine": {"maxModelLenn": 10}}, "spec.engine.maxModelLenn: unknown field"),
    ({"replicas": -1}, "spec.replicas: -1 is below the minimum 0"),
    ({"redis": {"url": "http://x"}}, "spec.redis.url: 'http://x' does not match"),
    ({"autoscaling": {"minReplicas": 2}}, "spec.autoscaling.maxReplicas: required"),
])
def test_schema_violations_are_named(spec: dict, message: str) -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(body(model={"name": "llama-2-7b"}, gpu={"type": "A10G"}, **spec))
    assert message in str(err.value) and err.value.reason == "InvalidSpec"


def test_schema_errors_accepts_a_full_valid_spec() -> None:
    spec = apply_defaults(spec_schema(), {"model": {"name": "a"}, "tolerations": [{"k": 1}],
                                          "env": [{"name": "A", "value": "b"}],
                                          "resources": {"limits": {"cpu": "2"}}})
    assert schema_errors(spec_schema(), spec) == []


def test_unknown_model_asks_for_an_architecture() -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(body(model={"name": "my-llm"}, gpu={"type": "L4"}))
    assert err.value.reason == "UnknownModel" and "spec.model.architecture" in str(err.value)


def test_architecture_describes_an_outside_model() -> None:
    s = parse_spec(body(model={"name": "tiny", "uri": "org/tiny", "architecture": {
        "layers": 4, "kvHeads": 2, "headDim": 64, "parameters": 10_000_000}},
        gpu={"type": "L4"}))
    arch = s.model.arch
    assert (arch.heads, arch.hidden, arch.intermediate, arch.vocab) == (2, 128, 512, 32000)
    assert s.model.source == "org/tiny" and s.model.served_name == "tiny"


def test_aliases_and_uri_resolve_to_the_catalog() -> None:
    s = parse_spec(body(model={"uri": "Qwen/Qwen2.5-7B-Instruct"}, gpu={"type": "L4"}))
    assert s.model.key == "qwen2.5-7b" and s.model.source == "Qwen/Qwen2.5-7B-Instruct"
    assert s.model.served_name == "svc"  # no name: the resource's name


@pytest.mark.parametrize("spec, message", [
    ({"model": {"name": "llama-2-7b"}, "gpu": {}}, "set spec.gpu.type"),
    ({"model": {"name": "llama-2-7b"}, "gpu": {"type": "L4"}, "engine": {"maxModelLen": 8192}},
     "exceeds the model's context length 4096"),
    ({"model": {"name": "llama-2-7b"}, "gpu": {"type": "L4"},
      "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas 5 is above"),
    ({"model": {"name": "llama-2-7b"}, "device": "cpu"}, "spec.resources.limits.memory"),
    ({"model": {}}, "needs a name"),
])
def test_semantic_refusals(spec: dict, message: str) -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(body(**spec))
    assert message in str(err.value)


def test_redis_url_wins_over_deploy() -> None:
    s = parse_spec(body(model={"name": "llama-2-7b"}, gpu={"type": "L4"},
                        redis={"url": "redis://shared:6379/0", "deploy": True}))
    assert s.redis_url == "redis://shared:6379/0" and s.redis_deploy is False


@pytest.mark.parametrize("url", ["redis+sentinel://s-0.redis-headless:26379,s-1:26379/mymaster",
                                 "redis+cluster://redis-cluster-0:6379,redis-cluster-1:6379",
                                 "rediss://redis.shared:6380/2"])
def test_sentinel_and_cluster_urls_reach_replicas_and_router(url: str) -> None:
    from kvserve.operator.resources import desired_objects
    from kvserve.operator.sizing import plan

    s = parse_spec(body(model={"name": "llama-2-7b"}, gpu={"type": "L4"}, redis={"url": url}))
    assert s.redis_url == url and s.redis_deploy is False
    objs = {f"{o['kind']}/{o['metadata']['name']}": o for o in desired_objects(s, plan(s))}
    assert "Deployment/svc-redis" not in objs
    for name in ("svc-engine", "svc-router"):
        args = objs[f"Deployment/{name}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--redis-url") + 1] == url


@pytest.mark.parametrize("url, message", [
    ("redis+sentinel://s-0:26379", "spec.redis.url 'redis+sentinel://s-0:26379': name the "
                                   "Sentinel master set"),
    ("redis+cluster://n:port", "spec.redis.url 'redis+cluster://n:port': bad port 'port'"),
    ("redis+cluster://", "spec.redis.url 'redis+cluster://': no hosts"),
])
def test_bad_sentinel_or_cluster_url_is_refused_by_name(url: str, message: str) -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(body(model={"name": "llama-2-7b"}, gpu={"type": "L4"}, redis={"url": url}))
    assert message in str(err.value) and err.value.reason == "InvalidRedisURL"


def test_unknown_redis_scheme_is_a_schema_violation() -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(body(model={"name": "llama-2-7b"}, gpu={"type": "L4"},
                        redis={"url": "redis+valkey://v:6379"}))
    assert "spec.redis.url: 'redis+valkey://v:6379' does not match" in str(err.value)


@pytest.mark.parametrize("text, value", [("4Gi", 4 << 30), ("500M", 500_000_000), (1024, 1024),
                                         ("1.5Gi", 3 << 29)])
def test_parse_quantity(text: object, value: int) -> None:
    assert parse_quantity(text) == value


def test_parse_quantity_refuses_garbage() -> None:
    with pytest.raises(InvalidSpecError):
        parse_quantity("lots")
