"""Keep the running engine pods' LoRA adapters equal to spec.adapters, without a restart: vLLM's
`POST /v1/load_lora_adapter` / `unload_lora_adapter` on each pod, what each pod holds read from
its `/v1/models` (adapters are the entries with a `parent`), and status.adapters saying where
each one is loaded. `plan` decides (a pure function); `sync` does the HTTP and the status.

Hub adapters are loaded once the fetch Job (operator/adapters.py) has put them in the weights
cache. Runs when spec.adapters changes and at each resync, so new pods (a scale-up, a restart)
get the adapters too (the router also loads one on demand)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.operator.adapters import fetch_job_name, lora_enabled
from kvserve.operator.kube import KubeClient
from kvserve.operator.spec import ServiceSpec

LOAD_TIMEOUT_S = 120.0
Held = Mapping[str, Mapping[str, str]]  # pod -> {adapter name: the path it was loaded from}


@dataclass(frozen=True)
class AdapterAction:
    pod: str
    verb: str  # "load" | "unload"
    name: str
    path: str = ""


def plan(desired: Mapping[str, str], held: Held, loadable: set[str] | frozenset[str]
         ) -> list[AdapterAction]:
    """What to do on each pod: unload adapters that left the spec or whose path changed, load
    the spec's adapters a pod lacks (only `loadable` ones: a hub adapter waits for its fetch)."""
    actions = []
    for pod in sorted(held):
        have = held[pod]
        for name in sorted(have):
            if name not in desired or have[name] != desired[name]:
                actions.append(AdapterAction(pod, "unload", name))
        for name in sorted(desired):
            if name in loadable and have.get(name) != desired[name]:
                actions.append(AdapterAction(pod, "load", name, desired[name]))
    return actions


def status_entries(spec: ServiceSpec, held: Held, problems: Mapping[str, str]) -> list[dict]:
    """status.adapters: each spec adapter, the pods holding it, and why not everywhere."""
    out = []
    for a in spec.adapters:
        entry: dict[str, Any] = {"name": a.name, "uri": a.uri, "loadedOn": sorted(
            pod for pod, have in held.items() if have.get(a.name) == a.path)}
        if a.name in problems:
            entry["message"] = problems[a.name]
        out.append(entry)
    return out


@dataclass
class SyncResult:
    held: dict[str, dict[str, str]]
    problems: dict[str, str] = field(default_factory=dict)  # adapter (or pod) -> what failed

    @property
    def complete(self) -> bool:
        return not self.problems


def default_pod_url(pod: dict) -> str | None:
    from kvserve.operator.resources import PORT

    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{PORT}" if ip else None


def sync(spec: ServiceSpec, kube: KubeClient,
         pod_url: Callable[[dict], str | None] = default_pod_url,
         http: httpx.Client | None = None) -> SyncResult:
    """Read every running engine pod's adapters, load and unload to match the spec."""
    from kvserve.operator.resources import selector, selector_string

    desired = {a.name: a.path for a in spec.adapters}
    problems: dict[str, str] = {}
    loadable = set(desired)
    job = fetch_job_name(spec)
    if job is not None and not _succeeded(kube.get("batch/v1", "Job", spec.namespace, job)):
        for a in spec.adapters:
            if a.fetched:
                loadable.discard(a.name)
                problems[a.name] = f"being fetched into the weights cache (Job {job})"
    client = http or httpx.Client(timeout=LOAD_TIMEOUT_S)
    try:
        match = selector(spec, "engine").items()
        urls = {p["metadata"]["name"]: pod_url(p)
                for p in kube.list("v1", "Pod", spec.namespace, selector_string(spec))
                if _running(p) and match <= (p["metadata"].get("labels") or {}).items()}
        held: dict[str, dict[str, str]] = {}
        for pod, url in sorted(urls.items()):
            have = _read_adapters(client, url) if url else None
            if have is None:
                problems.setdefault(pod, f"pod {pod} did not answer /v1/models")
            else:
                held[pod] = have
        for act in plan(desired, held, loadable):
            error = _call(client, urls[act.pod], act)
            if error is None:
                _record(held[act.pod], act)
            else:
                problems[act.name] = f"{act.verb} on pod {act.pod} failed: {error}"
    finally:
        if http is None:
            client.close()
    return SyncResult(held, problems)


def _running(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running" and \
        not pod["metadata"].get("deletionTimestamp")


def _succeeded(job: dict | None) -> bool:
    return bool(job) and ((job.get("status") or {}).get("succeeded") or 0) >= 1


def _read_adapters(client: httpx.Client, url: str) -> dict[str, str] | None:
    try:
        resp = client.get(url + "/v1/models", timeout=10.0)
        data = resp.json()["data"] if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(data, list):
        return None
    return {m["id"]: str(m.get("root") or "") for m in data
            if isinstance(m, dict) and m.get("parent") and isinstance(m.get("id"), str)}


def _call(client: httpx.Client, url: str | None, act: AdapterAction) -> str | None:
    """The error of one load/unload, None on success (a second load of a name is one)."""
    body = {"lora_name": act.name, **({"lora_path": act.path} if act.verb == "load" else {})}
    try:
        resp = client.post(f"{url}/v1/{act.verb}_lora_adapter", json=body)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if resp.status_code == 200:
        return None
    text = resp.text[:300]
    if act.verb == "load" and resp.status_code == 400 and "already" in text:
        return None
    if act.verb == "unload" and resp.status_code == 404:
        return None  # gone already (evicted, or a restart)
    return f"{resp.status_code}: {text}"


def _record(have: dict[str, str], act: AdapterAction) -> None:
    if act.verb == "load":
        have[act.name] = act.path
    else:
        have.pop(act.name, None)


def wanted(spec: ServiceSpec) -> bool:
    """Services with LoRA on (or adapters to take off) are synced; the others never touch pods."""
    return lora_enabled(spec)
