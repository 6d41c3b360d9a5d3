"""kopf handlers (thin): build the children (children.py), server-side apply them, write status.

`kvserve operator` runs `build_registry()`; handlers are sync so kopf runs them in threads and the
blocking Kubernetes client never stalls its event loop.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvserve.operator import adapter_sync
from kvserve.operator.children import Children, build_children
from kvserve.operator.conditions import (
    Condition, merge_conditions, now, readiness, same_conditions,
)
from kvserve.operator.crd import GROUP, PLURAL, VERSION
from kvserve.operator.kube import FIELD_MANAGER, KubeClient, KubeError, KubeTransientError
from kvserve.operator.model_files import ModelReader, ModelReadError
from kvserve.operator.pd_roles import readiness_view
from kvserve.operator.reconcile import ApplyResult, apply_objects, create_missing, prune
from kvserve.operator.resources import engine_live, engine_replicas, names, selector_string
from kvserve.operator.sizing import Sizing
from kvserve.operator.spec import InvalidSpecError, ServiceSpec, parse_spec

STATUS_INTERVAL = 30.0
RETRY_DELAY = 15.0
MODEL_RETRY_DELAY = 60.0  # a hub that cannot be reached: retry, but never in a hot loop


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Startup: a Kubernetes client (unless the caller put one in memo), quiet event posting."""
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = "kvserve.io/operator"
    if getattr(memo, "kube", None) is None:
        memo.kube = KubeClient.from_environment()
    if getattr(memo, "models", None) is None:
        memo.models = ModelReader(kube=memo.kube)


def close_client(memo: kopf.Memo, **_: Any) -> None:
    """Cleanup: handler threads still running fail fast instead of waiting on the network."""
    if getattr(memo, "kube", None) is not None:
        memo.kube.close()


def _write_conditions(patch: kopf.Patch, body: kopf.Body, new: list[Condition]) -> None:
    existing = list(body.get("status", {}).get("conditions", []) or [])
    generation = body.get("metadata", {}).get("generation")
    merged = merge_conditions(existing, new, generation, now())
    if not same_conditions(existing, merged):
        patch.status["conditions"] = merged


def _refuse(body: kopf.Body, patch: kopf.Patch, exc: InvalidSpecError) -> None:
    _write_conditions(patch, body, [Condition("Ready", "False", exc.reason, str(exc)),
                                    Condition("Sized", "False", exc.reason, str(exc))])
    patch.status["observedGeneration"] = body.get("metadata", {}).get("generation")
    kopf.warn(body, reason=exc.reason, message=str(exc))


def _apply(kube: KubeClient, built: Children) -> ApplyResult:
    result = apply_objects(kube, built.objects)
    create_missing(kube, built.create_once, result)
    spec = built.spec
    prune(kube, spec.namespace, spec.name, spec.uid, built.objects, result)
    return result


def _applied(body: kopf.Body, patch: kopf.Patch, result: ApplyResult) -> Condition:
    """What was applied and when: status.lastApplied moves only when something changed."""
    if result.changed:
        patch.status["lastApplied"] = {
            "time": now(), "generation": body.get("metadata", {}).get("generation"),
            "applied": result.applied, "deleted": result.deleted}
    total = len(result.applied) + len(result.unchanged)
    return Condition("Applied", "True", "ServerSideApplied",
                     f"{total} child objects applied by server-side apply (field manager "
                     f"{FIELD_MANAGER}); status.lastApplied lists the last changes")


def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger,
              **_: Any) -> None:
    """create/update/resume: make the cluster match the spec, or refuse it with a reason."""
    try:
        built = build_children(body, getattr(memo, "models", None))
    except ModelReadError as exc:  # never a guessed size: say why, retry slowly or not at all
        _refuse(body, patch, exc)
        if exc.transient:
            raise kopf.TemporaryError(f"{exc.reason}: {exc}", delay=MODEL_RETRY_DELAY) from exc
        raise kopf.PermanentError(f"{exc.reason}: {exc}") from exc
    except InvalidSpecError as exc:
        _refuse(body, patch, exc)
        raise kopf.PermanentError(f"{exc.reason}: {exc}") from exc
    try:
        result = _apply(memo.kube, built)
    except KubeTransientError as exc:
        raise kopf.TemporaryError(f"Kubernetes API hiccup: {exc}", delay=RETRY_DELAY) from exc
    except KubeError as exc:  # refused (RBAC, admission, a CRD missing): retry slowly, say why
        _write_conditions(patch, body, [Condition("Ready", "False", "ApplyFailed", str(exc)),
                                        Condition("Applied", "False", "ApplyFailed", str(exc))])
        kopf.warn(body, reason="ApplyFailed", message=str(exc))
        raise kopf.TemporaryError(f"ApplyFailed: {exc}", delay=4 * RETRY_DELAY) from exc
    logger.info("applied=%s deleted=%s unchanged=%d foreign=%s", result.applied,
                result.deleted, len(result.unchanged), result.foreign)
    _write_status(body, patch, built.spec, result, built.sizing)
    if body.get("status", {}).get("sizing") != built.sizing.as_status():
        patch.status["sizing"] = built.sizing.as_status()


