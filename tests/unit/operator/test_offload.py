"""spec.engine.kvOffloading: engine flags the real serve CLI accepts, pod memory grown by the host
tier, the disk tier's volume, valid Kubernetes, impossible specs refused, the tiers in the plan."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvserve.operator.children import build_children
from kvserve.operator.offload import DISK_PATH
from kvserve.operator.resources import engine_args
from kvserve.operator.sizing import plan
from kvserve.operator.spec import GiB, InvalidSpecError, parse_quantity, parse_spec

EXAMPLES = Path(__file__).resolve().parents[3] / "manifests" / "examples"


def load(name: str, **offloading: object) -> dict:
    body = yaml.safe_load((EXAMPLES / name).read_text())
    body["metadata"].update(namespace="ml", uid="uid-1")
    if offloading:
        body["spec"].setdefault("engine", {})["kvOffloading"] = offloading
    return body


def engine(body: dict) -> tuple[dict, dict]:
    """(pod spec, engine container) of the engine Deployment."""
    dep = next(o for o in build_children(body).objects
               if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-engine"))
    pod = dep["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def serve_config(body: dict):  # noqa: ANN201 - the engine's EngineConfig
    from kvserve.service.cli import build_parser, engine_config_from_args

    spec = parse_spec(body)
    return engine_config_from_args(build_parser().parse_args(engine_args(spec, plan(spec))))


def test_host_and_disk_flags_parse_with_the_real_serve_cli() -> None:
    config = serve_config(load("smollm2-cpu-kind.yaml", hostGiB=2, diskGiB=10.5))
    assert config.kv_offloading_size == 2.0
    assert (config.kv_offloading_disk_path, config.kv_offloading_disk_size) == (DISK_PATH, 10.5)
    assert config.enable_prefix_caching is True


def test_without_offloading_the_engine_gets_no_tier() -> None:
    config = serve_config(load("smollm2-cpu-kind.yaml"))
    assert config.kv_offloading_size == 0 and config.kv_offloading_disk_path is None


def test_cpu_pod_memory_grows_by_the_host_tier_and_the_kv_budget_stays() -> None:
    plain, tiered = load("smollm2-cpu-kind.yaml"), load("smollm2-cpu-kind.yaml", hostGiB=1.5)
    _, before = engine(plain)
    _, after = engine(tiered)
    for kind in ("requests", "limits"):
        grown = parse_quantity(after["resources"][kind]["memory"])
        assert grown == parse_quantity(before["resources"][kind]["memory"]) + int(1.5 * GiB)
    assert after["resources"]["limits"]["memory"] == "5632Mi"  # 4Gi + 1.5Gi
    # The device (KV) budget is planned within the user's limit; the tier comes on top.
    assert plan(parse_spec(tiered)).kv_bytes == plan(parse_spec(plain)).kv_bytes
    assert "--kv-cache-memory" in after["args"]


def test_gpu_pod_without_memory_gets_a_request_for_the_host_tier() -> None:
    body = load("llama-2-7b-a100.yaml", hostGiB=64)
    body["spec"].pop("resources", None)
    _, container = engine(body)
    assert container["resources"]["requests"]["memory"] == "64Gi"
    assert "memory" not in container["resources"]["limits"]  # no limit the user did not ask for
    _, user = engine(load("llama-3-70b-h100-fp8.yaml", hostGiB=100))
    assert user["resources"]["limits"]["memory"] == "500Gi"  # the user's 400Gi + the tier


def test_disk_tier_is_an_empty_dir_with_a_size_limit_mounted_where_the_flag_points() -> None:
    pod, container = engine(load("smollm2-cpu-kind.yaml", hostGiB=1, diskGiB=20))
    vol = next(v for v in pod["volumes"] if v["name"] == "kv-offload")
    assert vol == {"name": "kv-offload", "emptyDir": {"sizeLimit": "20Gi"}}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "kv-offload")
    args = container["args"]
    assert mount["mountPath"] == args[args.index("--kv-offloading-disk-path") + 1] == DISK_PATH
    assert container["resources"]["requests"]["ephemeral-storage"] == "20Gi"


def test_disk_tier_on_a_claim() -> None:
    body = load("smollm2-cpu-kind.yaml", hostGiB=1, diskGiB=20, diskClaimName="kv-disk")
    body["spec"]["replicas"] = 1
    pod, container = engine(body)
    vol = next(v for v in pod["volumes"] if v["name"] == "kv-offload")
    assert vol == {"name": "kv-offload", "persistentVolumeClaim": {"claimName": "kv-disk"}}
    assert "ephemeral-storage" not in container["resources"].get("requests", {})
    # The engine locks its directory: the old pod must let go before the new one starts.
    dep = next(o for o in build_children(body).objects if o["kind"] == "Deployment"
               and o["metadata"]["name"].endswith("-engine"))
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    plain = next(o for o in build_children(load("smollm2-cpu-kind.yaml", hostGiB=1, diskGiB=2))
                 .objects if o["kind"] == "Deployment" and o["metadata"]["name"] ==
                 "smollm2-engine")
    assert plain["spec"]["strategy"]["type"] == "RollingUpdate"  # an emptyDir is per pod


@pytest.mark.parametrize("name, tiers", [
    ("smollm2-cpu-kind.yaml", {"hostGiB": 1, "diskGiB": 20}),
    ("llama-2-7b-a100.yaml", {"hostGiB": 64, "diskGiB": 200}),
    ("llama-3-70b-h100-fp8.yaml", {"hostGiB": 100}),
    ("llama-2-7b-a100.yaml", {"hostGiB": 64, "diskGiB": 200, "diskClaimName": "kv"}),
])
def test_objects_with_tiers_validate(name: str, tiers: dict) -> None:
    body = load(name, **tiers)
    if "diskClaimName" in tiers:  # one replica: the claim is one engine's directory
        body["spec"].pop("autoscaling", None)
        body["spec"]["replicas"] = 1
    for obj in build_children(body).objects:
        if obj["kind"] in ("Deployment", "Service", "ConfigMap", "PersistentVolumeClaim"):
            kubernetes_validate.validate(obj, "1.31", strict=True)


@pytest.mark.parametrize("name, tiers, replicas, reason, words", [
    ("smollm2-cpu-kind.yaml", {"diskGiB": 10}, None, "KVOffloadingWithoutHostTier",
     "diskGiB 10 needs hostGiB > 0"),
    ("smollm2-cpu-kind.yaml", {"hostGiB": 0, "diskGiB": 10}, None,
     "KVOffloadingWithoutHostTier", "needs hostGiB"),
    ("smollm2-cpu-kind.yaml", {"hostGiB": 1, "diskClaimName": "c"}, None, "InvalidSpec",
     "diskClaimName needs diskGiB"),
    ("smollm2-cpu-kind.yaml", {"hostGiB": 1, "diskGiB": 5, "diskClaimName": "c"}, 2,
     "InvalidSpec", "up to 2 engine replicas"),
    ("smollm2-cpu-kind.yaml", {"hostGiB": 0.0001}, None, "KVOffloadingTooSmall",
     "holds no KV block"),
    ("llama-3-70b-h100-fp8.yaml", {"hostGiB": 100, "diskGiB": 100}, None,
     "KVOffloadingDiskNeedsOneRank", "supports one rank"),
])
def test_impossible_tiers_are_refused(name: str, tiers: dict, replicas: int | None,
                                      reason: str, words: str) -> None:
    body = load(name, **tiers)
    if replicas is not None:
        body["spec"]["replicas"] = replicas
    with pytest.raises(InvalidSpecError, match=words) as info:
        build_children(body)
    assert info.value.reason == reason


def test_host_tier_needs_prefix_caching() -> None:
    body = load("smollm2-cpu-kind.yaml", hostGiB=1)
    body["spec"]["engine"]["enablePrefixCaching"] = False
    with pytest.raises(InvalidSpecError, match="enablePrefixCaching"):
        parse_spec(body)


def test_unknown_tier_field_is_refused_by_the_schema() -> None:
    with pytest.raises(InvalidSpecError, match="kvOffloading.hostGB: unknown field"):
        parse_spec(load("smollm2-cpu-kind.yaml", hostGB=1))


def test_plan_and_status_show_the_tiers() -> None:
    sizing = plan(parse_spec(load("smollm2-cpu-kind.yaml", hostGiB=2, diskGiB=10)))
    tiers = sizing.as_status()["kvOffloading"]
    assert tiers["hostBytes"] == 2 * GiB and tiers["diskBytes"] == 10 * GiB
    assert tiers["hostBlocks"] == 2 * GiB // sizing.bytes_per_block > 0
    assert tiers["diskVolume"] == "emptyDir"
    assert "host tier 2 GiB" in sizing.explanation and "disk tier 10 GiB" in sizing.explanation
    assert "kvOffloading" not in plan(parse_spec(load("smollm2-cpu-kind.yaml"))).as_status()


def test_plan_cli_prints_the_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.service.cli import main

    rc = main(["plan", "--model", "smollm2-135m", "--device", "cpu", "--memory", "4Gi",
               "--kv-offloading-size", "2", "--kv-offloading-disk-size", "10", "--output",
               "json"])
    out = yaml.safe_load(capsys.readouterr().out)
    assert rc == 0 and out["kvOffloading"]["hostBytes"] == 2 * GiB
    rc = main(["plan", "--model", "smollm2-135m", "--device", "cpu", "--memory", "4Gi",
               "--kv-offloading-disk-size", "10"])
    assert rc == 2 and "KVOffloadingWithoutHostTier" in capsys.readouterr().err


def test_changing_the_tier_rolls_the_pods() -> None:
    body = load("smollm2-cpu-kind.yaml", hostGiB=1)
    other = copy.deepcopy(body)
    other["spec"]["engine"]["kvOffloading"]["hostGiB"] = 2
    key = "kvserve.io/config-hash"

    def annotation(b: dict) -> str:
        dep = next(o for o in build_children(b).objects if o["kind"] == "Deployment"
                   and o["metadata"]["name"].endswith("-engine"))
        return dep["spec"]["template"]["metadata"]["annotations"][key]

    assert annotation(body) != annotation(other)
