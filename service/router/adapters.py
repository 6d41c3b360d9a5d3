"""The router's LoRA adapters: which are registered (`--lora-modules name=path`), which replica
holds which (their heartbeats, plus the loads this router just did), and loading one on a replica
through vLLM's `POST /v1/load_lora_adapter`.

Loads are single-flight: requests for an adapter no replica holds wait on the one load in flight
(and then go where it went); a replica is asked at most once at a time for the same adapter. A
load done here counts as "held" for `HOLD_S` seconds, until the replica's heartbeats say so."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from kvserve.service.prefix_index.replica_info import ReplicaInfo
from kvserve.service.router.metrics import RouterMetrics
from kvserve.service.routing_policy import Candidate

logger = logging.getLogger("kvserve.router")
LOAD_PATH = "/v1/load_lora_adapter"
# Long enough for two heartbeats and a router refresh to report a load done here.
HOLD_S = 5.0
# Headers of the triggering request passed on to the load (a replica with --api-key needs them).
_AUTH_HEADERS = ("authorization",)


class AdapterLoadError(RuntimeError):
    """A replica could not load a registered adapter (unreachable, or it refused the files)."""


class Adapters:
    """Registered adapters, their holders, and single-flight loads; one per router process."""

    def __init__(self, modules: Iterable[tuple[str, str]], metrics: RouterMetrics,
                 timeout: float = 120.0) -> None:
        self.paths: dict[str, str] = dict(modules)
        self.metrics, self.timeout = metrics, timeout
        self._recent: dict[str, dict[str, float]] = {}  # adapter -> {replica id: held until}
        self._loading: dict[tuple[str, str], asyncio.Task] = {}  # (adapter, replica) -> load

    def registered(self, name: str) -> bool:
        return name in self.paths

    def label(self, name: str) -> str:
        """The metrics label of an adapter: its name when registered (a bounded set)."""
        return name if name in self.paths else "unregistered"

    def adapter_of(self, model: Any, known: Mapping[str, ReplicaInfo]) -> str | None:
        """`model` when it names an adapter (registered or held by a replica), else None."""
        if not isinstance(model, str) or not model:
            return None
        if model in self.paths:
            return model
        return model if any(model in i.adapters for i in known.values()) else None

    def holders(self, name: str, known: Mapping[str, ReplicaInfo]) -> set[str]:
        """Replicas holding `name`: by their heartbeat, or loaded here within HOLD_S."""
        held = {rid for rid, info in known.items() if name in info.adapters}
        recent = self._recent.get(name)
        if recent:
            now = time.monotonic()
            for rid, until in list(recent.items()):
                if until > now:
                    held.add(rid)
                else:
                    del recent[rid]
        return held

    def in_flight(self, name: str) -> str | None:
        """A replica this adapter is being loaded on now, if any."""
        return next((rid for (n, rid) in self._loading if n == name), None)

    async def ensure(self, name: str, cand: Candidate, headers: Any = None,
                     join: bool = True) -> str:
        """Have `name` loaded on `cand` (or, with `join`, wait for a load of it in flight on any
        replica); the id of the replica that holds it. AdapterLoadError when the load failed."""
        rid = self.in_flight(name) if join else None
        key = (name, rid or cand.replica_id)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(name, cand, _auth(headers)))
            self._loading[key] = task
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        await asyncio.shield(task)
        return key[1]

    async def _load(self, name: str, cand: Candidate, headers: dict[str, str]) -> None:
        start = time.perf_counter()
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as http:
                resp = await http.post(cand.url.rstrip("/") + LOAD_PATH, headers=headers,
                                       json={"lora_name": name, "lora_path": self.paths[name]})
        except httpx.HTTPError as exc:
            self.metrics.adapter_loads.labels(name, "failed").inc()
            raise AdapterLoadError(f"replica {cand.replica_id} could not be asked to load LoRA "
                                   f"adapter {name!r}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200 and not _already_loaded(resp):
            self.metrics.adapter_loads.labels(name, "failed").inc()
            raise AdapterLoadError(f"replica {cand.replica_id} refused to load LoRA adapter "
                                   f"{name!r} from {self.paths[name]} ({resp.status_code}: "
                                   f"{_message(resp)})")
        seconds = time.perf_counter() - start
        self.metrics.adapter_loads.labels(name, "ok").inc()
        self.metrics.adapter_load_seconds.observe(seconds)
        self._recent.setdefault(name, {})[cand.replica_id] = time.monotonic() + HOLD_S
        logger.info("loaded LoRA adapter %r on replica %s in %.2f s", name, cand.replica_id,
                    seconds)


def _auth(headers: Any) -> dict[str, str]:
    if headers is None:
        return {}
    return {k: v for k, v in headers.items() if k.lower() in _AUTH_HEADERS}


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", ""))[:200]
    return str(body.get("message", body) if isinstance(body, dict) else body)[:200]


def _already_loaded(resp: httpx.Response) -> bool:
    """vLLM answers 400 "... has already been loaded" to a second load of a name: success here."""
    return resp.status_code == 400 and "already" in _message(resp).lower()
