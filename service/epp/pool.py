"""Endpoints of an InferencePool (inference.networking.k8s.io/v1): its selector's Ready pods at
each of its targetPorts. `pool_endpoints` is the pure rule; `PoolWatcher` re-reads the pool and
its pods through the Kubernetes API and hands the set to the picker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger("kvserve.epp")
GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Running, not terminating, with an IP and the Ready condition True."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])


def pool_selector(pool: Mapping[str, Any]) -> dict[str, str]:
    """The pool's label selector (v1: `spec.selector.matchLabels`)."""
    selector = (pool.get("spec") or {}).get("selector") or {}
    return dict(selector.get("matchLabels") or {})


def pool_endpoints(pool: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """`podIP:port` for each Ready pod the selector matches and each of `spec.targetPorts`,
    sorted. An empty selector selects nothing (as GIE: a pool must name its pods)."""
    spec = pool.get("spec") or {}
    selector = pool_selector(pool)
    ports = [p.get("number") for p in spec.get("targetPorts") or [] if p.get("number")]
    if not selector or not ports:
        return ()
    out = set()
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if _matches(labels, selector) and pod_ready(pod):
            ip = pod["status"]["podIP"]
            host = f"[{ip}]" if ":" in ip else ip
            out.update(f"{host}:{port}" for port in ports)
    return tuple(sorted(out))


class PoolWatcher:
    """Re-reads the pool and its pods every `interval` seconds; calls `on_change(endpoints)` when
    the set changes (first read included). Kubernetes errors are logged, the last set kept."""

    def __init__(self, name: str, namespace: str, on_change: Callable[[tuple[str, ...]], None],
                 interval: float = 2.0, clients: Callable[[], tuple[Any, Any]] | None = None
                 ) -> None:
        self.name, self.namespace, self.interval = name, namespace, interval
        self.on_change = on_change
        self.clients = clients or _clients  # (CoreV1Api, CustomObjectsApi)
        self.synced = False
        self._last: tuple[str, ...] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        core, custom = await asyncio.to_thread(self.clients)
        while True:
            try:
                endpoints = await asyncio.to_thread(self._read, core, custom)
            except Exception as exc:  # the API server is down or RBAC is missing: keep the set
                logger.warning("cannot read InferencePool %s/%s: %s", self.namespace, self.name,
                               exc)
            else:
                if endpoints != self._last:
                    logger.info("InferencePool %s/%s: %d endpoints", self.namespace, self.name,
                                len(endpoints))
                    self._last = endpoints
                    self.on_change(endpoints)
                self.synced = True
            await asyncio.sleep(self.interval)

    def _read(self, core: Any, custom: Any) -> tuple[str, ...]:
        pool = custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                   self.name)
        selector = ",".join(f"{k}={v}" for k, v in pool_selector(pool).items())
        pods = core.list_namespaced_pod(self.namespace, label_selector=selector) \
            if selector else None
        items = core.api_client.sanitize_for_serialization(pods.items) if pods else []
        return pool_endpoints(pool, items)


def _clients() -> tuple[Any, Any]:
    """CoreV1Api and CustomObjectsApi from the in-cluster config, else ~/.kube/config."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api(), client.CustomObjectsApi()
