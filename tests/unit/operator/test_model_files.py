"""Sizing a model from its own files through a real HTTP server that answers like the hub's file
API: huggingface_hub's model info, config.json, the shard index and range requests on the
safetensors; gated (401), missing (404) and unreachable endpoints; the operator's status
conditions, its token Secret, `kvserve plan` on a folder and on a hub id."""

from __future__ import annotations

import argparse
import base64
import json
import socket
from pathlib import Path

import kubernetes_validate
import pytest
from hub_server import HubServer
from tiny_families import build_family, tensor_bytes

from kvserve.engine.sizing.hub_weights import hub_checkpoint
from kvserve.engine.sizing.weights_size import CheckpointReadError, local_checkpoint
from kvserve.operator.cli import register
from kvserve.operator.model_files import ModelReader, ModelReadError
from kvserve.operator.resources import desired_objects, names
from kvserve.operator.sizing import plan
from kvserve.operator.spec import parse_spec

TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub")
    out = {name: build_family(name, root / name)[0] for name in ("qwen3", "gemma3", "gpt_oss")}
    out["mixtral"] = build_family("mixtral", root / "mixtral", max_shard_size="100KB")[0]
    return out


@pytest.fixture(scope="module")
def hub(folders):
    server = HubServer()
    for name, folder in folders.items():
        server.add_folder(f"acme/tiny-{name}", folder)
    server.add_folder("acme/gated", folders["qwen3"], token=TOKEN)
    server.start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def no_ambient_hub(monkeypatch, tmp_path) -> None:
    """No token or endpoint from the machine, and an empty HF cache."""
    for var in ("HF_TOKEN", "HF_ENDPOINT", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "gpt_oss", "mixtral"])
def test_hub_headers_by_range_requests_equal_the_real_tensors(hub, folders, name) -> None:
    before = len(hub.requests)
    remote = hub_checkpoint(f"acme/tiny-{name}", endpoint=hub.url)
    local = local_checkpoint(folders[name])
    assert remote.weights.total_bytes == tensor_bytes(folders[name])
    assert remote.weights.params_by_dtype == local.weights.params_by_dtype
    assert remote.config == local.config
    shards = [r for r in hub.requests[before:] if r.path.endswith(".safetensors")]
    assert len(shards) >= len(list(folders[name].glob("*.safetensors")))
    assert all(r.range and r.range.startswith("bytes=") for r in shards if r.method == "GET")
    if name == "mixtral":  # the index was read and every shard ranged
        assert remote.weights.num_files > 1
        assert any(r.path.endswith("model.safetensors.index.json") for r in hub.requests[before:])


def test_hf_endpoint_from_the_environment(hub, monkeypatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    assert hub_checkpoint("acme/tiny-qwen3").weights.parameters > 0


def test_gated_model_needs_the_token(hub) -> None:
    with pytest.raises(CheckpointReadError) as err:
        hub_checkpoint("acme/gated", endpoint=hub.url)
    assert (err.value.reason, err.value.transient) == ("ModelGated", False)
    assert "gated" in str(err.value) and "tokenSecretRef" in str(err.value)
    weights = hub_checkpoint("acme/gated", endpoint=hub.url, token=TOKEN).weights
    assert weights.parameters == hub_checkpoint("acme/tiny-qwen3", endpoint=hub.url
                                                ).weights.parameters


def test_missing_and_unreachable_models_are_typed(hub) -> None:
    with pytest.raises(CheckpointReadError) as err:
        hub_checkpoint("acme/no-such-model", endpoint=hub.url)
    assert (err.value.reason, err.value.transient) == ("ModelNotFound", False)
    url = closed_port_url()
    with pytest.raises(CheckpointReadError) as err:
        hub_checkpoint("acme/tiny-qwen3", endpoint=url)
    assert (err.value.reason, err.value.transient) == ("ModelUnreachable", True)
    assert url in str(err.value)


def service(model: dict, **spec) -> dict:
    return {"metadata": {"name": "svc", "namespace": "ml", "uid": "u-1", "generation": 1},
            "spec": {"model": model, "device": "cpu",
                     "resources": {"limits": {"memory": "1Gi"}}, **spec}}


def test_uncatalogued_hub_model_is_sized_from_its_headers(hub, folders) -> None:
    body = service({"uri": "hf://acme/tiny-gemma3"},
                   env=[{"name": "HF_ENDPOINT", "value": hub.url}])
    spec = parse_spec(body, ModelReader())
    sizing = plan(spec)
    weights = local_checkpoint(folders["gemma3"]).weights
    assert sizing.weight_bytes == weights.resident_bytes(4)  # float32 on a CPU pod
    assert sizing.model_source.startswith("files: ") and hub.url in sizing.model_source
    # 5 of 6 layers slide over 32 tokens: far more 512-token requests fit with capping.
    assert sizing.max_concurrency_windowed > 3 * sizing.max_concurrency
    status = sizing.as_status()
    assert status["maxConcurrencyWindowed"] == sizing.max_concurrency_windowed


def test_without_a_reader_an_uncatalogued_model_is_refused(hub) -> None:
    with pytest.raises(ModelReadError.__mro__[1]) as err:  # InvalidSpecError
        parse_spec(service({"uri": "hf://acme/tiny-gemma3"}))
    assert err.value.reason == "UnknownModel"


class SecretStore:
    """The one call ModelReader makes of the Kubernetes client: get a Secret."""

    def __init__(self, secrets: dict[tuple[str, str], dict]) -> None:
        self.secrets = secrets

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        assert (api_version, kind) == ("v1", "Secret")
        return self.secrets.get((namespace, name))


def test_gated_model_token_from_the_named_secret_reaches_the_read_and_the_pods(hub) -> None:
    model = {"uri": "hf://acme/gated", "tokenSecretRef": {"name": "hub-token"}}
    body = service(model, env=[{"name": "HF_ENDPOINT", "value": hub.url}])
    with pytest.raises(ModelReadError) as err:  # the Secret is not there yet: retry later
        parse_spec(body, ModelReader(kube=SecretStore({})))
    assert (err.value.reason, err.value.transient) == ("ModelTokenUnavailable", True)
    secret = {"data": {"token": base64.b64encode(TOKEN.encode()).decode()}}
    spec = parse_spec(body, ModelReader(kube=SecretStore({("ml", "hub-token"): secret})))
    assert hub.requests[-1].authorization == f"Bearer {TOKEN}"
    objects = desired_objects(spec, plan(spec))
    wanted = {names(spec)["engine"], names(spec)["router"]}
    deployments = [o for o in objects if o["kind"] == "Deployment"
                   and o["metadata"]["name"] in wanted]
    assert len(deployments) == 2
    for dep in deployments:
        kubernetes_validate.validate(dep, "1.31", strict=True)
        env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "hub-token", "key": "token"}}} in env
    assert TOKEN not in json.dumps(objects)  # only the reference, never the value


