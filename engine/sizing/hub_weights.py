"""A hub model's config.json and safetensors headers through `huggingface_hub`, without the
tensors: the repo's file list, two small JSON files and a range request per shard. The endpoint is
`HF_ENDPOINT` (read at call time, so a mirror set after import still counts) and the token
`HF_TOKEN` unless given; a model already in the local HF cache is read from there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvserve.engine.sizing.weights_size import (
    INDEX_FILE, Checkpoint, CheckpointReadError, local_checkpoint, shard_names, summarize, tied,
)

DEFAULT_ENDPOINT = "https://huggingface.co"


def hub_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _translate(exc: Exception, repo_id: str, revision: str, endpoint: str) -> CheckpointReadError:
    """huggingface_hub's and its HTTP client's errors as one typed error with a reason."""
    from huggingface_hub import errors

    where = f"{repo_id}@{revision} on {endpoint}"
    if isinstance(exc, errors.GatedRepoError):
        return CheckpointReadError(
            f"{where} is gated: accept its licence on the hub and give a token with access "
            "(spec.model.tokenSecretRef, or HF_TOKEN)", "ModelGated")
    if isinstance(exc, errors.RevisionNotFoundError):
        return CheckpointReadError(f"{where}: no such revision", "ModelNotFound")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return CheckpointReadError(
            f"{where}: no such model, or it is private and the token (if any) has no access",
            "ModelNotFound")
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        transient = status == 429 or status >= 500
        return CheckpointReadError(f"{where}: the hub answered HTTP {status}",
                                   "ModelUnreachable" if transient else "ModelUnreadable",
                                   transient)
    if isinstance(exc, (*_transport_errors(), OSError)):
        return CheckpointReadError(f"cannot reach {endpoint} for {repo_id}: {exc}",
                                   "ModelUnreachable", transient=True)
    if isinstance(exc, (errors.SafetensorsParsingError, ValueError)):
        return CheckpointReadError(f"{where}: {exc}")
    raise exc


def _transport_errors() -> tuple[type[Exception], ...]:
    """Connection and timeout errors of the HTTP client huggingface_hub uses (httpx2 in 2.x,
    httpx before)."""
    found = []
    for module in ("httpx2", "httpx"):
        try:
            found.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _get_json(api: Any, repo_id: str, filename: str, revision: str,
              token: str | None) -> dict[str, Any]:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import get_session, hf_raise_for_status

    url = hf_hub_url(repo_id, filename, revision=revision, endpoint=api.endpoint)
    response = get_session().get(url, headers=api._build_hf_headers(token=token),
                                 follow_redirects=True, timeout=30)
    hf_raise_for_status(response)
    try:
        return json.loads(response.content)
    except json.JSONDecodeError as exc:
        raise CheckpointReadError(f"{repo_id}/{filename}@{revision} is not JSON: {exc}") from exc


def hub_checkpoint(repo_id: str, revision: str = "main", token: str | None = None,
                   endpoint: str | None = None) -> Checkpoint:
    """config.json and every shard's header of a hub repo; CheckpointReadError on failure."""
    from huggingface_hub import HfApi

    endpoint = hub_endpoint(endpoint)
    api = HfApi(endpoint=endpoint, token=token or os.environ.get("HF_TOKEN") or False)
    try:
        info = api.model_info(repo_id, revision=revision)
        files = [s.rfilename for s in info.siblings or []]
        if "config.json" not in files:
            raise CheckpointReadError(f"{repo_id}@{revision} has no config.json: not a "
                                      "transformers model", "ModelUnreadable")
        config = _get_json(api, repo_id, "config.json", revision, api.token)
        index = (_get_json(api, repo_id, INDEX_FILE, revision, api.token)
                 if INDEX_FILE in files else None)
        shards = shard_names(files, index)
        if not shards:
            raise CheckpointReadError(f"{repo_id}@{revision} has no *.safetensors weights "
                                      "(.bin checkpoints cannot be sized from headers)")
        headers = [_tensors(api.parse_safetensors_file_metadata(repo_id, name, revision=revision))
                   for name in shards]
    except CheckpointReadError:
        raise
    except Exception as exc:  # noqa: BLE001 - translated, or re-raised when unknown
        raise _translate(exc, repo_id, revision, endpoint) from exc
    source = f"{endpoint}/{repo_id}@{revision}"
    return Checkpoint(config, summarize(headers, source, len(shards), tied(config)),
                      {"sha": info.sha})


def _tensors(meta: Any) -> dict[str, dict]:
    """huggingface_hub's TensorInfo objects as header entries."""
    return {name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
            for name, t in meta.tensors.items()}


def cached_folder(repo_id: str, revision: str = "main") -> Path | None:
    """The snapshot of a hub repo already in the local HF cache (config.json present), or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return Path(found).parent if isinstance(found, str) else None


def read_checkpoint(model: str, revision: str = "main", token: str | None = None,
                    endpoint: str | None = None, use_cache: bool = True) -> Checkpoint:
    """A local folder, else a hub id from the HF cache (when it holds the weights), else the hub."""
    path = Path(model).expanduser()
    if path.exists():
        return local_checkpoint(path)
    if use_cache and (folder := cached_folder(model, revision)) is not None:
        try:
            return local_checkpoint(folder)
        except CheckpointReadError:
            pass  # a cache with config.json only (a tokenizer download): ask the hub
    return hub_checkpoint(model, revision, token, endpoint)
