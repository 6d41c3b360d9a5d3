"""The weights-cache init container: fetch only when the marker (uri, revision, checksum) is stale."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from kvserve.operator import fetch
from kvserve.operator.model_uri import ModelURI, parse_model_uri

class FakeHub:
    """Writes a small model folder and counts downloads (stands in for the network only)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, location: ModelURI, target: Path) -> None:
        self.calls.append((location.path, location.revision))
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"w" * 64)


def test_second_pod_reuses_the_cache(tmp_path: Path) -> None:
    hub = FakeHub()
    loc = parse_model_uri("hf://org/model:v1")
    assert fetch.ensure(loc, tmp_path, {"hf": hub}) is True
    assert fetch.ensure(loc, tmp_path, {"hf": hub}) is False  # the next pod, a scale-up
    assert hub.calls == [("org/model", "v1")]
    marker = json.loads((tmp_path / "models" / "org--model" / fetch.MARKER).read_text())
    assert (marker["uri"], marker["revision"]) == ("org/model", "v1")
    assert len(marker["checksum"]) == 64


def test_new_revision_or_damaged_weights_fetch_again(tmp_path: Path) -> None:
    hub = FakeHub()
    fetch.ensure(parse_model_uri("hf://org/model:v1"), tmp_path, {"hf": hub})
    assert fetch.ensure(parse_model_uri("hf://org/model:v2"), tmp_path, {"hf": hub}) is True
    weights = tmp_path / "models" / "org--model" / "model.safetensors"
    weights.write_bytes(b"w" * 10)  # an interrupted copy
    assert fetch.ensure(parse_model_uri("hf://org/model:v2"), tmp_path, {"hf": hub}) is True
    assert weights.stat().st_size == 64
    assert [rev for _, rev in hub.calls] == ["v1", "v2", "v2"]


def test_a_folder_without_marker_is_refetched(tmp_path: Path) -> None:
    """Weights left by a fetch that died before writing the marker are not trusted."""
    hub = FakeHub()
    partial = tmp_path / "models" / "org--model"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    assert fetch.ensure(parse_model_uri("org/model"), tmp_path, {"hf": hub}) is True


def test_known_names_go_through_kvserve_fetch_model(tmp_path: Path, default_model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `kvserve fetch-model` CLI, run as the init container runs it; the claim is
    seeded with the default model (conftest's fixture fetches it once into the kvserve cache, as
    every default-model test does) so the CLI itself downloads nothing."""
    model = default_model_dir
    seeded = tmp_path / "models" / "smollm2-135m-instruct"
    seeded.mkdir(parents=True)
    for item in model.iterdir():
        (seeded / item.name).symlink_to(item)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    calls: list[str] = []
    real = fetch.fetch_with_cli

    def spy(location: ModelURI, target: Path) -> None:
        calls.append(location.path)
        target.mkdir(parents=True)  # the stale folder was removed: seed it again, then run
        for item in model.iterdir():
            (target / item.name).symlink_to(item)
        real(location, target)

    loc = parse_model_uri("smollm2-135m-instruct")
    assert fetch.ensure(loc, tmp_path, {"name": spy}) is True
    assert fetch.ensure(loc, tmp_path, {"name": spy}) is False
    assert calls == ["smollm2-135m-instruct"]


def test_cli_reports_unfetchable_uris(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert fetch.main(["--uri", "s3://bucket/x", "--cache", str(tmp_path)]) == 1
    assert "s3:// is planned" in capsys.readouterr().err


def test_adapters_go_to_their_own_folder_with_a_marker(tmp_path: Path) -> None:
    """The adapter Job's fetch: <cache>/adapters/<slug>, once; a model of the same hub id is a
    different folder."""
    hub = FakeHub()
    loc = parse_model_uri("hf://org/sql-lora:v2")
    assert fetch.ensure(loc, tmp_path, {"hf": hub}, kind="adapters") is True
    assert fetch.ensure(loc, tmp_path, {"hf": hub}, kind="adapters") is False
    assert (tmp_path / "adapters" / "org--sql-lora" / fetch.MARKER).is_file()
    assert not (tmp_path / "models").exists()
    assert hub.calls == [("org/sql-lora", "v2")]


def test_the_cli_refuses_adapters_it_cannot_fetch(tmp_path: Path, capsys) -> None:
    assert fetch.main(["--cache", str(tmp_path), "--adapter", "/opt/adapters/x"]) == 1
    assert "only hub adapters are fetched" in capsys.readouterr().err
    assert fetch.main(["--cache", str(tmp_path)]) == 2  # nothing to fetch: a wrong Job