def test_reader_caches_answers_and_failures(hub) -> None:
    reader = ModelReader()
    body = service({"uri": "hf://acme/tiny-qwen3"},
                   env=[{"name": "HF_ENDPOINT", "value": hub.url}])
    parse_spec(body, reader)
    seen = len(hub.requests)
    parse_spec(body, reader)
    assert len(hub.requests) == seen  # a resync does not re-read the hub
    missing = service({"uri": "hf://acme/nope"}, env=[{"name": "HF_ENDPOINT", "value": hub.url}])
    for _ in range(3):
        with pytest.raises(ModelReadError):
            parse_spec(missing, reader)
    assert len(hub.requests) == seen + 1  # one model-info call, then the cached failure


def run_plan(capsys, argv: list[str]) -> tuple[int, str, str]:
    p = argparse.ArgumentParser(prog="kvserve")
    register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["plan", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_a_local_gemma3_folder(capsys, folders) -> None:
    code, out, err = run_plan(capsys, ["--model", str(folders["gemma3"]), "--device", "cpu",
                                       "--memory", "1Gi", "--output", "json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["weightBytes"] == local_checkpoint(folders["gemma3"]).weights.resident_bytes(4)
    assert data["maxConcurrencyWindowed"] > data["maxConcurrency"]
    assert data["modelSource"].startswith("files: ")


def test_plan_a_hub_id_through_hf_endpoint(capsys, hub, monkeypatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    code, out, err = run_plan(capsys, ["--model", "acme/tiny-qwen3", "--gpu", "L4",
                                       "--output", "json"])
    assert code == 0, err
    assert json.loads(out)["weightBytes"] == hub_checkpoint("acme/tiny-qwen3").weights.\
        resident_bytes(2)  # bf16 on a GPU
    code, _, err = run_plan(capsys, ["--model", "acme/nope", "--gpu", "L4"])
    assert code == 2 and "ModelNotFound" in err and "acme/nope" in err
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    code, _, err = run_plan(capsys, ["--model", "acme/tiny-qwen3", "--gpu", "L4"])
    assert code == 2 and "ModelUnreachable" in err and "cannot reach" in err


def test_plan_reads_a_hub_model_from_the_hf_cache_without_the_network(capsys, folders,
                                                                      monkeypatch) -> None:
    from huggingface_hub import hf_hub_download

    hub = HubServer()
    hub.add_folder("acme/cached-qwen3", folders["qwen3"])
    hub.start()
    try:
        for name in ("config.json", "model.safetensors"):  # into HF_HOME's cache
            hf_hub_download("acme/cached-qwen3", name, endpoint=hub.url)
    finally:
        hub.stop()
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())  # the hub is gone now
    code, out, err = run_plan(capsys, ["--model", "acme/cached-qwen3", "--gpu", "L4",
                                       "--output", "json"])
    assert code == 0, err
    assert json.loads(out)["weightBytes"] == local_checkpoint(folders["qwen3"]).weights.\
        resident_bytes(2)
