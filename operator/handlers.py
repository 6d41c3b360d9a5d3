"""kopf handlers (thin): parse + size + build (pure modules), apply, and write status.

`kvserve operator` runs `build_registry()`; handlers are sync so kopf runs them in threads and the
blocking Kubernetes client never stalls its event loop.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvserve.operator.conditions import (
    Condition, merge_conditions, now, readiness, same_conditions,
)
from kvserve.operator.crd import GROUP, PLURAL, VERSION
from kvserve.operator.kube import KubeClient, KubeError, KubeTransientError
from kvserve.operator.reconcile import ApplyResult, apply_objects, prune
from kvserve.operator.resources import desired_objects, engine_replicas, names, selector_string
from kvserve.operator.sizing import plan
from kvserve.operator.spec import InvalidSpecError, ServiceSpec, parse_spec

STATUS_INTERVAL = 30.0
RETRY_DELAY = 15.0


def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """Startup: a Kubernetes client (unless the caller put one in memo), quiet event posting."""
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = "kvserve.io/operator"
    if getattr(memo, "kube", None) is None:
        memo.kube = KubeClient.from_environment()


def close_client(memo: Any, **_: Any) -> None:
    """Cleanup: handler threads still running fail fast instead of waiting on the network."""
    if getattr(memo, "kube", None) is not None:
        memo.kube.close()


def _write_conditions(patch: Any, body: Any, new: list[Condition]) -> None:
    existing = list(body.get("status", {}).get("conditions", []) or [])
    generation = body.get("metadata", {}).get("generation")
    merged = merge_conditions(existing, new, generation, now())
    if not same_conditions(existing, merged):
        patch.status["conditions"] = merged


def _refuse(body: Any, patch: Any, exc: InvalidSpecError) -> None:
    _write_conditions(patch, body, [Condition("Ready", "False", exc.reason, str(exc)),
                                    Condition("Sized", "False", exc.reason, str(exc))])
    patch.status["observedGeneration"] = body.get("metadata", {}).get("generation")
    kopf.warn(body, reason=exc.reason, message=str(exc))


def _apply(kube: KubeClient, spec: ServiceSpec, objects: list[dict]) -> ApplyResult:
    result = apply_objects(kube, objects)
    prune(kube, spec.namespace, spec.name, spec.uid, objects, result)
    return result


def reconcile(body: Any, patch: Any, memo: Any, logger: logging.Logger, **_: Any) -> None:
    """create/update/resume: make the cluster match the spec, or refuse it with a reason."""
    try:
        spec = parse_spec(dict(body))
        sizing = plan(spec)
    except InvalidSpecError as exc:
        _refuse(body, patch, exc)
        raise kopf.PermanentError(f"{exc.reason}: {exc}") from exc
    try:
        result = _apply(memo.kube, spec, desired_objects(spec, sizing))
    except KubeTransientError as exc:
        raise kopf.TemporaryError(f"Kubernetes API hiccup: {exc}", delay=RETRY_DELAY) from exc
    except KubeError as exc:  # refused (RBAC, admission): retry slowly, say why
        _write_conditions(patch, body, [Condition("Ready", "False", "ApplyFailed", str(exc))])
        kopf.warn(body, reason="ApplyFailed", message=str(exc))
        raise kopf.TemporaryError(f"ApplyFailed: {exc}", delay=4 * RETRY_DELAY) from exc
    logger.info("applied: created=%s patched=%s deleted=%s unchanged=%d", result.created,
                result.patched, result.deleted, len(result.unchanged))
    _write_status(body, patch, spec, result.live.get(f"Deployment/{names(spec)['engine']}"))
    if body.get("status", {}).get("sizing") != sizing.as_status():
        patch.status["sizing"] = sizing.as_status()


def _write_status(body: Any, patch: Any, spec: ServiceSpec, deployment: dict | None) -> None:
    ready = readiness(deployment, engine_replicas(spec))
    status = body.get("status", {})
    fields = {"replicas": ready.replicas, "readyReplicas": ready.ready_replicas,
              "selector": selector_string(spec),
              "observedGeneration": body.get("metadata", {}).get("generation")}
    for name, value in fields.items():
        if status.get(name) != value:
            patch.status[name] = value
    _write_conditions(patch, body, [
        Condition("Sized", "True", "Sized", "GPUs, blocks and concurrency in status.sizing"),
        ready.condition])


def resync(body: Any, patch: Any, memo: Any, logger: logging.Logger, **_: Any) -> None:
    """Timer: repair drift (a deleted or edited child object) and refresh readiness in status.

    Refused specs are skipped: the create/update handler already said why.
    """
    try:
        spec = parse_spec(dict(body))
        sizing = plan(spec)
    except InvalidSpecError:
        return
    try:
        result = _apply(memo.kube, spec, desired_objects(spec, sizing))
    except KubeError as exc:
        raise kopf.TemporaryError(f"resync failed: {exc}", delay=RETRY_DELAY) from exc
    if result.changed:
        logger.warning("repaired drift: created=%s patched=%s deleted=%s", result.created,
                       result.patched, result.deleted)
    _write_status(body, patch, spec, result.live.get(f"Deployment/{names(spec)['engine']}"))


def build_registry(status_interval: float = STATUS_INTERVAL,
                   login: bool = True) -> kopf.OperatorRegistry:
    """All handlers on a fresh registry; login=False leaves logging in to the caller (tests)."""
    registry = kopf.OperatorRegistry()
    if login:  # service account in a pod, else the kubeconfig, via the kubernetes client
        kopf.on.login(registry=registry)(kopf.login_via_client)
    kopf.on.startup(registry=registry)(configure)
    kopf.on.cleanup(registry=registry)(close_client)
    resource = (GROUP, VERSION, PLURAL)
    for decorator in (kopf.on.create, kopf.on.update, kopf.on.resume):
        decorator(*resource, registry=registry, id="reconcile")(reconcile)
    kopf.timer(*resource, registry=registry, interval=status_interval, initial_delay=1.0,
               id="resync")(resync)
    return registry
