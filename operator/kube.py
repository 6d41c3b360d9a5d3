"""A small Kubernetes REST client for the kinds the operator owns: get, list, apply, delete.

Built on the `kubernetes` package's ApiClient (credentials from the pod's service account or a
kubeconfig); bodies are plain dicts; children are written by server-side apply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from kvserve.operator.trust import redact

# (apiVersion, kind) -> plural of every kind the operator writes.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("networking.k8s.io/v1", "Ingress"): "ingresses",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    # spec.routing.mode inferencePool: the pool, and the endpoint picker's identity and RBAC.
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("batch/v1", "Job"): "jobs",
    # a replica over several nodes (leader_worker_set.py)
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
    # spec.disaggregation.workload DisaggregatedSet (pd_roles.py)
    ("disaggregatedset.x-k8s.io/v1", "DisaggregatedSet"): "disaggregatedsets",
}
# Kinds the operator creates and reads one by one, never lists (RBAC: create, get): the
# registration Secret, and the hub token Secret a service names in spec.model.tokenSecretRef.
CREATE_ONLY: dict[tuple[str, str], str] = {("v1", "Secret"): "secrets"}
# Kinds the operator only reads (RBAC: get, list): the engine pods, whose adapters it syncs.
READ_ONLY: dict[tuple[str, str], str] = {("v1", "Pod"): "pods"}
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML: the body is sent as JSON
FIELD_MANAGER = "kvserve-operator"


class KubeError(RuntimeError):
    """The API server refused a request (status >= 400): `status` and its message."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(redact(message))  # an echoed object may hold a URL with a password
        self.status = status


class KubeTransientError(KubeError):
    """A hiccup worth retrying: no connection, 429 or 5xx."""


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    try:
        plural = {**PLURALS, **CREATE_ONLY, **READ_ONLY}[api_version, kind]
    except KeyError:
        raise KubeError(f"the operator does not manage {api_version} {kind}", 400) from None
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{plural}"


@dataclass
class KubeClient:
    api: k8s_client.ApiClient
    timeout: float = 30.0
    closed: bool = False

    @classmethod
    def from_environment(cls) -> "KubeClient":
        """The pod's service account inside a cluster, else the current kubeconfig context."""
        cfg = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=cfg)
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(client_configuration=cfg)
        return cls(k8s_client.ApiClient(cfg))

    @classmethod
    def for_url(cls, url: str, timeout: float = 30.0, retries: bool = True) -> "KubeClient":
        """An unauthenticated client of `url` (tests, `kubectl proxy`)."""
        cfg = k8s_client.Configuration(host=url.rstrip("/"))
        if not retries:
            cfg.retries = False  # fail at once: a caller that retries by itself (tests)
        return cls(k8s_client.ApiClient(cfg), timeout=timeout)

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json", query: list | None = None) -> Any:
        """One call; the decoded JSON answer, None on 404; KubeError otherwise."""
        if self.closed:  # the operator is stopping: handler threads end at their next call
            raise KubeTransientError(f"{method} {path}: the client is closed", 0)
        headers = {"Accept": "application/json", "Content-Type": content_type}
        params = self.api.param_serialize(method=method, resource_path=path, query_params=query,
                                          header_params=headers, body=body,
                                          auth_settings=["BearerToken"])
        try:
            resp = self.api.call_api(*params, _request_timeout=self.timeout)
            data = resp.read()
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            raise KubeTransientError(f"{method} {path}: {exc}", 0) from exc
        if resp.status == 404:
            return None
        if resp.status >= 400:
            cls = KubeTransientError if resp.status == 429 or resp.status >= 500 else KubeError
            raise cls(f"{method} {path} -> {resp.status}: {data[:500]!r}", resp.status)
        return json.loads(data) if data else {}

    def close(self) -> None:
        self.closed = True
        self.api.close()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return self.request("GET", f"{collection_path(api_version, kind, namespace)}/{name}")

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list:
        answer = self.request("GET", collection_path(api_version, kind, namespace),
                              query=[("labelSelector", label_selector)])
        return (answer or {}).get("items", [])

    def create(self, obj: dict) -> dict:
        meta = obj["metadata"]
        path = collection_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return self.request("POST", path, body=obj)

    def create_once(self, obj: dict) -> bool:
        """Create obj unless an object of that name exists (409): True when it created it.
        Needs only the create verb: what is there is never read nor changed."""
        try:
            self.create(obj)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def patch(self, obj: dict, patch: dict) -> dict:
        meta = obj["metadata"]
        path = collection_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return self.request("PATCH", f"{path}/{meta['name']}", body=patch,
                            content_type=MERGE_PATCH)

    def apply(self, obj: dict) -> dict:
        """Server-side apply as the operator's field manager, forced: fields it applied before
        and leaves out now are removed (a nodeSelector dropped from the CR leaves the pods)."""
        meta = obj["metadata"]
        path = collection_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        answer = self.request("PATCH", f"{path}/{meta['name']}", body=obj,
                              content_type=APPLY_PATCH, query=query)
        if answer is None:  # servers without apply-creates (emulators): create, same manager
            answer = self.request("POST", path, body=obj,
                                  query=[("fieldManager", FIELD_MANAGER)])
        return answer

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.request("DELETE", f"{collection_path(api_version, kind, namespace)}/{name}")
