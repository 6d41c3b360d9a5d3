"""spec.adapters: parsing (every refusal names the adapter), the flags and env the engine and
router pods get, the fetch Job (valid Kubernetes), and the pure plan of loads and unloads."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvserve.operator import adapters as lora
from kvserve.operator.adapter_sync import AdapterAction, plan, status_entries
from kvserve.operator.children import build_children
from kvserve.operator.errors import InvalidSpecError
from kvserve.operator.spec import parse_spec

EXAMPLE = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "llama-3-8b-lora.yaml"
W = "/var/lib/kvserve/weights"


def body(**spec: object) -> dict:
    b = yaml.safe_load(EXAMPLE.read_text())
    b["metadata"].update(namespace="ml", uid="uid-1")
    b["spec"].update(spec)
    return b


def by_kind(objs: list[dict], kind: str, name_part: str = "") -> dict:
    return next(o for o in objs if o["kind"] == kind and name_part in o["metadata"]["name"])


def test_adapters_resolve_to_the_paths_replicas_load():
    spec = parse_spec(body())
    assert lora.registry(spec) == {
        "sql-lora": f"{W}/adapters/yard1--llama-2-7b-sql-lora-test",
        "chat-lora": f"{W}/adapters/my-org--llama-3-8b-chat-lora",
        "support-lora": f"{W}/adapters/support"}
    chat = spec.adapters[1]
    assert chat.fetched and chat.location.revision == "v2"
    assert not spec.adapters[2].fetched  # already on the claim


def test_engine_pods_get_lora_flags_but_no_adapter_list_and_the_router_gets_the_registry():
    objs = build_children(body()).objects
    engine = by_kind(objs, "Deployment", "engine")["spec"]["template"]["spec"]
    args, env = engine["containers"][0]["args"], engine["containers"][0]["env"]
    assert args[args.index("--max-loras") + 1] == "4" and "--enable-lora" in args
    assert args[args.index("--max-lora-rank") + 1] == "64"
    assert "--lora-modules" not in args  # adapters are loaded at run time: no restart
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"} in env
    router = by_kind(objs, "Deployment", "router")["spec"]["template"]["spec"]
    rargs = router["containers"][0]["args"]
    i = rargs.index("--lora-modules")
    assert rargs[i + 1:i + 4] == [f"{n}={p}" for n, p in lora.registry(parse_spec(body())).items()]


def test_adding_an_adapter_changes_no_engine_pod_template():
    before = build_children(body()).objects
    more = body()
    more["spec"]["adapters"] = more["spec"]["adapters"] + [{"name": "x", "uri": "/opt/x"}]
    fewer = body(adapters=[{"name": "x", "uri": "/opt/x"}])
    for other in (more, fewer):
        after = build_children(other).objects
        assert by_kind(after, "Deployment", "engine") == by_kind(before, "Deployment", "engine")
        assert by_kind(after, "Deployment", "router") != by_kind(before, "Deployment", "router")


def test_the_fetch_job_is_valid_and_named_by_the_hub_adapters():
    objs = build_children(body()).objects
    job = by_kind(objs, "Job")
    kubernetes_validate.validate(job, "1.31", strict=True)
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--cache") + 1] == W
    assert [cmd[i + 1] for i, c in enumerate(cmd) if c == "--adapter"] == [
        "hf://yard1/llama-2-7b-sql-lora-test:main", "hf://my-org/llama-3-8b-chat-lora:v2"]
    mounts = job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "weights", "mountPath": W} in mounts  # writable, unlike the engine's
    # Another hub adapter: another Job (a Job's template cannot change); a local one: the same.
    b = body()
    b["spec"]["adapters"].append({"name": "y", "uri": "hf://o/y"})
    assert by_kind(build_children(b).objects, "Job")["metadata"]["name"] != \
        job["metadata"]["name"]
    b = body()
    b["spec"]["adapters"].append({"name": "y", "uri": "/opt/y"})
    assert by_kind(build_children(b).objects, "Job")["metadata"]["name"] == \
        job["metadata"]["name"]
    b = body(adapters=[{"name": "y", "uri": "/opt/y"}])
    assert not [o for o in build_children(b).objects if o["kind"] == "Job"]


def test_no_adapters_no_lora():
    b = body()
    del b["spec"]["adapters"]
    b["spec"]["engine"].pop("lora")
    objs = build_children(b).objects
    args = by_kind(objs, "Deployment", "engine")["spec"]["template"]["spec"]["containers"][0][
        "args"]
    assert "--enable-lora" not in args
    b["spec"]["engine"]["lora"] = {"enabled": True}  # on ahead of the first adapter
    args = by_kind(build_children(b).objects, "Deployment", "engine")["spec"]["template"][
        "spec"]["containers"][0]["args"]
    assert "--enable-lora" in args


@pytest.mark.parametrize("adapters, model, reason", [
    ([{"name": "a", "uri": "hf://o/a"}, {"name": "a", "uri": "hf://o/b"}], None, "used twice"),
    ([{"name": "llama-3-8b", "uri": "/opt/a"}], None, "served model's own name"),
    ([{"name": "a", "uri": "s3://b/a"}], None, "s3:// is planned"),
    ([{"name": "a", "uri": "pvc://other/a"}], None, "not the claim the engine pods mount"),
    ([{"name": "a", "uri": "some-name"}], None, "write hf://ORG/NAME"),
    ([{"name": "a", "uri": "hf://o/a"}], {"name": "llama-3-8b"}, "set spec.model.cache"),
    ([{"name": "bad name", "uri": "/opt/a"}], None, "does not match"),
])
def test_bad_adapters_are_refused_naming_them(adapters, model, reason):
    b = body(adapters=adapters)
    if model is not None:
        b["spec"]["model"] = model
    with pytest.raises(InvalidSpecError, match=reason):
        parse_spec(b)


def test_plan_loads_what_pods_lack_and_unloads_what_left_the_spec():
    desired = {"a": "/w/a", "b": "/w/b", "c": "/w/c"}
    held = {"p1": {"a": "/w/a", "old": "/w/old"}, "p2": {}, "p3": {"b": "/w/b-v1"}}
    acts = plan(desired, held, loadable={"a", "b"})  # c is still being fetched
    assert acts == [
        AdapterAction("p1", "unload", "old"), AdapterAction("p1", "load", "b", "/w/b"),
        AdapterAction("p2", "load", "a", "/w/a"), AdapterAction("p2", "load", "b", "/w/b"),
        # b's path changed (a new uri under the same name): out, then in again.
        AdapterAction("p3", "unload", "b"), AdapterAction("p3", "load", "a", "/w/a"),
        AdapterAction("p3", "load", "b", "/w/b")]
    synced = {p: dict(desired) for p in held}
    assert plan(desired, synced, set(desired)) == []  # nothing to do twice
    assert plan({}, held, set()) == [AdapterAction("p1", "unload", "a"),
                                     AdapterAction("p1", "unload", "old"),
                                     AdapterAction("p3", "unload", "b")]


def test_status_lists_where_each_adapter_is_loaded():
    spec = parse_spec(body())
    sql, chat, support = (a.path for a in spec.adapters)
    held = {"e-1": {"sql-lora": sql, "support-lora": support}, "e-2": {"sql-lora": sql}}
    entries = status_entries(spec, held, {"chat-lora": "being fetched"})
    assert entries == [
        {"name": "sql-lora", "uri": "hf://yard1/llama-2-7b-sql-lora-test",
         "loadedOn": ["e-1", "e-2"]},
        {"name": "chat-lora", "uri": "hf://my-org/llama-3-8b-chat-lora:v2", "loadedOn": [],
         "message": "being fetched"},
        {"name": "support-lora", "uri": "pvc://llama-3-8b-lora-weights/adapters/support",
         "loadedOn": ["e-1"]}]