def _conflict(body: kopf.Body, result: ApplyResult) -> Condition:
    """Conflict=True names the objects of a child's name this service does not own; a Warning
    event goes out when the conflict first appears, not on every resync."""
    if not result.foreign:
        return Condition("Conflict", "False", "NoConflict",
                         "every child object is owned by this KVInferenceService")
    cond = Condition("Conflict", "True", "ForeignObject",
                     f"{', '.join(result.foreign)} already exist(s) without an owner reference "
                     "to this KVInferenceService; the operator leaves them unchanged. Delete "
                     "or rename them (or name the service differently), and the operator "
                     "creates its own at the next resync")
    before = {c.get("type"): c for c in body.get("status", {}).get("conditions", []) or []}
    if before.get("Conflict", {}).get("message") != cond.message:
        kopf.warn(body, reason=cond.reason, message=cond.message)
    return cond


def _write_status(body: kopf.Body, patch: kopf.Patch, spec: ServiceSpec,
                  result: ApplyResult, sizing: Sizing | None = None) -> None:
    if spec.disaggregation is None:
        deployment = engine_live(spec, result.live)
        ready = readiness(deployment, engine_replicas(spec, sizing))
    else:  # every prefill and decode replica
        ready = readiness(*readiness_view(spec, result.live))
    conflict = _conflict(body, result)
    ready_cond = (Condition("Ready", "False", "ForeignObject", conflict.message)
                  if result.foreign else ready.condition)
    status = body.get("status", {})
    fields = {"replicas": ready.replicas, "readyReplicas": ready.ready_replicas,
              "selector": selector_string(spec),
              "observedGeneration": body.get("metadata", {}).get("generation")}
    for name, value in fields.items():
        if status.get(name) != value:
            patch.status[name] = value
    _write_conditions(patch, body, [
        Condition("Sized", "True", "Sized", "GPUs, blocks and concurrency in status.sizing"),
        ready_cond, conflict, _applied(body, patch, result)])


def resync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger,
           **_: Any) -> None:
    """Timer: repair drift (a deleted or edited child object) and refresh readiness in status.

    Refused specs are skipped: the create/update handler already said why. Model files are
    read through the memo's cache, so a resync does not re-read the hub each time.
    """
    try:
        built = build_children(body, getattr(memo, "models", None))
    except InvalidSpecError:
        return
    try:
        result = _apply(memo.kube, built)
    except KubeError as exc:
        raise kopf.TemporaryError(f"resync failed: {exc}", delay=RETRY_DELAY) from exc
    if result.changed:
        logger.warning("repaired drift: applied=%s deleted=%s", result.applied, result.deleted)
    _write_status(body, patch, built.spec, result, built.sizing)
    if adapter_sync.wanted(built.spec):  # new pods (scale-up, restart) get the adapters too
        _sync_adapters(body, patch, memo, built.spec)


def _sync_adapters(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo,
                   spec: ServiceSpec) -> adapter_sync.SyncResult:
    pod_url = getattr(memo, "pod_url", None) or adapter_sync.default_pod_url
    try:
        result = adapter_sync.sync(spec, memo.kube, pod_url)
    except KubeError as exc:
        raise kopf.TemporaryError(f"listing the engine pods failed: {exc}",
                                  delay=RETRY_DELAY) from exc
    entries = adapter_sync.status_entries(spec, result.held, result.problems)
    if body.get("status", {}).get("adapters") != entries:
        patch.status["adapters"] = entries
    return result


def adapters_changed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger,
                     **_: Any) -> None:
    """spec.adapters changed: load and unload on the running engine pods (no restart). What is
    left (a fetch still running, a pod still starting) the resync timer finishes: no retry
    loop here, whose progress kopf would keep in the object."""
    try:
        spec = parse_spec(dict(body), getattr(memo, "models", None))
    except InvalidSpecError:
        return  # the reconcile handler says why
    if not adapter_sync.wanted(spec):
        return
    result = _sync_adapters(body, patch, memo, spec)
    logger.info("adapters: %s", {pod: sorted(have) for pod, have in result.held.items()})
    if not result.complete:
        logger.warning("adapters not everywhere yet (the resync timer retries): %s", "; ".join(
            f"{k}: {v}" for k, v in sorted(result.problems.items())))


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
    kopf.on.field(*resource, field="spec.adapters", registry=registry,
                  id="adapters")(adapters_changed)
    return registry
